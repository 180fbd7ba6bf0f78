"""The ``tvm_distx.ccl.*`` runtime functions over MPI (mpi4py), for ranks under ``mpiexec``.

Device ``d`` is rank ``d`` of the world communicator. :func:`install`
registers every function of :mod:`tvm_distx.ccl` as a global TVM function, so
it must run after ``import tvm`` and before a ``relax.VirtualMachine`` is
created (the VM looks its functions up once). It also overrides TVM's own
disco builtins (``runtime.disco.allreduce``, ``allgather``,
``broadcast_from_worker0`` and ``scatter_from_worker0``, over the whole
world), so programs lowered by TVM's ``LowerDistIR`` run too.

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
  otherwise it is MPI's ``Allreduce``.
* ``allgather`` along dimension 0 receives straight into the output; along
  another dimension it receives the blocks into a scratch buffer and
  interleaves them into the output with one copy. ``alltoall`` packs and
  unpacks the same way, only when the split (concatenation) dimension is not
  the outermost non-trivial one.
* ``send_recv``, ``send`` and ``recv`` post every transfer that
  :func:`tvm_distx.legalize.planner.send_recv_transfers` gives this rank as
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
from tvm_distx.ccl import CollectiveGroup, SendRecvSpec
from tvm_distx.errors import CollectiveGroupError

if TYPE_CHECKING:
    from mpi4py import MPI
    from tvm.runtime import Tensor

__all__ = ["MpiCollectives", "CollectiveGroupError", "install"]

logger = logging.getLogger(__name__)

_AVG = ccl.REDUCE_KINDS["avg"]
_TAG = 77
#: Reduce kinds whose floating-point result depends on the order (sum, product, average).
_ORDERED = (ccl.REDUCE_KINDS["sum"], ccl.REDUCE_KINDS["prod"], _AVG)
#: The function a rank calls in a send/recv, by (sends, receives).
_ROLES = {(True, True): ccl.SEND_RECV, (True, False): ccl.SEND, (False, True): ccl.RECV}
_Slices = tuple[slice, ...]


@dataclass(frozen=True)
class _Place:
    """This rank's place in one collective group."""

    members: tuple[int, ...]
    index: int


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


