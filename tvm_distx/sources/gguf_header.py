"""A GGUF file's header: its metadata and its tensor table, read in one pass.

A GGUF file (versions 2 and 3, little-endian) is::

    "GGUF"  version:u32  tensor_count:u64  kv_count:u64
    kv_count x   key:str  value_type:u32  value
    tensor_count x   name:str  n_dims:u32  dims:u64[n_dims]  ggml_type:u32  offset:u64
    padding to general.alignment (32 by default), then the tensors' data

where a ``str`` is its byte length (u64) and its UTF-8 bytes, and an array
value is its item type (u32), its length (u64) and its items. ``dims`` lists
the fastest axis first.

The ``gguf`` package's ``GGUFReader`` reads the same, but makes a numpy view of
every item: a 151936-token vocabulary takes it 11 s on a small host, this
reader a fraction of a second (the numeric arrays are one ``np.frombuffer``
each). The enumerations (value types, tensor types and their block sizes)
are the ``gguf`` package's, imported when a file is read.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tvm_distx.errors import ArgumentError

__all__ = ["GGUFHeader", "TensorInfo", "read_header"]

MAGIC = b"GGUF"
VERSIONS = (2, 3)
#: struct formats of the scalar value types, by ``gguf.GGUFValueType`` name
_SCALARS = {"UINT8": "B", "INT8": "b", "UINT16": "H", "INT16": "h", "UINT32": "I",
            "INT32": "i", "FLOAT32": "f", "BOOL": "?", "UINT64": "Q", "INT64": "q",
            "FLOAT64": "d"}


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table.

    Attributes
    ----------
    name : str
        The tensor's name (``"blk.0.attn_q.weight"``).
    shape : tuple of int
        Its logical shape, slowest axis first (GGUF's ``dims`` reversed).
    ggml_type : str
        Its type (``"Q8_0"``), a ``gguf.GGMLQuantizationType`` name.
    block : tuple of (int, int)
        Values and bytes per block of that type.
    offset : int
        The byte offset of its data in the file.
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: str
    block: tuple[int, int]
    offset: int

    @property
    def nbytes(self) -> int:
        *lead, k = self.shape or (1,)
        return int(np.prod(lead, dtype=np.int64)) * (k // self.block[0]) * self.block[1]


@dataclass(frozen=True)
class GGUFHeader:
    """A GGUF file's metadata (``fields``) and tensor table (``tensors``, by name).

    A field's value is a Python scalar or string; an array is a numpy array
    (numeric items) or a list (strings). A float32 scalar is the shortest
    decimal that rounds to it (``1e-06``, as it was written).
    """

    path: Path
    version: int
    fields: dict[str, Any]
    tensors: dict[str, TensorInfo]
    data_offset: int


class _Cursor:
    """Reads values from a buffer, moving forward."""

    def __init__(self, path: Path, buffer, gguf) -> None:
        self.path, self.buffer, self.at = path, buffer, 0
        self.kinds = gguf.GGUFValueType
        self.scalar = {int(self.kinds[n]): struct.Struct("<" + f) for n, f in _SCALARS.items()}
        self.dtypes = {k: np.dtype("<" + s.format[1:]) for k, s in self.scalar.items()}

    def unpack(self, fmt: str):
        values = struct.unpack_from(fmt, self.buffer, self.at)
        self.at += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (size,) = self.unpack("<Q")
        text = bytes(self.buffer[self.at:self.at + size])
        if len(text) != size:
            raise _unreadable(self.path, "a string runs past the end of the file")
        self.at += size
        return text.decode("utf-8")

    def value(self, kind: int):
        if kind in self.scalar:
            (value,) = self.scalar[kind].unpack_from(self.buffer, self.at)
            self.at += self.scalar[kind].size
            if kind == self.kinds.FLOAT32:
                return float(str(np.float32(value)))  # the decimal it was written from
            return value
        if kind == self.kinds.STRING:
            return self.string()
        if kind == self.kinds.ARRAY:
            item, count = self.unpack("<IQ")
            if item in self.dtypes:  # numeric: one read
                dtype = self.dtypes[item]
                if self.at + count * dtype.itemsize > len(self.buffer):
                    raise _unreadable(self.path, "an array runs past the end of the file")
                array = np.frombuffer(self.buffer, dtype, count, self.at).copy()
                self.at += count * dtype.itemsize
                return array
            return [self.value(item) for _ in range(count)]
        raise _unreadable(self.path, f"a value is of an unknown type {kind}")


def _unreadable(path: Path, why: str) -> ArgumentError:
    return ArgumentError(f"{path} is not a GGUF file tvm-distx can read: {why}",
                         hint="the file may be cut short or damaged; copy, convert or "
                         "download it again")


def read_header(path: Path) -> GGUFHeader:
    """The header of the GGUF file ``path`` (checked to exist and be one).

    Raises
    ------
    ArgumentError
        If the file is missing, is not a GGUF file, is of another version or
        byte order, or its header is cut or malformed.
    """
    import gguf

    path = Path(path)
    if not path.is_file():
        raise ArgumentError(f"no GGUF file {path}",
                            hint="give the path of a .gguf file written by llama.cpp")
    with open(path, "rb") as f:
        magic = f.read(4)
        if magic != MAGIC:
            raise ArgumentError(f"{path} is not a GGUF file (it starts with {magic!r}, not "
                                f"{MAGIC!r})",
                                hint="convert the model with llama.cpp's convert_hf_to_gguf.py; "
                                "serve a Hugging Face checkpoint directory with from_pretrained")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
            try:
                return _parse(path, buffer, gguf)
            except ArgumentError:
                raise
            except struct.error:
                raise _unreadable(path, "it ends inside its header") from None
            except ValueError as err:  # a string not UTF-8, a tensor type gguf does not know
                raise _unreadable(path, str(err)) from None


def _parse(path: Path, buffer, gguf) -> GGUFHeader:
    cursor = _Cursor(path, buffer, gguf)
    cursor.at = len(MAGIC)
    (version,) = cursor.unpack("<I")
    if version not in VERSIONS:
        other = "of the other byte order" if version & 0xFFFF == 0 else f"of version {version}"
        raise ArgumentError(f"{path} is a GGUF file {other}, which tvm-distx does not read "
                            f"(it reads versions {', '.join(map(str, VERSIONS))}, "
                            "little-endian)", hint="convert the model with a recent llama.cpp")
    tensor_count, kv_count = cursor.unpack("<QQ")
    fields = {}
    for _ in range(kv_count):
        key = cursor.string()
        (kind,) = cursor.unpack("<I")
        fields[key] = cursor.value(kind)
    table = []
    for _ in range(tensor_count):
        name = cursor.string()
        (ndims,) = cursor.unpack("<I")
        dims = cursor.unpack(f"<{ndims}Q")
        kind, offset = cursor.unpack("<IQ")
        table.append((name, dims, kind, offset))
    alignment = int(fields.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise _unreadable(path, f"general.alignment {alignment} is not a power of two")
    data_offset = -(-cursor.at // alignment) * alignment
    tensors = {}
    for name, dims, kind, offset in table:
        ggml_type = gguf.GGMLQuantizationType(kind)
        info = TensorInfo(name, tuple(int(d) for d in reversed(dims)), ggml_type.name,
                          tuple(int(v) for v in gguf.GGML_QUANT_SIZES[ggml_type]),
                          data_offset + int(offset))
        if info.shape and info.shape[-1] % info.block[0]:
            raise _unreadable(path, f"tensor {name}'s rows of {info.shape[-1]} values are not "
                              f"whole {ggml_type.name} blocks of {info.block[0]}")
        if info.offset + info.nbytes > len(buffer):
            raise _unreadable(path, f"tensor {name} ends past the end of the file")
        tensors[name] = info
    return GGUFHeader(path, version, fields, tensors, data_offset)
