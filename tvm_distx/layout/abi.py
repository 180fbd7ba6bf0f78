"""The integer encodings of the runtime ABI: collective groups and point-to-point moves.

This module owns how a lowered program tells the runtime which ranks run a
collective (:class:`CollectiveGroup`) and how a tensor moves point to point
between two shardings (:class:`SendRecvSpec`, each device's :class:`Piece`).
Both are passed as shapes (tuples of ints) and decoded by every backend; the
names of the runtime functions are in :mod:`tvm_distx.ccl`. No TVM and no
compiler module is imported: rank processes use this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from tvm_distx.errors import InternalError, ShardingError
from tvm_distx.layout.mesh import DeviceMesh
from tvm_distx.layout.geometry import decode_placement, encode_placement, send_recv_transfers, shard_bounds
from tvm_distx.layout.placement import Placement, Replicate
from tvm_distx.layout.sharding import TensorSharding

__all__ = ["CollectiveGroup", "SendRecvSpec", "Piece", "RUN_TIME"]

#: The extent a :class:`SendRecvSpec` gives a dimension whose size is known only at
#: run time (a symbolic extent of the program, such as a prompt's length).
RUN_TIME = -1


@dataclass(frozen=True)
class CollectiveGroup:
    """The ranks a collective runs among: sub-groups of a mesh along ``axes``.

    Every rank of the mesh takes part; ranks that differ only in their
    coordinates along ``axes`` form one group, ordered row-major over those
    axes. Encoded as ``(mesh ndim, *mesh shape, first device, *axes)``.

    Parameters
    ----------
    mesh_shape : tuple of int
        The mesh's shape.
    first_device : int
        The global id of the mesh's first device (meshes are device ranges).
    axes : tuple of int
        The mesh axes the collective runs along.
    """

    mesh_shape: tuple[int, ...]
    first_device: int
    axes: tuple[int, ...]

    @classmethod
    def along(cls, mesh: DeviceMesh, axes: Iterable[int]) -> "CollectiveGroup":
        """The group of ``mesh`` along ``axes``."""
        return cls(tuple(mesh.shape), mesh.device_range.start, tuple(axes))

    def encode(self) -> tuple[int, ...]:
        """The flat integer form passed to the runtime."""
        return (len(self.mesh_shape), *self.mesh_shape, self.first_device, *self.axes)

    @classmethod
    def decode(cls, values) -> "CollectiveGroup":
        """Read the flat form back."""
        values = [int(v) for v in values]
        ndim = values[0]
        return cls(tuple(values[1:1 + ndim]), values[1 + ndim], tuple(values[2 + ndim:]))

    def members(self, device: int) -> tuple[int, ...]:
        """The global devices in ``device``'s group, in group order."""
        grid = np.arange(int(np.prod(self.mesh_shape))).reshape(self.mesh_shape)
        coord = list(np.unravel_index(device - self.first_device, self.mesh_shape))
        index = tuple(slice(None) if axis in self.axes else coord[axis]
                      for axis in range(len(self.mesh_shape)))
        return tuple(int(d) + self.first_device for d in np.ravel(grid[index]))

    def all_groups(self) -> tuple[tuple[int, ...], ...]:
        """Every group of the mesh, each in group order (for making communicators)."""
        first = {}
        for device in range(self.first_device, self.first_device + int(np.prod(self.mesh_shape))):
            group = self.members(device)
            first.setdefault(group, None)
        return tuple(first)