class MpiCollectives:
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
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._world = tuple(range(self.size))
        self.p2p = comm.Dup()  # point-to-point traffic never meets anything else
        self._places: dict[tuple[int, ...], _Place] = {}
        self._comms: dict[tuple[int, ...], MPI.Comm] = {}
        self._plans: dict[tuple[int, ...], _P2PPlan] = {}
        self._scratch: dict[tuple[str, int], np.ndarray] = {}
        self._ops = {0: MPI.SUM, 1: MPI.PROD, 2: MPI.MIN, 3: MPI.MAX, _AVG: MPI.SUM}

    # ------------------------------------------------------------------ plumbing
    def place(self, group: Sequence[int]) -> _Place:
        """This rank's group of an encoded :class:`~tvm_distx.ccl.CollectiveGroup` (cached)."""
        key = tuple(group)
        place = self._places.get(key)
        if place is None:
            decoded = CollectiveGroup.decode(key)
            size = math.prod(decoded.mesh_shape)
            self._check_mesh(decoded.first_device, size, f"a collective of group {decoded}")
            members = decoded.members(self.rank)
            place = self._places[key] = _Place(members, members.index(self.rank))
        return place

    def communicator(self, members: tuple[int, ...]) -> MPI.Comm:
        """The communicator of ``members``; the first call is collective over them."""
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

    def _check_mesh(self, first: int, size: int, what: str) -> None:
        if first + size > self.size:
            raise CollectiveGroupError(
                f"{what} needs devices {first}..{first + size - 1} but the job has "
                f"{self.size} ranks; launch it with at least {first + size}")
        if not first <= self.rank < first + size:
            raise CollectiveGroupError(
                f"rank {self.rank} called {what}, whose mesh is devices "
                f"{first}..{first + size - 1}: only the mesh's ranks may call it")

    # ------------------------------------------------------------------ collectives
    def allreduce(self, x: Tensor, kind: int | Sequence[int], group: Sequence[int],
                  out: Tensor) -> None:
        """``tvm_distx.ccl.allreduce``: reduce ``x`` over the group into ``out``."""
        place = self.place(group)
        code = _reduce_code(kind)
        send, recv = _array(x, reduce=True), _array(out, reduce=True)
        _expect(recv, send.shape, "allreduce")
        self._allreduce(send, recv, code, place.members)

    def _allreduce(self, send: np.ndarray, recv: np.ndarray, code: int,
                   members: tuple[int, ...]) -> None:
        op = self._ops.get(code)
        if op is None:
            raise ValueError(f"unknown reduce kind {code}; known: {ccl.REDUCE_KINDS}")
        in_place = _same(send, recv)
        if len(members) == 1:
            if not in_place:
                np.copyto(recv, send)
            return
        if len(members) > 2 and recv.dtype.kind in "fc" and code in _ORDERED:
            self._allreduce_in_member_order(send, recv, code, members)
        else:
            self.communicator(members).Allreduce(self.mpi.IN_PLACE if in_place else send,
                                                 recv, op=op)
        if code == _AVG:
            if recv.dtype.kind == "f":
                np.divide(recv, len(members), out=recv)
            else:  # like numpy's sum / n stored back: truncated toward zero
                recv[...] = recv / len(members)

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
        fold = np.multiply if code == 1 else np.add
        mine = self.scratch((chunk,), send.dtype, slot=2)
        fold(got[0], got[1], out=mine)
        for part in got[2:]:
            fold(mine, part, out=mine)
        if chunk * p == n:
            comm.Allgather(mine, recv.reshape(p, chunk))
        else:
            comm.Allgather(mine, padded)
            recv.reshape(-1)[...] = padded.reshape(-1)[:n]

    def allgather(self, x: Tensor, group: Sequence[int], axes: Sequence[int],
                  out: Tensor) -> None:
        """``tvm_distx.ccl.allgather``: concatenate the group's blocks along ``axes[0]``."""
        place = self.place(group)
        send, recv = _array(x), _array(out)
        dim, p = int(axes[0]), len(place.members)
        _expect(recv, _grown(send.shape, dim, p), "allgather")
        if p == 1:
            np.copyto(recv, send)
            return
        comm = self.communicator(place.members)
        if math.prod(send.shape[:dim]) == 1:  # the blocks land one after the other
            comm.Allgather(send, recv)
            return
        blocks = self.scratch((p, *send.shape), send.dtype)
        comm.Allgather(send, blocks)
        _interleave(blocks, recv, dim)

    def alltoall(self, x: Tensor, group: Sequence[int], axes: Sequence[int],
                 out: Tensor) -> None:
        """``tvm_distx.ccl.alltoall``: split along ``axes[0]``, swap pieces, concatenate
        along ``axes[1]``."""
        place = self.place(group)
        send, recv = _array(x), _array(out)
        split, concat, p = int(axes[0]), int(axes[1]), len(place.members)
        piece = _split(send.shape, split, p)
        _expect(recv, _grown(piece, concat, p), "alltoall")
        if p == 1:
            np.copyto(recv, send)
            return
        comm = self.communicator(place.members)
        if math.prod(send.shape[:split]) == 1:  # piece k is already the k-th chunk
            packed = send
        else:
            packed = self.scratch((p, *piece), send.dtype, slot=0)
            _deinterleave(send, packed, split)
        if math.prod(recv.shape[:concat]) == 1:
            comm.Alltoall(packed, recv)
            return
        got = self.scratch((p, *piece), recv.dtype, slot=1)
        comm.Alltoall(packed, got)
        _interleave(got, recv, concat)

    def local_slice(self, x: Tensor, group: Sequence[int], axes: Sequence[int],
                    out: Tensor) -> None:
        """``tvm_distx.ccl.local_slice``: keep this rank's piece of ``x`` along ``axes[0]``."""
        place = self.place(group)
        send, recv = _array(x), _array(out)
        dim, p = int(axes[0]), len(place.members)
        _expect(recv, _split(send.shape, dim, p), "local_slice")
        length = recv.shape[dim]
        index = [slice(None)] * send.ndim
        index[dim] = slice(place.index * length, (place.index + 1) * length)
        np.copyto(recv, send[tuple(index)])

    # ------------------------------------------------------------------ point to point
    def send_recv(self, x: Tensor, spec: Sequence[int], out: Tensor) -> None:
        """``tvm_distx.ccl.send_recv``: a rank of both meshes of the move."""
        self.move(x, spec, out)

    def send(self, x: Tensor, spec: Sequence[int]) -> None:
        """``tvm_distx.ccl.send``: a rank of the source mesh only."""
        self.move(x, spec, None)

    def recv(self, spec: Sequence[int], out: Tensor) -> None:
        """``tvm_distx.ccl.recv``: a rank of the destination mesh only."""
        self.move(None, spec, out)

    def move(self, x: Tensor | None, spec: Sequence[int], out: Tensor | None) -> None:
        """This rank's side of a send/recv; ``x`` is None on a receiver only, ``out`` on a
        sender only."""
        plan = self._plan(spec)
        wanted = _ROLES[plan.src_shape is not None, plan.dst_shape is not None]
        called = _ROLES.get((x is not None, out is not None))
        if called != wanted:
            raise CollectiveGroupError(f"rank {self.rank} must call {wanted} for this move, "
                                       f"not {called}")
        send = _array(x) if x is not None else None
        recv = _array(out) if out is not None else None
        if send is not None:
            _expect(send, plan.src_shape, "the source of a send/recv")
        if recv is not None:
            _expect(recv, plan.dst_shape, "the destination of a send/recv")
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

    def _plan(self, spec: Sequence[int]) -> _P2PPlan:
        """This rank's side of an encoded :class:`~tvm_distx.ccl.SendRecvSpec` (cached)."""
        key = tuple(spec)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _plan_move(SendRecvSpec.decode(key), self.rank, self.size)
        return plan

    # ------------------------------------------------------------------ TVM's builtins
    # TVM's builtins take ``in_group`` (disco worker groups); here the world is one group.
    def disco_allreduce(self, x: Tensor, kind: Sequence[int], in_group: bool,
                        out: Tensor) -> None:
        """``runtime.disco.allreduce`` over the whole world (``kind`` is a one-element shape)."""
        send, recv = _array(x, reduce=True), _array(out, reduce=True)
        _expect(recv, send.shape, "runtime.disco.allreduce")
        self._allreduce(send, recv, _reduce_code(kind), self._world)

    def disco_allgather(self, x: Tensor, in_group: bool, out: Tensor) -> None:
        """``runtime.disco.allgather`` over the whole world, along dimension 0."""
        send, recv = _array(x), _array(out)
        _expect(recv, _grown(send.shape, 0, self.size), "runtime.disco.allgather")
        self.comm.Allgather(send, recv)

    def disco_broadcast(self, x: Tensor, in_group: bool, out: Tensor) -> None:
        """``runtime.disco.broadcast_from_worker0``: rank 0's ``x`` into every ``out``."""
        recv = _array(out)
        if self.rank == 0:
            np.copyto(recv, _array(x))
        self.comm.Bcast(recv, root=0)

    def disco_scatter(self, x: Tensor, in_group: bool, out: Tensor) -> None:
        """``runtime.disco.scatter_from_worker0``: row ``r`` of rank 0's ``x`` into rank ``r``."""
        recv = _array(out)
        send = _array(x) if self.rank == 0 else None
        if send is not None:
            _expect(send, (self.size, *recv.shape), "runtime.disco.scatter_from_worker0")
        self.comm.Scatter(send, recv, root=0)

    def functions(self) -> dict[str, Callable[..., None]]:
        """Every global function this backend provides, by name."""
        return {
            ccl.ALLREDUCE: self.allreduce,
            ccl.ALLGATHER: self.allgather,
            ccl.ALLTOALL: self.alltoall,
            ccl.LOCAL_SLICE: self.local_slice,
            ccl.SEND_RECV: self.send_recv,
            ccl.SEND: self.send,
            ccl.RECV: self.recv,
            "runtime.disco.allreduce": self.disco_allreduce,
            "runtime.disco.allgather": self.disco_allgather,
            "runtime.disco.broadcast_from_worker0": self.disco_broadcast,
            "runtime.disco.scatter_from_worker0": self.disco_scatter,
        }


