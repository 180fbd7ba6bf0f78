"""The collectives over MPI (mpi4py), for ranks under ``mpiexec``.

Device ``d`` is rank ``d`` of the world communicator. :class:`MpiCollectives`
implements the collective-backend interface of
:mod:`tvm_distx.runtime.collectives`; :func:`install` registers it as every
function of :mod:`tvm_distx.ccl`, so it must run after ``import tvm`` and
before a ``relax.VirtualMachine`` is created (the VM looks its functions up
once).

TVM's lowered programs
----------------------

A program lowered by TVM's own ``LowerDistIR`` (then ``LegalizeOps``) calls
TVM's disco builtins instead of ours, and those only work inside a disco
session: in an MPI rank they would fail ("not a DiscoWorker thread").
:func:`install` therefore also registers, under TVM's exact names
(:data:`tvm_distx.ccl.DISCO_BUILTINS`), implementations over the MPI world:
worker ``k`` of TVM's vocabulary is rank ``k`` of ``comm``, and every call
spans all of ``comm`` (``in_group`` is ignored):

* ``runtime.disco.broadcast_from_worker0(x, in_group, out)``: rank 0's ``x``
  into every rank's ``out`` (``MPI_Bcast``); the other ranks' ``x`` is not read;
* ``runtime.disco.scatter_from_worker0(x, in_group, out)``: rank 0's ``x``
  has shape ``(world, *out.shape)`` and row ``k`` goes to rank ``k``
  (``MPI_Scatter``); the other ranks' ``x`` is not read;
* ``runtime.disco.gather_to_worker0(x, in_group, out)``: every rank's ``x``
  concatenated along dimension 0 into rank 0's ``out`` (``MPI_Gather``);
* ``runtime.disco.allreduce(x, (kind,), in_group, out)``: kinds as
  :data:`tvm_distx.ccl.REDUCE_KINDS` (TVM's codes), folded as our allreduce;
* ``runtime.disco.allgather(x, in_group, out)``: concatenated along dimension 0;
* ``runtime.disco.worker_id()``: the shape ``(rank,)`` (TVM's
  ``redistribute_replica_to_shard`` slices with it).

These replace TVM's dispatchers in the rank process only, and only on threads
that are not workers of a real disco session: on such a worker (a
``ThreadedSession`` started in a rank, say) the call still goes to TVM's
function and the session's CCL (see
:func:`tvm_distx.runtime.collectives.register`). Nothing outside the rank
processes (``runtime/mpi_rank.py``) calls
:func:`install`, so a user's process keeps TVM's functions untouched.

How data moves:

* Buffers are the VM's own tensors, viewed without copy through DLPack
  (``np.from_dlpack``) and passed to mpi4py's buffer (upper-case) calls, which
  type them from their numpy dtype (float16 is ``MPIX_C_FLOAT16``). Types that
  numpy lacks (bfloat16, float8) are moved as unsigned integers of the same
  width; they cannot be reduced.
* A collective runs on the communicator of its group, made the first time the
  group is used with ``MPI_Comm_create_group``, which is collective over the
  group's members only: a mesh that covers some of the ranks (a pipeline
  stage) makes its communicators without the others. Members call their
  collectives in the same order, so they also create the communicator
  together. A group of the whole world uses the world's communicator, and a
  group of one rank needs none: its collectives copy.
* ``allreduce`` of floats over more than two ranks (sum, product, average)
  folds the members' values in member order, as the other backends do, so
  every backend gives the same bits (see ``_allreduce_in_member_order``);
  otherwise it is MPI's ``Allreduce``. ``reducescatter`` is MPI's
  ``Reduce_scatter_block`` on the blocks along its dimension, or for such
  floats an all-to-all of the blocks (the same traffic) and a fold in member
  order.
* ``allgather`` along dimension 0 receives straight into the output; along
  another dimension it receives the blocks into a scratch buffer and
  interleaves them into the output with one copy. ``alltoall`` packs and
  unpacks the same way, only when the split (concatenation) dimension is not
  the outermost non-trivial one.
* ``send_recv``, ``send`` and ``recv`` post every transfer that
  :func:`tvm_distx.layout.send_recv_transfers` gives this rank as
  non-blocking receives, then sends, on a private duplicate of the world
  communicator, copy what the rank already holds, and wait for all of them.
  A box that is contiguous in its tensor goes without copy; others are packed
  into (unpacked from) scratch. MPI delivers the messages between two ranks
  in the order they were posted, and every rank posts in program order, so
  one fixed tag is enough.

Scratch buffers grow to the largest size used and are then reused, so a
program that repeats its collectives allocates nothing after the first run.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from tvm_distx import ccl
from tvm_distx.ccl import SendRecvSpec
from tvm_distx.errors import CollectiveGroupError
from tvm_distx.layout import shard_bounds
from tvm_distx.runtime.collectives import Collectives, ProcessGroup, check_shape, register

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["MpiCollectives", "CollectiveGroupError", "install"]

logger = logging.getLogger(__name__)

_TAG = 77
_SUM, _PROD = ccl.REDUCE_KINDS["sum"], ccl.REDUCE_KINDS["prod"]
#: Reduce kinds whose floating-point result depends on the order (the average is a sum).
_ORDERED = (_SUM, _PROD)
_Slices = tuple[slice, ...]


@dataclass(frozen=True)
class _Transfer:
    """One message of a send/recv, as this rank sees it."""

    peer: int
    where: _Slices  # the box, in this rank's local block
    scratch: int | None  # offset of its packing space in the scratch, None if contiguous


@dataclass(frozen=True)
class _P2PPlan:
    """This rank's side of one send/recv."""

    src_shape: tuple[int, ...] | None  # the block it sends from (None: receives only)
    dst_shape: tuple[int, ...] | None  # the block it receives into (None: sends only)
    recvs: tuple[_Transfer, ...]
    sends: tuple[_Transfer, ...]
    keep: tuple[_Slices, _Slices] | None  # (destination part, source part) held locally
    scratch: int  # elements of packing space needed


