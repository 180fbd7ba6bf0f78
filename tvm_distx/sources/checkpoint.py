"""Hugging Face checkpoints read lazily: a tensor is read only where it is sliced.

A checkpoint directory written by ``save_pretrained`` holds ``config.json`` and one or
more ``*.safetensors`` files (with ``model.safetensors.index.json`` when there are
several). :func:`open_checkpoint` lists its tensors as :class:`LazyTensor` objects without
reading any data. Slicing a :class:`LazyTensor` composes the slices and still reads
nothing; converting it to an array (``np.asarray``) reads just that block from the
memory-mapped file, through safetensors' own slicing. So cutting a checkpoint into the
shards of each rank (``shard_array``, an export, a session) holds one shard at a time in
memory, never the whole model.

Only basic slicing is supported (integers and slices with step 1), which is all a
block layout needs.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

from tvm_distx.sources.formats import bfloat16
from tvm_distx.errors import ArgumentError, ArgumentIndexError

__all__ = ["LazyTensor", "open_checkpoint"]

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class LazyTensor:
    """One tensor of a safetensors file, or a block of it, not read yet.

    Attributes
    ----------
    path : pathlib.Path
        The ``.safetensors`` file.
    key : str
        The tensor's name in the file.
    bounds : tuple of (int, int)
        The block this object stands for: ``[start, stop)`` per dimension of the
        stored tensor.
    dtype : numpy.dtype
        The dtype the block is converted to when read (a ``bfloat16`` checkpoint
        read as ``float32``, say).
    stored_dtype : str
        The dtype in the file, as safetensors names it (``"F32"``, ``"BF16"``...).
    """

    #: read only when converted with ``np.asarray`` (see ``tvm_distx.layout.derived.is_deferred``)
    __distx_deferred__: ClassVar[bool] = True

    path: Path
    key: str
    bounds: tuple[tuple[int, int], ...]
    dtype: np.dtype
    stored_dtype: str

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.bounds)

    @property
    def ndim(self) -> int:
        return len(self.bounds)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def astype(self, dtype) -> "LazyTensor":
        """The same block, converted to ``dtype`` when read."""
        return LazyTensor(self.path, self.key, self.bounds, np.dtype(dtype), self.stored_dtype)

    def __getitem__(self, index) -> "LazyTensor":
        if not isinstance(index, tuple):
            index = (index,)
        if any(i is Ellipsis for i in index):
            at = index.index(Ellipsis)
            fill = (slice(None),) * (self.ndim - len(index) + 1)
            index = index[:at] + fill + index[at + 1:]
        if len(index) > self.ndim:
            raise ArgumentIndexError(f"{len(index)} indices for a tensor of {self.ndim} dimensions",
                                     hint=f"index at most {self.ndim} dimensions")
        bounds = list(self.bounds)
        for dim, item in enumerate(index):
            start, stop = bounds[dim]
            if isinstance(item, slice):
                first, last, step = item.indices(stop - start)
                if step != 1:
                    raise ArgumentIndexError("a lazy checkpoint tensor takes slices of step 1 only",
                                             hint="read() the block, then slice the array")
                bounds[dim] = (start + first, start + max(first, last))
            else:
                raise ArgumentIndexError(f"a lazy checkpoint tensor takes slices, not {item!r}",
                                         hint="write i:i+1 for one index")
        return LazyTensor(self.path, self.key, tuple(bounds), self.dtype, self.stored_dtype)

    def read(self) -> np.ndarray:
        """Read the block from the file (only it), converted to :attr:`dtype`."""
        from safetensors import safe_open

        index = tuple(slice(start, stop) for start, stop in self.bounds)
        if self.stored_dtype in ("F8_E4M3", "F8_E5M2"):  # no numpy dtype: via torch
            import torch

            with safe_open(self.path, framework="pt") as f:
                block = f.get_slice(self.key)[index] if index else f.get_tensor(self.key)
            return block.to(torch.float32).numpy().astype(self.dtype, copy=False)
        if self.stored_dtype == "BF16":
            bfloat16()  # registers ml_dtypes' bfloat16, which safetensors' numpy reads return
        rows = self._read_rows()
        if rows is not None:
            return np.ascontiguousarray(rows.astype(self.dtype, copy=False))
        with safe_open(self.path, framework="numpy") as f:
            block = f.get_slice(self.key)[index] if index else f.get_tensor(self.key)
        return np.ascontiguousarray(np.asarray(block).astype(self.dtype, copy=False))

    def _read_rows(self) -> np.ndarray | None:
        """The block read from the file with one ``read``, when it is whole rows (else None).

        A block of whole rows (a rank's shard of a weight split on its first axis, or
        the whole tensor) is one contiguous range of the file: it is read into a new
        array without mapping the file, so the rank's memory holds it once, not also
        as mapped pages of the file while it is copied.
        """
        stat = os.stat(self.path)  # the header of the file as it is now
        shape = _stored_shapes(self.path, stat.st_mtime_ns, stat.st_size).get(self.key)
        if shape is None or self.stored_dtype not in _NUMPY_DTYPES or not self.bounds:
            return None
        dims, offset = shape
        if any(bound != (0, d) for bound, d in zip(self.bounds[1:], dims[1:])):
            return None
        stored = (bfloat16() if self.stored_dtype == "BF16"
                  else np.dtype(_NUMPY_DTYPES[self.stored_dtype]))
        row = int(np.prod(dims[1:], dtype=np.int64))
        start, stop = self.bounds[0]
        block = np.fromfile(self.path, dtype=stored, count=(stop - start) * row,
                            offset=offset + start * row * stored.itemsize)
        return block.reshape(self.shape)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        block = self.read()
        return block if dtype is None else block.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return (f"LazyTensor({self.path.name}:{self.key}, shape={list(self.shape)}, "
                f"dtype={self.dtype})")


_NUMPY_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "float32",
                 "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
                 "BOOL": "bool", "F8_E4M3": "float32", "F8_E5M2": "float32"}


@functools.lru_cache(maxsize=64)
def _stored_shapes(path: Path, mtime_ns: int, size: int) -> dict[str, tuple[tuple[int, ...], int]]:
    """``{tensor: (shape, byte offset of its data)}`` of a safetensors file, from its header.

    Cached by the file's path, modification time and size, so a file written again
    is read again.
    """
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    return {key: (tuple(int(d) for d in info["shape"]), 8 + size + int(info["data_offsets"][0]))
            for key, info in header.items() if key != "__metadata__"}


def open_checkpoint(directory, dtype=None) -> dict[str, LazyTensor]:
    """Every tensor of a safetensors checkpoint directory, by name, none of them read.

    Parameters
    ----------
    directory : path
        Written by ``save_pretrained``: ``*.safetensors`` files, with
        ``model.safetensors.index.json`` when the model is split over several.
    dtype : numpy dtype, optional
        Read every floating-point tensor as this dtype (``"float32"``); by
        default each keeps its stored dtype (``bfloat16`` becomes ``float32``,
        which numpy lacks).

    Raises
    ------
    ArgumentError
        If the directory has no safetensors file, or its index names a file
        that is missing.
    """
    from safetensors import safe_open

    root = Path(directory)
    index = root / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as err:
            raise ArgumentError(f"{index} is not a safetensors index ({err})",
                                hint="write the checkpoint with save_pretrained") from None
        files = sorted({root / name for name in weight_map.values()})
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ArgumentError(f"{root} holds no .safetensors file",
                            hint="save the model with model.save_pretrained(directory) "
                            "(safetensors is its default format)")
    tensors: dict[str, LazyTensor] = {}
    for path in files:
        if not path.is_file():
            raise ArgumentError(f"{index.name} names {path.name}, which is missing from {root}",
                                hint="copy the whole checkpoint directory")
        with safe_open(path, framework="numpy") as f:
            for key in f.keys():
                part = f.get_slice(key)
                stored = part.get_dtype()
                want = _NUMPY_DTYPES.get(stored)
                if want is None:
                    raise ArgumentError(f"tensor {key} of {path.name} has dtype {stored}, "
                                        "which tvm-distx cannot read",
                                        hint="save the checkpoint in float32, float16 or "
                                        "bfloat16")
                if dtype is not None and np.dtype(want).kind == "f":
                    want = dtype
                shape = tuple(int(d) for d in part.get_shape())
                tensors[key] = LazyTensor(path, key, tuple((0, d) for d in shape),
                                          np.dtype(want), stored)
    logger.info("checkpoint %s: %d tensors in %d file(s)", root, len(tensors), len(files))
    return tensors