# ---------------------------------------------------------------------- helpers
def _array(tensor: Tensor, reduce: bool = False) -> np.ndarray:
    """A writable numpy view of a TVM tensor (no copy).

    A dtype numpy lacks (bfloat16, float8) is viewed as unsigned integers of
    its width, which moves the same bytes but cannot be reduced.
    """
    try:
        return np.from_dlpack(tensor)
    except RuntimeError as err:  # "Unsupported dtype in DLTensor"
        bits = tensor.dtype.bits * tensor.dtype.lanes
        if reduce or bits not in (8, 16, 32, 64):
            raise TypeError(f"the MPI collectives cannot {'reduce' if reduce else 'move'} "
                            f"tensors of dtype {tensor.dtype}") from err
        return np.from_dlpack(tensor._create_view(tuple(tensor.shape), f"uint{bits}"))


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two views start at the same address (the cheap bounds test goes first)."""
    return np.may_share_memory(a, b) and a.ctypes.data == b.ctypes.data


def _reduce_code(kind) -> int:
    """The reduce kind as an int: lowered programs pass an int, TVM's builtin a shape."""
    return int(kind[0]) if isinstance(kind, tuple) else int(kind)


def _grown(shape: Sequence[int], dim: int, parts: int) -> tuple[int, ...]:
    """``shape`` with dimension ``dim`` ``parts`` times longer."""
    _check_dim(shape, dim)
    return (*shape[:dim], shape[dim] * parts, *shape[dim + 1:])


