"""Cutting global arrays into the shards each device holds, and putting them back."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from tvm_distx.errors import ArgumentError
from tvm_distx.layout import TensorSharding, shard_bounds

__all__ = ["shard_array", "assemble_array", "assemble_results", "first_holder"]


def shard_array(array: np.ndarray, sharding: TensorSharding, device: int) -> np.ndarray:
    """The part of a global ``array`` that ``device`` holds under ``sharding``.

    A dimension split by several mesh axes is split with the lower-numbered
    mesh axis as the outer (major) split (see
    :func:`tvm_distx.layout.shard_bounds`).

    Raises
    ------
    ArgumentError
        If ``device`` is not in the sharding's mesh.
    """
    bounds = shard_bounds(sharding, array.shape, device)
    if bounds is None:
        raise ArgumentError(f"device {device} is not in mesh {sharding.mesh.describe()}",
                            hint="give a device of the sharding's mesh")
    return np.ascontiguousarray(array[tuple(slice(a, b) for a, b in bounds)])


def assemble_array(shards: Mapping[int, np.ndarray], sharding: TensorSharding,
                   shape: tuple[int, ...]) -> np.ndarray:
    """The global array from the shards of the devices of ``sharding``'s mesh.

    Parameters
    ----------
    shards : mapping of int to numpy.ndarray
        Per device, its local block. A device may be left out when another
        device present holds the same block (a replica).
    sharding : TensorSharding
        How the array is laid out.
    shape : tuple of int
        The global shape.

    Returns
    -------
    numpy.ndarray

    Raises
    ------
    ArgumentError
        If some block is held by no device given, or a block has the wrong shape.
    """
    blocks: dict[tuple, np.ndarray] = {}
    wanted = []
    for device in sharding.mesh.device_range:
        bounds = shard_bounds(sharding, shape, device)
        wanted.append((device, bounds))
        if device in shards and bounds not in blocks:
            block = np.asarray(shards[device])
            want = tuple(b - a for a, b in bounds)
            if block.shape != want:
                raise ArgumentError(f"device {device} returned shape {block.shape}, "
                                    f"expected {want}",
                                    hint="give each device its local block (shard_array)")
            blocks[bounds] = block
    out = None
    for device, bounds in wanted:
        if bounds not in blocks:
            raise ArgumentError(f"no device returned the block of device {device} "
                                f"of mesh {sharding.mesh.describe()}",
                                hint="give the blocks of every device, or of one replica of each")
        block = blocks[bounds]
        if out is None:
            out = np.empty(shape, block.dtype)
        out[tuple(slice(a, b) for a, b in bounds)] = block
    return out


def first_holder(sharding: TensorSharding, shape: tuple[int, ...], device: int) -> bool:
    """Whether ``device`` is the lowest device of its mesh holding its block.

    One copy of every block is enough to assemble an array; replicas are
    skipped.
    """
    mine = shard_bounds(sharding, shape, device)
    return all(shard_bounds(sharding, shape, d) != mine
               for d in sharding.mesh.device_range if d < device)


def assemble_results(signature, outs: Sequence):
    """The global results of a function from what every device returned.

    Parameters
    ----------
    signature : tvm_distx.bundle.signature.FunctionSignature
        The function's global signature.
    outs : sequence
        Per device (device ``d`` at index ``d``), its entry's result: a tensor,
        a tuple of the result tensors it holds, or None when it ran nothing.

    Returns
    -------
    numpy.ndarray or tuple of numpy.ndarray
    """
    results = []
    for spec in signature.results:
        shards = {}
        for device in spec.sharding.mesh.device_range:
            out = outs[device]
            if out is None:
                continue
            held = [s for s in signature.results if s.held_by(device)]
            fields = list(out) if signature.tuple_result else [out]
            shards[device] = fields[held.index(spec)]
        results.append(assemble_array(shards, spec.sharding, spec.shape))
    return tuple(results) if signature.tuple_result else results[0]
