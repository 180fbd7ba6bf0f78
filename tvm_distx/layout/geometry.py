"""Where the elements of a sharded tensor live: codes, local sizes, boxes and transfers.

This module owns the geometry of a :class:`~tvm_distx.layout.TensorSharding`
on a static shape, in pure Python and numpy (no TVM):

* the placement codes the planner searches over (:func:`encode_placement`,
  one small int per mesh axis);
* each device's box, ``[start, stop)`` per tensor dimension
  (:func:`device_boxes`, :func:`shard_bounds`);
* the point-to-point copies that move a tensor from one sharding to another
  (:func:`send_recv_transfers`, :class:`Transfer`).

Layout convention: the devices of a mesh are its ``device_range``, laid out in
row-major order over ``mesh.shape``; entry ``k`` of a placement applies to mesh
axis ``k``. Along a mesh axis whose entry is ``S[d]``, tensor dimension ``d`` is
split evenly in mesh-coordinate order. A dimension sharded by several mesh axes
(``"S[0]S[0]"``) is split by the product of their sizes with the
**lower-numbered mesh axis as the major (outer) split**: on a 2x4 mesh, device
``(c0, c1)`` holds block ``c0 * 4 + c1`` of 8 along dimension 0. ``R`` and ``P``
entries do not split: under ``P`` every device's box is its addend's.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from tvm_distx.errors import ShardingError, UnsupportedValueError
from tvm_distx.layout.mesh import DeviceMesh
from tvm_distx.layout.placement import Partial, Placement, Replicate, Shard
from tvm_distx.layout.sharding import TensorSharding

__all__ = [
    "Code",
    "Box",
    "REPLICATE",
    "PARTIAL",
    "encode_placement",
    "decode_placement",
    "sharding_axes",
    "same_blocks_code",
    "split_parts",
    "divides",
    "local_elements",
    "device_boxes",
    "box_volume",
    "intersect",
    "static_shape",
    "check_sharding",
    "shard_bounds",
    "Transfer",
    "send_recv_transfers",
    "transfers",
]

#: A placement as codes: per mesh axis, :data:`REPLICATE`, :data:`PARTIAL` or the sharded dim.
Code = tuple[int, ...]
#: ``[start, stop)`` per tensor dimension.
Box = tuple[tuple[int, int], ...]

#: The code of ``R``.
REPLICATE = -1
#: The code of ``P`` (a partial sum).
PARTIAL = -2


def encode_placement(placement: Placement) -> Code:
    """The codes of ``placement``: ``k`` for ``S[k]``, :data:`REPLICATE`, :data:`PARTIAL`."""
    return tuple(e.dim if isinstance(e, Shard) else PARTIAL if isinstance(e, Partial)
                 else REPLICATE for e in placement.entries)


def decode_placement(code: Code) -> Placement:
    """The placement of :func:`encode_placement`'s codes."""
    return Placement(tuple(Shard(c) if c >= 0 else Partial() if c == PARTIAL else Replicate()
                           for c in code))


