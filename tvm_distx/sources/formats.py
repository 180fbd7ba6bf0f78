"""Weight formats: how a weight is stored, encoded from float and decoded back.

A weight of a served model is kept in one of these formats, in a rank's memory
and in a bundle. Every format decodes to float32, and the kernels compute in
float32; a format changes only how many bytes each weight costs (decoding a
token reads every weight a rank holds once, so those bytes are its time).

=========  ====================================  =======================  ==============
format     parts (for a weight ``(m, k)``)       value                    bytes/weight
=========  ====================================  =======================  ==============
``f32``    ``data`` float32 ``(m, k)``           ``data``                 4
``bf16``   ``data`` bfloat16 ``(m, k)``          ``data``                 2
``f16``    ``data`` float16 ``(m, k)``           ``data``                 2
``q8``     ``data`` int8 ``(m, k)``,             ``data * scale``         1.0625
           ``scale`` float16 ``(m, k/32)``
``q4``     ``data`` uint8 ``(m, k/2)``,          ``(nibble - 8) * scale``  0.5625
           ``scale`` float16 ``(m, k/32)``
=========  ====================================  =======================  ==============

The quantized formats cut the last axis (the reduction axis of a linear's
``(out, in)`` weight) into **groups** of :data:`GROUP` = 32 values, each with
its own float16 scale. Both are symmetric (no offset):

* ``q8``: ``scale = max|w| / 127`` over the group, ``data = round(w / scale)``.
* ``q4``: ``scale = -v / 8`` where ``v`` is the group's value of largest
  magnitude, with its sign, and ``nibble = clip(round(w / scale) + 8, 0, 15)``;
  so ``v`` itself is exact (nibble 0), and the other values take 4 bits.
  The 16 bytes of group ``g`` hold its first 16 values in their low nibbles
  and its last 16 in their high nibbles: byte ``16 g + i`` is
  ``nibble[32 g + i] | nibble[32 g + 16 + i] << 4``.

These are the block layouts of llama.cpp's ``Q8_0`` and ``Q4_0`` with the
scales taken out of the blocks, so a GGUF file's tensors of those types are
served as they are stored (:mod:`tvm_distx.sources.gguf`).

A weight's parts share the sharding of its rows and of its groups: a rank that
holds rows ``[r0, r1)`` and groups ``[g0, g1)`` of the weight holds
``data[r0:r1, g0*32:g1*32]`` (``q4``: bytes ``g0*16:g1*16``) and
``scale[r0:r1, g0:g1]``. :class:`EncodedPart` is one part of a weight encoded
on demand: slicing it to a rank's block and reading it encodes only that
block of its float source (a checkpoint's tensor, read lazily). So each rank
quantizes its own slice, reading only its rows and columns.

This module imports numpy only: rank processes and boards use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from tvm_distx.errors import ArgumentError, ArgumentIndexError

__all__ = ["BFLOAT16_BITS", "FORMATS", "GROUP", "QUANTIZED", "EncodedPart", "WeightFormat",
           "bfloat16", "decode", "encode", "is_bfloat16", "numpy_dtype", "sliced_bounds",
           "weight_format"]

#: Values per group of the quantized formats (one float16 scale each).
GROUP = 32


#: ``bfloat16`` values held as their 16-bit patterns, where numpy has no ``bfloat16`` (a
#: board's numpy has no ``ml_dtypes``): they move and are passed to kernels as they are, and
#: :func:`is_bfloat16` tells them from ``uint16`` (numpy compares the two equal).
BFLOAT16_BITS = np.dtype(np.uint16, metadata={"dtype": "bfloat16"})


def bfloat16() -> np.dtype:
    """numpy's ``bfloat16``: ``ml_dtypes``' (which TVM depends on), else :data:`BFLOAT16_BITS`."""
    try:
        import ml_dtypes
    except ImportError:
        return BFLOAT16_BITS
    return np.dtype(ml_dtypes.bfloat16)


def is_bfloat16(dtype: np.dtype) -> bool:
    """Whether ``dtype`` holds bfloat16 values (``ml_dtypes``' or :data:`BFLOAT16_BITS`)."""
    dtype = np.dtype(dtype)
    return dtype.name == "bfloat16" or (dtype.metadata or {}).get("dtype") == "bfloat16"


def numpy_dtype(name) -> np.dtype:
    """The numpy dtype named ``name``, ``"bfloat16"`` included (numpy lacks it)."""
    if str(name) == "bfloat16":
        return bfloat16()
    return np.dtype(name)


@dataclass(frozen=True)
class WeightFormat:
    """One storage format (see the module doc).

    Attributes
    ----------
    name : str
        ``"f32"``, ``"bf16"``, ``"f16"``, ``"q8"`` or ``"q4"``.
    data_dtype : str
        The dtype of the ``data`` part.
    per_byte : int
        Values per byte of ``data`` along the last axis (2 for ``q4``, else 1;
        for the float formats, see ``bits``).
    bits : int
        Bits per value of ``data``.
    group : int
        Values per scale along the last axis (0: no scale).
    """

    name: str
    data_dtype: str
    bits: int
    group: int = 0

    @property
    def quantized(self) -> bool:
        """Whether the format has scales (``q8``, ``q4``)."""
        return self.group > 0

    @property
    def parts(self) -> tuple[str, ...]:
        """The names of the stored parts: ``("data",)`` or ``("data", "scale")``."""
        return ("data", "scale") if self.quantized else ("data",)

    @property
    def per_byte(self) -> int:
        """Values per stored element of ``data`` (2 for ``q4``)."""
        return 2 if self.bits == 4 else 1

    def part_shape(self, part: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of ``part`` for a weight of ``shape``."""
        *lead, k = shape
        if part == "data":
            return (*lead, k // self.per_byte)
        return (*lead, k // self.group)

    def part_dtype(self, part: str) -> np.dtype:
        """The numpy dtype of ``part``."""
        if part == "scale":
            return np.dtype("float16")
        return numpy_dtype(self.data_dtype)

    def bytes_per_value(self) -> float:
        """Stored bytes per weight value, scales included."""
        return self.bits / 8 + (2 / self.group if self.quantized else 0)

    def check_shape(self, name: str, shape: tuple[int, ...]) -> None:
        """Raise unless a weight of ``shape`` can be stored in this format."""
        if self.quantized and (len(shape) < 1 or shape[-1] % self.group):
            raise ArgumentError(
                f"weight '{name}' of shape {list(shape)} cannot be stored as {self.name}: its "
                f"last axis must be a multiple of the group size {self.group}",
                hint="leave this weight out of the quantization, or quantize with "
                "another format")


#: The formats by name.
FORMATS: dict[str, WeightFormat] = {
    "f32": WeightFormat("f32", "float32", 32),
    "bf16": WeightFormat("bf16", "bfloat16", 16),
    "f16": WeightFormat("f16", "float16", 16),
    "q8": WeightFormat("q8", "int8", 8, GROUP),
    "q4": WeightFormat("q4", "uint8", 4, GROUP),
}
#: The names of the quantized formats.
QUANTIZED = tuple(name for name, f in FORMATS.items() if f.quantized)

_ALIASES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int8": "q8",
            "q8_0": "q8", "q4_0": "q4", "fp16": "f16", "fp32": "f32"}


def weight_format(name: str | WeightFormat, where: str = "format") -> WeightFormat:
    """The format named ``name`` (``"q8"``, ``"bfloat16"``...), or an error naming the choices."""
    if isinstance(name, WeightFormat):
        return name
    key = _ALIASES.get(str(name).lower(), str(name).lower())
    if key not in FORMATS:
        raise ArgumentError(f"{where}={name!r} is not a weight format",
                            hint=f"use one of {', '.join(repr(f) for f in FORMATS)}")
    return FORMATS[key]


# ------------------------------------------------------------------------- the codecs
def encode(values: np.ndarray, fmt: str | WeightFormat) -> dict[str, np.ndarray]:
    """Encode a float array (last axis a multiple of the group) into its parts."""
    fmt = weight_format(fmt)
    values = np.asarray(values, dtype=np.float32)
    if not fmt.quantized:
        return {"data": values.astype(fmt.part_dtype("data"))}
    *lead, k = values.shape
    groups = values.reshape(*lead, k // fmt.group, fmt.group)
    if fmt.name == "q8":
        scale = np.abs(groups).max(axis=-1) / 127.0
        inverse = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale > 0)
        data = np.rint(groups * inverse[..., None]).astype(np.int8)
    else:
        at = np.abs(groups).argmax(axis=-1)[..., None]
        scale = np.take_along_axis(groups, at, axis=-1)[..., 0] / -8.0
        inverse = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale != 0)
        nibbles = np.clip(np.rint(groups * inverse[..., None]) + 8, 0, 15).astype(np.uint8)
        half = fmt.group // 2
        data = nibbles[..., :half] | (nibbles[..., half:] << 4)
    return {"data": data.reshape(*lead, -1), "scale": scale.astype(np.float16)}


def decode(parts: dict[str, np.ndarray], fmt: str | WeightFormat) -> np.ndarray:
    """The float32 values of an encoded weight (the reference the kernels must equal)."""
    fmt = weight_format(fmt)
    data = np.asarray(parts["data"])
    if not fmt.quantized:
        return data.astype(np.float32)
    scale = np.asarray(parts["scale"]).astype(np.float32)
    *lead, ngroups = scale.shape
    if fmt.name == "q8":
        values = data.reshape(*lead, ngroups, fmt.group).astype(np.float32)
    else:
        packed = data.reshape(*lead, ngroups, fmt.group // 2)
        values = np.concatenate([packed & 15, packed >> 4], axis=-1).astype(np.float32) - 8
    return (values * scale[..., None]).reshape(*lead, ngroups * fmt.group)


# ------------------------------------------------------------------ encoded on demand
def sliced_bounds(bounds: tuple[tuple[int, int], ...], index, per_group: int, what: str,
                  group: int) -> tuple[tuple[int, int], ...]:
    """The bounds of ``block[index]``, a deferred block of a stored weight's part.

    Parameters
    ----------
    bounds : tuple of (int, int)
        The block's ``[start, stop)`` in the whole part, per dimension.
    index : slice or tuple of slices
        The index (slices of step 1: a rank's block is a box).
    per_group : int
        The part's elements per group along the last axis (1: any cut is whole).
    what : str
        The part, for errors ("a q4 weight's data").
    group : int
        Values per group, for errors.

    Raises
    ------
    ArgumentIndexError
        An index that is not a box, or a last-axis cut through a group.
    """
    if not isinstance(index, tuple):
        index = (index,)
    if len(index) > len(bounds):
        raise ArgumentIndexError(f"{len(index)} indices for {what} of {len(bounds)} dimensions",
                                 hint=f"index at most {len(bounds)} dimensions")
    out = list(bounds)
    for dim, item in enumerate(index):
        if not isinstance(item, slice):
            raise ArgumentIndexError(f"{what} takes slices, not {item!r}",
                                     hint="write i:i+1 for one index")
        start, stop = out[dim]
        first, last, step = item.indices(stop - start)
        if step != 1:
            raise ArgumentIndexError(f"{what} takes slices of step 1 only",
                                     hint="read it, then slice the array")
        out[dim] = (start + first, start + max(first, last))
    if out and (out[-1][0] % per_group or out[-1][1] % per_group):
        raise ArgumentIndexError(
            f"a block [{out[-1][0]}, {out[-1][1]}) of {what} cuts one of its groups of "
            f"{group} values",
            hint="split quantized weights on whole groups (the last axis' extent divided by "
            "the ranks must be a multiple of the group)")
    return tuple(out)


@dataclass(frozen=True)
class EncodedPart:
    """One part of a weight in a format, encoded from its float source when read.

    Slicing (step-1 slices of every axis; the last axis only on whole groups)
    maps the block onto the source and reads nothing; ``np.asarray`` reads that
    block of the source and encodes it. Used for the shards of a weight that a
    program takes quantized (:func:`tvm_distx.quantize`).

    Attributes
    ----------
    source : array-like
        The float weight, whole (a numpy array or a lazy checkpoint tensor).
    fmt : WeightFormat
        The format.
    part : str
        ``"data"`` or ``"scale"``.
    bounds : tuple of (int, int)
        The block of the part this object stands for.
    """

    __distx_deferred__: ClassVar[bool] = True

    source: Any
    fmt: WeightFormat
    part: str
    bounds: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if not self.bounds:
            shape = self.fmt.part_shape(self.part, tuple(self.source.shape))
            object.__setattr__(self, "bounds", tuple((0, d) for d in shape))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.bounds)

    @property
    def ndim(self) -> int:
        return len(self.bounds)

    @property
    def dtype(self) -> np.dtype:
        return self.fmt.part_dtype(self.part)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def _values_per_element(self) -> int:
        """Source values per element of this part along the last axis."""
        return self.fmt.group if self.part == "scale" else self.fmt.per_byte

    def __getitem__(self, index) -> "EncodedPart":
        group = self.fmt.group or 1
        bounds = sliced_bounds(self.bounds, index, group // self._values_per_element(),
                               f"a {self.fmt.name} weight's {self.part}", group)
        return EncodedPart(self.source, self.fmt, self.part, bounds)

    def _source_bounds(self) -> tuple[tuple[int, int], ...]:
        """The block of the source this part's block is encoded from."""
        if not self.bounds:
            return ()
        *lead, (start, stop) = self.bounds
        per = self._values_per_element()
        return (*lead, (start * per, stop * per))

    def read(self) -> np.ndarray:
        """Read the source's block and encode it; this part's array."""
        block = tuple(slice(a, b) for a, b in self._source_bounds())
        source = self.source[block] if block else self.source
        values = np.asarray(source, dtype=np.float32)
        if self.fmt.quantized:
            return encode(values, self.fmt)[self.part]
        return np.ascontiguousarray(values.astype(self.dtype))

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        block = self.read()
        return block if dtype is None else block.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return (f"EncodedPart({self.fmt.name} {self.part}, shape={list(self.shape)} of "
                f"{list(getattr(self.source, 'shape', ()))})")