class MpiCollectives(Collectives):
    """The collectives of one rank, on a world communicator.

    Creating it duplicates ``comm`` (for point-to-point traffic), which is
    collective over ``comm``.

    Parameters
    ----------
    comm : mpi4py.MPI.Comm
        The job's world: rank ``d`` is device ``d``.
    """

    def __init__(self, comm: MPI.Comm) -> None:
        from mpi4py import MPI

        self.mpi = MPI
        self.comm = comm
        self._rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._world = tuple(range(self.size))
        self.p2p = comm.Dup()  # point-to-point traffic never meets anything else
        self._comms: dict[tuple[int, ...], MPI.Comm] = {}
        self._plans: dict[SendRecvSpec, _P2PPlan] = {}
        self._scratch: dict[tuple[str, int], np.ndarray] = {}
        self._ops = {_SUM: MPI.SUM, _PROD: MPI.PROD, ccl.REDUCE_KINDS["min"]: MPI.MIN,
                     ccl.REDUCE_KINDS["max"]: MPI.MAX}

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def devices(self) -> range:
        return range(self.size)

    # ------------------------------------------------------------------ plumbing
    def communicator(self, members: tuple[int, ...]) -> MPI.Comm:
        """The communicator of ``members`` (rank ``k`` is member ``k``); the first call is
        collective over them."""
        if members == self._world:
            return self.comm
        comm = self._comms.get(members)
        if comm is None:
            world = self.comm.Get_group()
            group = world.Incl(list(members))
            comm = self._comms[members] = self.comm.Create_group(group, tag=_TAG)
            group.Free()
            world.Free()
            logger.debug("rank %d: communicator of ranks %s", self.rank, members)
        return comm

    def scratch(self, shape: Sequence[int], dtype: np.dtype, slot: int = 0) -> np.ndarray:
        """A scratch buffer of ``shape`` (contents undefined), valid until the next call.

        One flat buffer per dtype and ``slot`` grows to the largest size asked
        for, so repeated calls allocate nothing.
        """
        count = math.prod(shape)
        key = (np.dtype(dtype).str, slot)
        flat = self._scratch.get(key)
        if flat is None or flat.size < count:
            flat = self._scratch[key] = np.empty(count, dtype)
        return flat[:count].reshape(shape)

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, x: np.ndarray, out: np.ndarray, op: int, group: ProcessGroup) -> None:
        members = group.members
        if group.size > 2 and out.dtype.kind in "fc" and op in _ORDERED:
            self._allreduce_in_member_order(x, out, op, members)
        else:
            self.communicator(members).Allreduce(
                self.mpi.IN_PLACE if _same(x, out) else x, out, op=self._ops[op])

    def _allreduce_in_member_order(self, send: np.ndarray, recv: np.ndarray, code: int,
                                   members: tuple[int, ...]) -> None:
        """A sum or product of floats over more than two ranks, folded in member order.

        Floating-point addition is not associative, and MPI picks its reduction
        tree by size and rank count, so its bits differ from those of the other
        backends. Here, as in a reduce-scatter then all-gather (the bytes of
        MPI's own algorithm for large buffers), each member receives one chunk
        of every member's buffer (an all-to-all), folds the chunks in member
        order, ``((x0 + x1) + x2) + ...``, as the emulator and the disco backend
        do, and the folded chunks are gathered into ``recv``.
        """
        p, n = len(members), send.size
        chunk = -(-n // p)
        padded = self.scratch((p, chunk), send.dtype, slot=0)
        padded.reshape(-1)[:n] = send.reshape(-1)
        padded.reshape(-1)[n:] = 0
        got = self.scratch((p, chunk), send.dtype, slot=1)
        comm = self.communicator(members)
        comm.Alltoall(padded, got)
        mine = self.scratch((chunk,), send.dtype, slot=2)
        _fold_rows(got, mine, code)
        if chunk * p == n:
            comm.Allgather(mine, recv.reshape(p, chunk))
        else:
            comm.Allgather(mine, padded)
            recv.reshape(-1)[...] = padded.reshape(-1)[:n]

    def reduce_scatter(self, x: np.ndarray, out: np.ndarray, op: int, dim: int,
                       group: ProcessGroup) -> None:
        """MPI's ``Reduce_scatter_block`` on the blocks along ``dim`` (moved to the front
        in scratch unless it is the outermost non-trivial dimension).

        Floats summed (multiplied) over more than two ranks are folded in member
        order instead, as :meth:`_allreduce_in_member_order` does: an all-to-all
        of the blocks, the same traffic, then a local fold.
        """
        p = group.size
        comm = self.communicator(group.members)
        if math.prod(x.shape[:dim]) == 1:  # block k is already the k-th chunk
            blocks = x.reshape(p, -1)
        else:
            blocks = self.scratch((p, *out.shape), x.dtype, slot=0)
            _deinterleave(x, blocks, dim)
            blocks = blocks.reshape(p, -1)
        mine = out.reshape(-1)
        if p > 2 and out.dtype.kind in "fc" and op in _ORDERED:
            got = self.scratch(blocks.shape, x.dtype, slot=1)
            comm.Alltoall(blocks, got)
            _fold_rows(got, mine, op)
        else:
            comm.Reduce_scatter_block(blocks, mine, op=self._ops[op])

    def all_gather(self, x: np.ndarray, out: np.ndarray, dim: int, group: ProcessGroup) -> None:
        comm = self.communicator(group.members)
        if math.prod(x.shape[:dim]) == 1:  # the blocks land one after the other
            comm.Allgather(x, out)
            return
        blocks = self.scratch((group.size, *x.shape), x.dtype)
        comm.Allgather(x, blocks)
        _interleave(blocks, out, dim)

    def all_to_all(self, x: np.ndarray, out: np.ndarray, split: int, concat: int,
                   group: ProcessGroup) -> None:
        p = group.size
        piece = _shape_split(x.shape, split, p)
        comm = self.communicator(group.members)
        if math.prod(x.shape[:split]) == 1:  # piece k is already the k-th chunk
            packed = x
        else:
            packed = self.scratch((p, *piece), x.dtype, slot=0)
            _deinterleave(x, packed, split)
        if math.prod(out.shape[:concat]) == 1:
            comm.Alltoall(packed, out)
            return
        got = self.scratch((p, *piece), out.dtype, slot=1)
        comm.Alltoall(packed, got)
        _interleave(got, out, concat)

    def broadcast(self, x: np.ndarray | None, out: np.ndarray, root: int,
                  group: ProcessGroup) -> None:
        if x is not None:
            np.copyto(out, x)
        self.communicator(group.members).Bcast(out, root=root)

    def scatter(self, x: np.ndarray | None, out: np.ndarray, root: int,
                group: ProcessGroup) -> None:
        self.communicator(group.members).Scatter(x, out, root=root)

    def gather(self, x: np.ndarray, out: np.ndarray | None, root: int,
               group: ProcessGroup) -> None:
        self.communicator(group.members).Gather(x, out, root=root)

    # ------------------------------------------------------------------ point to point
    def move(self, x: np.ndarray | None, out: np.ndarray | None, spec: SendRecvSpec) -> None:
        """This rank's side of a send/recv; ``x`` is None on a receiver only, ``out`` on a
        sender only."""
        plan = self._plans.get(spec)
        if plan is None:
            plan = self._plans[spec] = _plan_move(spec, self.rank)
        send, recv = x, out
        if send is not None:
            check_shape(send, plan.src_shape, "the source of a send/recv")
        if recv is not None:
            check_shape(recv, plan.dst_shape, "the destination of a send/recv")
        dtype = (send if send is not None else recv).dtype
        pool = self.scratch((plan.scratch,), dtype)
        requests, unpack = [], []
        for t in plan.recvs:
            buf = view = recv[t.where]
            if t.scratch is not None:
                buf = pool[t.scratch:t.scratch + view.size].reshape(view.shape)
                unpack.append((view, buf))
            requests.append(self.p2p.Irecv(buf, source=t.peer, tag=_TAG))
        for t in plan.sends:
            buf = view = send[t.where]
            if t.scratch is not None:
                buf = pool[t.scratch:t.scratch + view.size].reshape(view.shape)
                np.copyto(buf, view)
            requests.append(self.p2p.Isend(buf, dest=t.peer, tag=_TAG))
        if plan.keep is not None:
            np.copyto(recv[plan.keep[0]], send[plan.keep[1]])
        self.mpi.Request.Waitall(requests)
        for view, buf in unpack:
            np.copyto(view, buf)


# ---------------------------------------------------------------------- helpers
def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two views start at the same address (the cheap bounds test goes first)."""
    return np.may_share_memory(a, b) and a.ctypes.data == b.ctypes.data


def _fold_rows(rows: np.ndarray, into: np.ndarray, code: int) -> None:
    """``into = ((rows[0] op rows[1]) op rows[2]) ...``: a sum or product in member order."""
    fold = np.multiply if code == _PROD else np.add
    fold(rows[0], rows[1], out=into)
    for row in rows[2:]:
        fold(into, row, out=into)


def _shape_split(shape: Sequence[int], dim: int, parts: int) -> tuple[int, ...]:
    return (*shape[:dim], shape[dim] // parts, *shape[dim + 1:])


def _interleave(blocks: np.ndarray, out: np.ndarray, dim: int) -> None:
    """Concatenate ``blocks`` (``p`` equal blocks, stacked) into ``out`` along ``dim``."""
    p = blocks.shape[0]
    outer = math.prod(out.shape[:dim])
    np.copyto(out.reshape(outer, p, -1), blocks.reshape(p, outer, -1).transpose(1, 0, 2))


def _deinterleave(array: np.ndarray, pieces: np.ndarray, dim: int) -> None:
    """Split ``array`` into ``p`` equal pieces along ``dim``, stacked into ``pieces``."""
    p = pieces.shape[0]
    outer = math.prod(array.shape[:dim])
    np.copyto(pieces.reshape(p, outer, -1), array.reshape(outer, p, -1).transpose(1, 0, 2))


def _contiguous(where: _Slices, block: tuple[int, ...]) -> bool:
    """Whether the box ``where`` is one contiguous run of a C-ordered ``block``."""
    extents = [s.stop - s.start for s in where]
    outer = next((i for i, e in enumerate(extents) if e != 1), len(extents))
    return extents[outer + 1:] == list(block[outer + 1:])


def _extent(bounds) -> tuple[int, ...] | None:
    return None if bounds is None else tuple(b - a for a, b in bounds)


def _plan_move(move: SendRecvSpec, rank: int) -> _P2PPlan:
    """What ``rank`` receives, sends and keeps in ``move``.

    The transfers are :meth:`SendRecvSpec.pieces` and :meth:`SendRecvSpec.sends`,
    the derivation every backend shares; this adds where each non-contiguous
    box is packed in the scratch buffer.
    """
    src_shape = _extent(shard_bounds(move.src, move.shape, rank))
    dst_shape = _extent(shard_bounds(move.dst, move.shape, rank))
    scratch = 0

    def transfer(peer: int, where: _Slices, block: tuple[int, ...]) -> _Transfer:
        nonlocal scratch
        if _contiguous(where, block):
            return _Transfer(peer, where, None)
        offset, scratch = scratch, scratch + math.prod(s.stop - s.start for s in where)
        return _Transfer(peer, where, offset)

    keep, recvs = None, []
    for piece in move.pieces(rank):
        if piece.sender == rank:
            keep = (piece.target, piece.source)
        else:
            recvs.append(transfer(piece.sender, piece.target, dst_shape))
    sends = [transfer(receiver, where, src_shape) for receiver, where in move.sends(rank)]
    return _P2PPlan(src_shape, dst_shape, tuple(recvs), tuple(sends), keep, scratch)


# ---------------------------------------------------------------------- installation
_INSTALLED: MpiCollectives | None = None


def install(comm: MPI.Comm | None = None,
            wrap: Callable[[str, Callable], Callable] | None = None) -> MpiCollectives:
    """Register the MPI collectives as this process's ``tvm_distx.ccl.*`` functions.

    Call it after ``import tvm`` and before creating a ``relax.VirtualMachine``
    (the VM resolves its functions once), and only in a rank process. It
    also provides TVM's disco builtins over the whole of ``comm`` (see the
    module documentation). Installing again re-registers the same
    implementation (a new one for another communicator) and keeps TVM's own
    dispatchers for disco worker threads.

    Parameters
    ----------
    comm : mpi4py.MPI.Comm, optional
        The job's world, rank ``d`` being device ``d`` (``MPI.COMM_WORLD`` by
        default). Collective: every rank of it must call :func:`install`.
    wrap : callable, optional
        ``wrap(name, function)`` is registered in place of each function
        (:func:`tvm_distx.runtime.collectives.register`).

    Returns
    -------
    MpiCollectives
        The installed implementation.
    """
    from mpi4py import MPI
    import tvm  # noqa: F401 - TVM registers its own builtins first; ours override them

    global _INSTALLED
    comm = MPI.COMM_WORLD if comm is None else comm
    if _INSTALLED is None or _INSTALLED.comm != comm:
        _INSTALLED = MpiCollectives(comm)
    register(_INSTALLED, builtins=ccl.DISCO_PREFIX, wrap=wrap)
    logger.debug("MPI collectives installed on rank %d of %d", _INSTALLED.rank,
                 _INSTALLED.size)
    return _INSTALLED