def _split(shape: Sequence[int], dim: int, parts: int) -> tuple[int, ...]:
    """``shape`` with dimension ``dim`` cut into ``parts`` (which must divide it)."""
    _check_dim(shape, dim)
    if shape[dim] % parts:
        raise ValueError(f"dimension {dim} of shape {tuple(shape)} does not split into "
                         f"{parts} equal pieces")
    return (*shape[:dim], shape[dim] // parts, *shape[dim + 1:])


def _check_dim(shape: Sequence[int], dim: int) -> None:
    if not 0 <= dim < len(shape):
        raise ValueError(f"dimension {dim} is out of range for a tensor of shape {tuple(shape)}")


def _expect(array: np.ndarray, shape: Sequence[int], what: str) -> None:
    if array.shape != tuple(shape):
        raise ValueError(f"{what}: expected a tensor of shape {tuple(shape)}, got "
                         f"{array.shape}")


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


def _plan_move(move: SendRecvSpec, rank: int, world: int) -> _P2PPlan:
    """What ``rank`` receives, sends and keeps in ``move``.

    The transfers are :meth:`SendRecvSpec.pieces` and :meth:`SendRecvSpec.sends`,
    the derivation every backend shares; this adds where each non-contiguous
    box is packed in the scratch buffer.
    """
    from tvm_distx.legalize.planner import shard_bounds

    last = max(move.participants())
    if last >= world:
        raise CollectiveGroupError(f"a send/recv needs devices up to {last} but the job has "
                                   f"{world} ranks; launch it with at least {last + 1}")
    if move.role(rank) is None:
        raise CollectiveGroupError(
            f"rank {rank} called a send/recv of devices {move.participants()}, which it is "
            "not one of")
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


def install(comm: MPI.Comm | None = None) -> MpiCollectives:
    """Register the MPI collectives as this process's ``tvm_distx.ccl.*`` functions.

    Call it after ``import tvm`` and before creating a ``relax.VirtualMachine``
    (the VM resolves its functions once). It also overrides TVM's disco
    builtins ``runtime.disco.allreduce``, ``allgather``,
    ``broadcast_from_worker0`` and ``scatter_from_worker0`` with versions over
    the whole of ``comm``. Installing again on the same communicator
    re-registers the same implementation.

    Parameters
    ----------
    comm : mpi4py.MPI.Comm, optional
        The job's world, rank ``d`` being device ``d`` (``MPI.COMM_WORLD`` by
        default). Collective: every rank of it must call :func:`install`.

    Returns
    -------
    MpiCollectives
        The installed implementation.
    """
    import tvm  # noqa: F401 - TVM registers its own builtins first, then we override them
    import tvm_ffi
    from mpi4py import MPI

    global _INSTALLED
    comm = MPI.COMM_WORLD if comm is None else comm
    if _INSTALLED is None or _INSTALLED.comm != comm:
        _INSTALLED = MpiCollectives(comm)
    for name, func in _INSTALLED.functions().items():
        tvm_ffi.register_global_func(name, func, override=True)
    logger.debug("MPI collectives installed on rank %d of %d", _INSTALLED.rank,
                 _INSTALLED.size)
    return _INSTALLED