@dataclass(frozen=True)
class SendRecvSpec:
    """A point-to-point move of a tensor from one sharding to another.

    The two shardings may be on one mesh (a permutation that no collective
    does cheaply) or on two meshes (a move between pipeline stages). Every
    device derives its own transfers from the spec with
    :func:`tvm_distx.layout.send_recv_transfers`, so the IR carries
    only the spec. Encoded as ``(tensor ndim, *shape, *src, *dst)`` where each
    sharding is ``(mesh ndim, *mesh shape, first device, *codes)`` with one
    code per mesh axis: -1 for ``R``, ``k`` for ``S[k]`` (a partial sum cannot be
    copied, so neither sharding holds one).

    A dimension whose extent is :data:`RUN_TIME` has its size at run time only; neither
    sharding may split it, so every block holds it whole and its extent is read from
    the tensor a rank sends or holds (:meth:`resolved`). A rank that only receives
    such a move learns the extents first from the senders (:meth:`header`).

    Parameters
    ----------
    shape : tuple of int
        The global shape, :data:`RUN_TIME` for an extent known at run time only.
    src, dst : TensorSharding
        The shardings before and after.
    """

    shape: tuple[int, ...]
    src: TensorSharding
    dst: TensorSharding

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        for dim in self.run_time_dims:
            for sharding in (self.src, self.dst):
                if any(entry.is_shard(dim) for entry in sharding.placement.entries):
                    raise ShardingError(
                        f"a send/recv cannot split dimension {dim}, whose extent is known at "
                        f"run time only ({sharding})", placement=str(sharding.placement),
                        hint="keep dimensions of run-time size whole across a move between "
                        "meshes")
        for sharding in (self.src, self.dst):
            if sharding.placement.has_partial():
                raise ShardingError(
                    f"a send/recv cannot move the partial sum {sharding}",
                    placement=str(sharding.placement),
                    hint="reduce the partial axes first (plan_redistribute plans the reduction)",
                )

    def encode(self) -> tuple[int, ...]:
        """The flat integer form passed to the runtime."""
        return (len(self.shape), *self.shape, *_encode_sharding(self.src),
                *_encode_sharding(self.dst))

    @classmethod
    def decode(cls, values) -> "SendRecvSpec":
        """Read the flat form back."""
        v = [int(x) for x in values]
        rank = v[0]
        shape = tuple(v[1:1 + rank])
        src, rest = _decode_sharding(v[1 + rank:])
        dst, rest = _decode_sharding(rest)
        if rest:
            raise InternalError(f"trailing values in a send/recv spec: {values!r}")
        return cls(shape, src, dst)

    @property
    def run_time_dims(self) -> tuple[int, ...]:
        """The dimensions whose extent is :data:`RUN_TIME`."""
        return tuple(d for d, extent in enumerate(self.shape) if extent == RUN_TIME)

    def resolved(self, block_shape: Iterable[int], sharding: TensorSharding | None = None
                 ) -> "SendRecvSpec":
        """This spec with its run-time extents read from a rank's block of the tensor.

        ``block_shape`` is the shape of a block of ``sharding`` (the source's when
        None); the run-time dimensions are never split, so a block holds them whole.
        """
        block = tuple(int(n) for n in block_shape)
        if not self.run_time_dims:
            return self
        if len(block) != len(self.shape):
            raise ShardingError(f"a send/recv of a {len(self.shape)}-D tensor was given a "
                                f"{len(block)}-D block {block}")
        shape = tuple(block[d] if extent == RUN_TIME else extent
                      for d, extent in enumerate(self.shape))
        return SendRecvSpec(shape, self.src, self.dst)

    def header(self) -> "SendRecvSpec | None":
        """The move of the run-time shape, or None when no rank needs it.

        Ranks of the destination mesh only (no block of the source) cannot read
        the run-time extents from a tensor: before the move, the source mesh sends
        them the global shape, an ``int64`` vector moved from replicated on the
        source mesh to replicated on the destination mesh. Every device of either
        mesh takes part in it.
        """
        if not self.run_time_dims or set(self.dst.mesh.device_range) <= \
                set(self.src.mesh.device_range):
            return None
        replicated = [Replicate()]
        return SendRecvSpec(
            (len(self.shape),),
            TensorSharding(self.src.mesh, Placement(tuple(replicated * self.src.mesh.ndim))),
            TensorSharding(self.dst.mesh, Placement(tuple(replicated * self.dst.mesh.ndim))))

    def role(self, device: int) -> str | None:
        """What ``device`` calls: ``"send_recv"``, ``"send"``, ``"recv"`` or None."""
        sends = device in self.src.mesh.device_range
        receives = device in self.dst.mesh.device_range
        if sends and receives:
            return "send_recv"
        if sends:
            return "send"
        if receives:
            return "recv"
        return None

    def pieces(self, device: int) -> list["Piece"]:
        """What ``device`` copies into its destination block, and from which device.

        The part it already holds comes first (``sender == device``), then one
        piece per transfer it receives, in the order every backend posts them.
        Empty for a device outside the destination mesh.
        """
        mine = shard_bounds(self.dst, self.shape, device)
        if mine is None:
            return []
        out = []
        own = shard_bounds(self.src, self.shape, device)
        if own is not None:
            overlap = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(own, mine))
            if all(a < b for a, b in overlap):
                out.append(Piece(device, _within(overlap, own), _within(overlap, mine)))
        for t in send_recv_transfers(self.src, self.dst, self.shape):
            if t.receiver == device:
                held = shard_bounds(self.src, self.shape, t.sender)
                out.append(Piece(t.sender, _within(t.bounds, held), _within(t.bounds, mine)))
        return out

    def sends(self, device: int) -> list[tuple[int, tuple[slice, ...]]]:
        """What ``device`` sends: ``(receiver, slices of its source block)``, in posting order."""
        held = shard_bounds(self.src, self.shape, device)
        return [(t.receiver, _within(t.bounds, held))
                for t in send_recv_transfers(self.src, self.dst, self.shape)
                if t.sender == device and t.receiver != device]

    def participants(self) -> tuple[int, ...]:
        """Every device of either mesh, in increasing order."""
        return tuple(sorted(set(self.src.mesh.device_range) | set(self.dst.mesh.device_range)))


@dataclass(frozen=True)
class Piece:
    """A box a device copies into its destination block.

    Parameters
    ----------
    sender : int
        The device holding it (the receiver itself for data it keeps).
    source : tuple of slice
        Where the box lies in the sender's source block.
    target : tuple of slice
        Where it goes in the receiver's destination block.
    """

    sender: int
    source: tuple[slice, ...]
    target: tuple[slice, ...]


def _within(box, block) -> tuple[slice, ...]:
    """A global box as slices of a block (both as ``(start, stop)`` per dimension)."""
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(box, block))


def _encode_sharding(sharding: TensorSharding) -> tuple[int, ...]:
    mesh = sharding.mesh
    codes = encode_placement(sharding.placement)
    return (mesh.ndim, *mesh.shape, mesh.device_range.start, *codes)


def _decode_sharding(v: list[int]) -> tuple[TensorSharding, list[int]]:
    ndim = v[0]
    mesh_shape = tuple(v[1:1 + ndim])
    first = v[1 + ndim]
    codes = v[2 + ndim:2 + 2 * ndim]
    size = 1
    for extent in mesh_shape:
        size *= extent
    mesh = DeviceMesh(mesh_shape, range(first, first + size))
    return TensorSharding(mesh, decode_placement(tuple(codes))), v[2 + 2 * ndim:]
