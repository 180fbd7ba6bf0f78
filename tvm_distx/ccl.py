"""The communication ABI of lowered programs: the ``tvm_distx.ccl.*`` runtime functions.

:class:`tvm_distx.legalize.LegalizeRedistribute` and
:class:`tvm_distx.legalize.LowerDistIR` write calls of runtime functions whose
names start with ``tvm_distx.ccl.``; every backend (the emulator of
:mod:`tvm_distx.runtime.emulator`, the MPI and disco workers) registers an
implementation of each under that name, through the one adapter of
:mod:`tvm_distx.runtime.collectives`. This module is the contract between
the two sides: the names, the order of the arguments and how the integer
arguments are encoded. It imports no TVM.

All but ``send`` are destination-passing (``R.call_dps_packed``): the output
buffer comes last and is allocated by the caller with the rank-local shape.

=============================== ================================== =================================
function                        arguments (then the output buffer) what the rank does
=============================== ================================== =================================
``tvm_distx.ccl.allreduce``     ``x, kind, group``                 reduce ``x`` over its group
``tvm_distx.ccl.allgather``     ``x, group, (dim,)``               concatenate the group's blocks
                                                                   along ``dim``
``tvm_distx.ccl.reducescatter`` ``x, kind, group, (dim,)``         reduce ``x`` over its group;
                                                                   member ``k`` keeps block ``k`` of
                                                                   the result along ``dim``
``tvm_distx.ccl.alltoall``      ``x, group, (split, concat)``      split ``x`` along ``split``, send
                                                                   piece ``k`` to member ``k``,
                                                                   concatenate along ``concat``
``tvm_distx.ccl.broadcast``     ``x, group, (root,)``              member ``root``'s ``x``, on every
                                                                   member (the others' ``x`` is not
                                                                   read)
``tvm_distx.ccl.local_slice``   ``x, group, (dim,)``               keep its piece of ``x`` along
                                                                   ``dim`` (no traffic)
``tvm_distx.ccl.send_recv``     ``x, spec``                        a rank of both meshes of a
                                                                   :class:`SendRecvSpec`
``tvm_distx.ccl.send``          ``x, spec`` (no output; impure)    a rank of the source mesh only
``tvm_distx.ccl.recv``          ``spec``                           a rank of the destination mesh
                                                                   only
=============================== ================================== =================================

``group`` is a :class:`CollectiveGroup`, ``spec`` a :class:`SendRecvSpec` and
``kind`` one of :data:`REDUCE_KINDS`, each passed as a shape (a tuple of
integers). A collective is called by every member of its group, in the same
order on every member, and reductions fold the members' values in member
order (the same bits on every backend); a send/recv is called by every device
of either mesh. Ranks that take part in no step of a call do not call it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from .mesh import DeviceMesh
from .placement import Placement, Replicate, Shard
from .spec import TensorSharding

__all__ = [
    "ALLREDUCE",
    "ALLGATHER",
    "REDUCE_SCATTER",
    "BROADCAST",
    "ALLTOALL",
    "LOCAL_SLICE",
    "SEND_RECV",
    "SEND",
    "RECV",
    "FUNCTIONS",
    "REDUCE_KINDS",
    "CollectiveGroup",
    "SendRecvSpec",
    "Piece",
]

ALLREDUCE = "tvm_distx.ccl.allreduce"
ALLGATHER = "tvm_distx.ccl.allgather"
REDUCE_SCATTER = "tvm_distx.ccl.reducescatter"
BROADCAST = "tvm_distx.ccl.broadcast"
ALLTOALL = "tvm_distx.ccl.alltoall"
LOCAL_SLICE = "tvm_distx.ccl.local_slice"
SEND_RECV = "tvm_distx.ccl.send_recv"
SEND = "tvm_distx.ccl.send"
RECV = "tvm_distx.ccl.recv"

#: Every runtime function a lowered program may call.
FUNCTIONS = (ALLREDUCE, ALLGATHER, REDUCE_SCATTER, ALLTOALL, BROADCAST, LOCAL_SLICE, SEND_RECV,
             SEND, RECV)

#: Reduction kinds, as ``tvm_distx.ccl.allreduce`` and ``reducescatter`` receive them.
REDUCE_KINDS = {"sum": 0, "prod": 1, "min": 2, "max": 3, "avg": 4}


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
        import numpy as np

        grid = np.arange(int(np.prod(self.mesh_shape))).reshape(self.mesh_shape)
        coord = list(np.unravel_index(device - self.first_device, self.mesh_shape))
        index = tuple(slice(None) if axis in self.axes else coord[axis]
                      for axis in range(len(self.mesh_shape)))
        return tuple(int(d) + self.first_device for d in np.ravel(grid[index]))

    def all_groups(self) -> tuple[tuple[int, ...], ...]:
        """Every group of the mesh, each in group order (for making communicators)."""
        import numpy as np

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
    :func:`tvm_distx.legalize.planner.send_recv_transfers`, so the IR carries
    only the spec. Encoded as ``(tensor ndim, *shape, *src, *dst)`` where each
    sharding is ``(mesh ndim, *mesh shape, first device, *codes)`` with one
    code per mesh axis: -1 for ``R``, ``k`` for ``S[k]``.

    Parameters
    ----------
    shape : tuple of int
        The global static shape.
    src, dst : TensorSharding
        The shardings before and after.
    """

    shape: tuple[int, ...]
    src: TensorSharding
    dst: TensorSharding

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
            raise ValueError(f"trailing values in a send/recv spec: {values!r}")
        return cls(shape, src, dst)

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
        from tvm_distx.legalize.planner import send_recv_transfers, shard_bounds

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
        from tvm_distx.legalize.planner import send_recv_transfers, shard_bounds

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
    codes = [e.dim if isinstance(e, Shard) else -1 for e in sharding.placement.entries]
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
    placement = Placement(tuple(Shard(c) if c >= 0 else Replicate() for c in codes))
    return TensorSharding(mesh, placement), v[2 + 2 * ndim:]
