"""The ``tvm_distx.ccl.*`` runtime functions over MPI (mpi4py), for ranks under ``mpiexec``.

Device ``d`` is rank ``d`` of the world communicator. :func:`install`
registers every function of :mod:`tvm_distx.ccl` as a global TVM function, so
it must run after ``import tvm`` and before a ``relax.VirtualMachine`` is
created (the VM looks its functions up once). It also overrides TVM's own
``runtime.disco.allreduce`` and ``runtime.disco.allgather`` builtins (over the
whole world), so programs lowered by TVM's ``LowerDistIR`` run too.

How each function moves data:

* Buffers are the VM's own tensors, viewed without copy through DLPack
  (``np.from_dlpack``), and passed to mpi4py's buffer (upper-case) calls.
* A collective runs on the communicator of its group, made once per group
  with ``MPI_Comm_create_group`` (collective over the group's members only,
  so a mesh that covers some of the ranks, such as one pipeline stage, makes
  its communicators without the others).
* ``allgather`` along dimension 0 receives straight into the output; along
  another dimension it receives the blocks one after the other into a scratch
  buffer and interleaves them into the output with one copy.
* ``alltoall`` packs the pieces to send contiguously (no copy when splitting
  along dimension 0) and unpacks what it receives the same way.
* ``send_recv``, ``send`` and ``recv`` post every transfer that
  :func:`tvm_distx.legalize.planner.send_recv_transfers` gives this rank as
  non-blocking sends and receives on a private duplicate of the world
  communicator, then wait for all of them. Every rank posts in the same
  program order, so messages between two ranks match in order.

Scratch buffers are kept per shape and dtype, so a program that runs the same
collective again allocates nothing.
"""

from __future__ import annotations

import logging
import math
from typing import Sequence

import numpy as np

from tvm_distx import ccl
from tvm_distx.ccl import CollectiveGroup, SendRecvSpec

__all__ = ["MpiCollectives", "install"]

logger = logging.getLogger(__name__)

_ACTIVE: "MpiCollectives | None" = None


def _blocks(shape: Sequence[int], dim: int, parts: int) -> tuple[int, int, int]:
    """``(outer, length, inner)``: a tensor as ``outer x parts*length x inner`` along ``dim``."""
    outer = math.prod(shape[:dim])
    inner = math.prod(shape[dim + 1:])
    return outer, shape[dim] // parts, inner