def sharding_axes(code: Code, dim: int, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The mesh axes of size > 1 that shard ``dim``, in increasing order (major first)."""
    return tuple(a for a, c in enumerate(code) if c == dim and mesh_shape[a] > 1)


def same_blocks_code(code: Code, mesh_shape: tuple[int, ...]) -> Code:
    """``code`` with every split over a one-device mesh axis written as a replica.

    A split over one device leaves that device the whole dimension, so two
    placements with the same result hold the same block on every device: moving
    between them needs no collective.
    """
    return tuple(REPLICATE if c >= 0 and mesh_shape[a] == 1 else c for a, c in enumerate(code))


def split_parts(code: Code, dim: int, mesh_shape: tuple[int, ...]) -> int:
    """Into how many blocks ``dim`` is split."""
    return math.prod(mesh_shape[a] for a in sharding_axes(code, dim, mesh_shape))


def divides(code: Code, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> bool:
    """True when every dimension of ``shape`` splits evenly under ``code``."""
    return all(n % split_parts(code, d, mesh_shape) == 0 for d, n in enumerate(shape))


def local_elements(code: Code, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> int:
    """The number of elements one device holds."""
    return math.prod(n // split_parts(code, d, mesh_shape) for d, n in enumerate(shape))


@functools.lru_cache(maxsize=4096)
def device_boxes(mesh: DeviceMesh, code: Code, shape: tuple[int, ...]) -> dict[int, Box]:
    """Every device of ``mesh`` and the box it holds (nested splits, major axis first)."""
    boxes: dict[int, Box] = {}
    for offset, device in enumerate(mesh.device_range):
        coord = np.unravel_index(offset, mesh.shape)
        box = []
        for d, n in enumerate(shape):
            block, parts = 0, 1
            for a in sharding_axes(code, d, mesh.shape):
                block = block * mesh.shape[a] + int(coord[a])
                parts *= mesh.shape[a]
            length = n // parts
            box.append((block * length, (block + 1) * length))
        boxes[device] = tuple(box)
    return boxes


def box_volume(box: Box) -> int:
    """The number of elements of a box."""
    return math.prod(stop - start for start, stop in box)


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes; None when it is empty."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    if any(start >= stop for start, stop in out) and out:
        return None
    return out


def static_shape(shape) -> tuple[int, ...]:
    """``shape`` as a tuple of non-negative ints.

    Raises
    ------
    ShardingError
        For anything else (a dynamic extent, a negative one, not a sequence).
    """
    try:
        dims = tuple(shape)
    except TypeError:
        raise ShardingError(f"a shape must be a sequence of ints, got {shape!r}") from None
    out = []
    for extent in dims:
        try:
            value = operator.index(extent)
        except TypeError:
            value = None
        if value is None or isinstance(extent, bool) or value < 0:
            raise ShardingError(
                f"the planner needs a static shape of non-negative ints, got {dims!r}",
                hint="redistribution of dynamic shapes is not supported; give every extent",
            )
        out.append(value)
    return tuple(out)


def check_sharding(sharding: TensorSharding, shape: tuple[int, ...], role: str) -> None:
    """Check that ``sharding`` is a TensorSharding that fits ``shape``.

    Raises
    ------
    UnsupportedValueError
        For anything but a :class:`TensorSharding`.
    ShardDimError, IndivisibleShardError
        If the placement does not fit the shape.
    """
    if not isinstance(sharding, TensorSharding):
        raise UnsupportedValueError(
            f"the {role} must be a TensorSharding, got "
            f"{type(sharding).__name__} {sharding!r}",
            hint="build one with TensorSharding(DeviceMesh(...), Placement.parse(...))",
        )
    sharding.placement.validate(sharding.mesh, shape)


def shard_bounds(sharding: TensorSharding, shape: Sequence[int],
                 device: int) -> tuple[tuple[int, int], ...] | None:
    """The part of a tensor that one device holds.

    Parameters
    ----------
    sharding : TensorSharding
        The tensor's sharding.
    shape : sequence of int
        Its static global shape.
    device : int
        A global device id.

    Returns
    -------
    tuple of (int, int) or None
        ``(start, stop)`` per tensor dimension; None when ``device`` is not in
        the mesh (a scalar held by a device gives ``()``). Under a partial sum
        it is the box of the device's addend.

    Raises
    ------
    PlacementRankError, ShardDimError, IndivisibleShardError
        If the sharding does not fit the mesh or the shape.
    """
    shape = static_shape(shape)
    check_sharding(sharding, shape, "sharding")
    return device_boxes(sharding.mesh, encode_placement(sharding.placement), shape).get(device)


@dataclass(frozen=True)
class Transfer:
    """One point-to-point copy of a ``SEND_RECV``: box ``bounds`` from ``sender`` to ``receiver``.

    Parameters
    ----------
    sender, receiver : int
        Global device ids.
    bounds : tuple of (int, int)
        The global ``[start, stop)`` per tensor dimension of the copied box.
    """

    sender: int
    receiver: int
    bounds: Box

    @property
    def elements(self) -> int:
        """The number of elements copied."""
        return math.prod(stop - start for start, stop in self.bounds)


@functools.lru_cache(maxsize=1024)
def transfers(src: TensorSharding, dst: TensorSharding,
              shape: tuple[int, ...]) -> tuple[Transfer, ...]:
    """:func:`send_recv_transfers` on checked arguments (cached)."""
    src_boxes = device_boxes(src.mesh, encode_placement(src.placement), shape)
    holders: dict[Box, list[int]] = {}
    for device, box in src_boxes.items():
        holders.setdefault(box, []).append(device)
    load = {device: 0 for device in src_boxes}
    out = []
    for receiver, wanted in device_boxes(dst.mesh, encode_placement(dst.placement),
                                         shape).items():
        own = src_boxes.get(receiver)
        # Distinct source boxes partition the tensor, so every one but the
        # receiver's own is data it lacks.
        for box, devices in holders.items():
            if box == own:
                continue
            piece = intersect(box, wanted)
            if piece is None or box_volume(piece) == 0:
                continue
            sender = min(devices, key=lambda h: (load[h], h))
            load[sender] += box_volume(piece)
            out.append(Transfer(sender, receiver, piece))
    return tuple(out)


def send_recv_transfers(src: TensorSharding, dst: TensorSharding,
                        shape: Sequence[int]) -> tuple[Transfer, ...]:
    """The point-to-point copies that move a tensor from ``src`` to ``dst``.

    Every destination device receives the parts of its block that it does not
    hold in ``src``, each from one source device that holds it (the least loaded
    so far, then the lowest id).

    Parameters
    ----------
    src, dst : TensorSharding
        The shardings; the meshes may differ and may share devices. Neither may
        hold a partial sum (copies cannot add addends).
    shape : sequence of int
        The static global shape.

    Returns
    -------
    tuple of Transfer
        By receiver, then by source box.

    Raises
    ------
    ShardingError
        For a partial sum on either side, or a sharding that does not fit.
    """
    shape = static_shape(shape)
    check_sharding(src, shape, "source")
    check_sharding(dst, shape, "destination")
    for role, sharding in (("source", src), ("destination", dst)):
        if sharding.placement.has_partial():
            raise ShardingError(
                f"a send/recv copies elements and cannot add the partial sums of its {role} "
                f"{sharding}",
                placement=str(sharding.placement),
                hint="reduce the partial axes first (plan_redistribute plans the reduction)",
            )
    return transfers(src, dst, shape)