class MpiCollectives:
    """The collectives of one rank, on a world communicator.

    Parameters
    ----------
    comm : mpi4py.MPI.Comm
        The world of the job (rank ``d`` is device ``d``).
    """

    def __init__(self, comm) -> None:
        from mpi4py import MPI

        self.mpi = MPI
        self.comm = comm
        self.rank = comm.Get_rank()
        self.p2p = comm.Dup()  # point-to-point traffic never meets anything else
        self._groups: dict[tuple[int, ...], object] = {}
        self._scratch: dict[tuple, np.ndarray] = {}
        self._ops = {0: MPI.SUM, 1: MPI.PROD, 2: MPI.MIN, 3: MPI.MAX, 4: MPI.SUM}

    # ---------------------------------------------------------------- plumbing
    def group(self, encoded) -> tuple[tuple[int, ...], object]:
        """The members of this rank's group and their communicator (made once)."""
        members = CollectiveGroup.decode(encoded).members(self.rank)
        if self.rank not in members:
            raise RuntimeError(f"rank {self.rank} called a collective of group {members}, "
                               "which it is not in")
        comm = self._groups.get(members)
        if comm is None:
            sub = self.comm.Get_group().Incl(list(members))
            comm = self.comm.Create_group(sub, tag=_tag(members))
            sub.Free()
            self._groups[members] = comm
        return members, comm

    def scratch(self, shape: Sequence[int], dtype) -> np.ndarray:
        """A reusable buffer (contents undefined)."""
        key = (tuple(shape), np.dtype(dtype).str)
        buf = self._scratch.get(key)
        if buf is None:
            buf = self._scratch[key] = np.empty(shape, dtype)
        return buf

    # ---------------------------------------------------------------- collectives
    def allreduce(self, x, kind, group, out) -> None:
        members, comm = self.group(group)
        send, recv = np.from_dlpack(x), np.from_dlpack(out)
        comm.Allreduce(send, recv, op=self._ops[int(kind)])
        if int(kind) == 4:
            recv /= len(members)

    def allgather(self, x, group, axes, out) -> None:
        members, comm = self.group(group)
        send, recv = np.from_dlpack(x), np.from_dlpack(out)
        dim, p = int(axes[0]), len(members)
        if math.prod(send.shape[:dim]) == 1:  # blocks land contiguous: receive in place
            comm.Allgather(send, recv)
            return
        blocks = self.scratch((p, *send.shape), send.dtype)
        comm.Allgather(send, blocks)
        outer, length, inner = _blocks(recv.shape, dim, p)
        recv.reshape(outer, p, length, inner)[...] = (
            blocks.reshape(p, outer, length, inner).transpose(1, 0, 2, 3))

    def alltoall(self, x, group, axes, out) -> None:
        members, comm = self.group(group)
        send, recv = np.from_dlpack(x), np.from_dlpack(out)
        split, concat, p = int(axes[0]), int(axes[1]), len(members)
        outer, length, inner = _blocks(send.shape, split, p)
        if outer == 1:
            packed = send  # piece k is already the k-th contiguous chunk
        else:
            packed = self.scratch((p, outer, length, inner), send.dtype)
            packed[...] = send.reshape(outer, p, length, inner).transpose(1, 0, 2, 3)
        outer, length, inner = _blocks(recv.shape, concat, p)
        if outer == 1:
            comm.Alltoall(packed, recv)
            return
        got = self.scratch((p, outer, length, inner), recv.dtype)
        comm.Alltoall(packed, got)
        recv.reshape(outer, p, length, inner)[...] = got.transpose(1, 0, 2, 3)

    def local_slice(self, x, group, axes, out) -> None:
        members, _ = self.group(group)
        send, recv = np.from_dlpack(x), np.from_dlpack(out)
        dim = int(axes[0])
        length = send.shape[dim] // len(members)
        start = members.index(self.rank) * length
        index = [slice(None)] * send.ndim
        index[dim] = slice(start, start + length)
        recv[...] = send[tuple(index)]

    # ---------------------------------------------------------------- point to point
    def move(self, x, spec, out) -> None:
        """This rank's side of a send/recv: ``x`` None when it only receives, ``out`` when it
        only sends."""
        from tvm_distx.legalize.planner import send_recv_transfers, shard_bounds

        move = SendRecvSpec.decode(spec)
        me = self.rank
        send = np.from_dlpack(x) if x is not None else None
        recv = np.from_dlpack(out) if out is not None else None
        held = shard_bounds(move.src, move.shape, me) if send is not None else None
        mine = shard_bounds(move.dst, move.shape, me) if recv is not None else None
        requests, landing = [], []
        for t in send_recv_transfers(move.src, move.dst, move.shape):
            if t.sender == me and t.receiver != me:
                piece = np.ascontiguousarray(send[_within(t.bounds, held)])
                requests.append(self.p2p.Isend(piece, dest=t.receiver, tag=_P2P_TAG))
                landing.append((piece, None))  # keep the buffer alive until sent
            elif t.receiver == me:
                buf = np.empty([b - a for a, b in t.bounds], recv.dtype)
                requests.append(self.p2p.Irecv(buf, source=t.sender, tag=_P2P_TAG))
                landing.append((buf, t.bounds))
        if send is not None and recv is not None:  # what this rank keeps
            overlap = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(held, mine))
            if all(a < b for a, b in overlap):
                recv[_within(overlap, mine)] = send[_within(overlap, held)]
        self.mpi.Request.Waitall(requests)
        for buf, bounds in landing:
            if bounds is not None:
                recv[_within(bounds, mine)] = buf

    # ---------------------------------------------------------------- TVM's builtins
    def disco_allreduce(self, x, kind, in_group, out) -> None:
        code = int(kind[0]) if hasattr(kind, "__len__") else int(kind)
        send, recv = np.from_dlpack(x), np.from_dlpack(out)
        self.comm.Allreduce(send, recv, op=self._ops[code])
        if code == 4:
            recv /= self.comm.Get_size()

    def disco_allgather(self, x, in_group, out) -> None:
        self.comm.Allgather(np.from_dlpack(x), np.from_dlpack(out))


_P2P_TAG = 17


def _tag(members: tuple[int, ...]) -> int:
    """A tag for making a group's communicator (the same on every member)."""
    return hash(members) % 30000


def _within(box, origin) -> tuple[slice, ...]:
    """``box`` (global bounds) as slices of a block that starts at ``origin``."""
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(box, origin))


def install(comm=None) -> MpiCollectives:
    """Register the MPI collectives as the ``tvm_distx.ccl.*`` functions of this process.

    Parameters
    ----------
    comm : mpi4py.MPI.Comm, optional
        The job's world (``MPI.COMM_WORLD`` by default). Collective: every rank
        of it must call :func:`install`.

    Returns
    -------
    MpiCollectives
        The installed implementation.
    """
    import tvm  # noqa: F401 - TVM's own registrations must come first
    import tvm_ffi
    from mpi4py import MPI

    global _ACTIVE
    impl = MpiCollectives(comm if comm is not None else MPI.COMM_WORLD)
    functions = {
        ccl.ALLREDUCE: impl.allreduce,
        ccl.ALLGATHER: impl.allgather,
        ccl.ALLTOALL: impl.alltoall,
        ccl.LOCAL_SLICE: impl.local_slice,
        ccl.SEND_RECV: impl.move,
        ccl.SEND: lambda x, spec: impl.move(x, spec, None),
        ccl.RECV: lambda spec, out: impl.move(None, spec, out),
        "runtime.disco.allreduce": impl.disco_allreduce,
        "runtime.disco.allgather": impl.disco_allgather,
    }
    for name, func in functions.items():
        tvm_ffi.register_global_func(name, func, override=True)
    _ACTIVE = impl
    logger.debug("MPI collectives installed on rank %d of %d", impl.rank, impl.comm.Get_size())
    return impl
