"""The collective-backend interface, and the one adapter from it to the ``tvm_distx.ccl`` ABI.

A backend moves numpy arrays between the ranks of a run: the emulator
(:mod:`tvm_distx.runtime.emulated`, ranks as threads), MPI
(:mod:`tvm_distx.runtime.mpi_ccl`) and disco shared memory
(:mod:`tvm_distx.runtime.disco_shm`). Each implements :class:`Collectives`:
every collective runs over a :class:`ProcessGroup` (the members of a
:class:`~tvm_distx.ccl.CollectiveGroup`, in group order) and writes into a
destination array of the right shape.

:func:`abi_functions` (the methods of its ``_AbiCalls``) is the only place that
reads the packed arguments of the ``tvm_distx.ccl.*`` functions (and of TVM's
own disco builtins): it views the tensors as numpy arrays without copy, decodes
groups and send/recv specs (cached), checks shapes and group membership,
handles groups of one rank and the average (a sum, then one division), and
calls the backend.
:func:`register` makes those functions this process's global functions.

Adding a collective means a method on :class:`Collectives`, its implementation
in each backend, its ABI name in :mod:`tvm_distx.ccl` with a method of ``_AbiCalls`` and an
entry in :func:`abi_functions`, and the planner step that emits it.
"""

from __future__ import annotations

import abc
import logging
import math
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from tvm_distx import ccl
from tvm_distx.ccl import CollectiveGroup, SendRecvSpec
from tvm_distx.errors import ArgumentError, CollectiveGroupError

if TYPE_CHECKING:
    from tvm.runtime import Tensor

__all__ = ["Collectives", "ProcessGroup", "REDUCERS", "abi_functions", "register", "as_numpy",
           "check_shape", "process_group", "in_disco_worker"]

logger = logging.getLogger(__name__)

_AVG = ccl.REDUCE_KINDS["avg"]
#: The reductions a backend implements, by ABI code (the average is a sum, then a division).
REDUCERS = {ccl.REDUCE_KINDS["sum"]: np.add, ccl.REDUCE_KINDS["prod"]: np.multiply,
            ccl.REDUCE_KINDS["min"]: np.minimum, ccl.REDUCE_KINDS["max"]: np.maximum}


@dataclass(frozen=True)
class ProcessGroup:
    """The ranks one collective runs among, in group order, and this rank's place.

    Parameters
    ----------
    members : tuple of int
        The global devices of the group, in group order (member ``k`` holds
        block ``k`` of a gathered or scattered tensor).
    index : int
        This rank's position in ``members``.
    """

    members: tuple[int, ...]
    index: int

    @property
    def size(self) -> int:
        """The number of members."""
        return len(self.members)


class Collectives(abc.ABC):
    """One rank's collectives over a backend, on numpy arrays.

    Every method is called by every member of ``group``, in the same order on
    every member (and :meth:`move` by every device of either mesh of its
    spec). Outputs are written into ``out``, which has the rank-local result
    shape. Groups have at least two members (the adapter copies for a group of
    one). Reductions are folded in member order, ``((x0 op x1) op x2) ...``, so
    that every backend gives the same bits.
    """

    @property
    @abc.abstractmethod
    def rank(self) -> int:
        """The global device id of the calling rank."""

    @property
    @abc.abstractmethod
    def devices(self) -> Sequence[int]:
        """Every device of the run."""

    @abc.abstractmethod
    def all_reduce(self, x: np.ndarray, out: np.ndarray, op: int, group: ProcessGroup) -> None:
        """The elementwise reduction (a key of :data:`REDUCERS`) of every member's ``x``."""

    @abc.abstractmethod
    def reduce_scatter(self, x: np.ndarray, out: np.ndarray, op: int, dim: int,
                       group: ProcessGroup) -> None:
        """Block ``group.index`` (of ``group.size`` equal blocks along ``dim``) of the
        reduction of every member's ``x``."""

    @abc.abstractmethod
    def all_gather(self, x: np.ndarray, out: np.ndarray, dim: int, group: ProcessGroup) -> None:
        """Every member's ``x`` concatenated along ``dim``, in member order."""

    @abc.abstractmethod
    def all_to_all(self, x: np.ndarray, out: np.ndarray, split: int, concat: int,
                   group: ProcessGroup) -> None:
        """Split ``x`` along ``split``, piece ``k`` to member ``k``; concatenate the pieces
        received along ``concat``, in member order."""

    @abc.abstractmethod
    def broadcast(self, x: np.ndarray | None, out: np.ndarray, root: int,
                  group: ProcessGroup) -> None:
        """Member ``root``'s ``x`` into every member's ``out`` (``x`` is read on the root
        only)."""

    @abc.abstractmethod
    def move(self, x: np.ndarray | None, out: np.ndarray | None, spec: SendRecvSpec) -> None:
        """This rank's side of a send/recv: ``x`` is None on a receiver only, ``out`` on a
        sender only (see :meth:`SendRecvSpec.pieces` and :meth:`SendRecvSpec.sends`)."""

    def send_recv(self, x: np.ndarray, out: np.ndarray, spec: SendRecvSpec) -> None:
        """A rank of both meshes of ``spec``."""
        self.move(x, out, spec)

    def send(self, x: np.ndarray, spec: SendRecvSpec) -> None:
        """A rank of the source mesh of ``spec`` only."""
        self.move(x, None, spec)

    def recv(self, out: np.ndarray, spec: SendRecvSpec) -> None:
        """A rank of the destination mesh of ``spec`` only."""
        self.move(None, out, spec)

    # TVM's own disco builtins scatter from and gather to worker 0; backends
    # with a cheaper way override these.
    def scatter(self, x: np.ndarray | None, out: np.ndarray, root: int,
                group: ProcessGroup) -> None:
        """Row ``k`` of member ``root``'s ``x`` (shape ``(size, *out.shape)``) into member
        ``k``'s ``out``."""
        whole = np.empty((group.size, *out.shape), out.dtype)
        self.broadcast(x, whole, root, group)
        np.copyto(out, whole[group.index])

    def gather(self, x: np.ndarray, out: np.ndarray | None, root: int,
               group: ProcessGroup) -> None:
        """Every member's ``x`` concatenated along dimension 0 into member ``root``'s ``out``."""
        whole = np.empty((x.shape[0] * group.size, *x.shape[1:]), x.dtype)
        self.all_gather(x, whole, 0, group)
        if out is not None:
            np.copyto(out, whole)


# ---------------------------------------------------------------------- the adapter
def as_numpy(tensor: Tensor, reduce: bool = False) -> np.ndarray:
    """A writable numpy view of a TVM tensor (no copy); a numpy array as it is.

    A dtype numpy lacks (bfloat16, float8) is viewed as unsigned integers of
    its width, which moves the same bytes but cannot be reduced. A numpy array
    (the board's executor calls with them) is not passed through DLPack, whose
    view of it is read-only in some numpy versions (2.2, Debian's).
    """
    if isinstance(tensor, np.ndarray):
        return tensor
    try:
        return np.from_dlpack(tensor)
    except RuntimeError as err:  # "Unsupported dtype in DLTensor"
        bits = tensor.dtype.bits * tensor.dtype.lanes
        if reduce or bits not in (8, 16, 32, 64):
            raise ArgumentError(f"the collectives cannot {'reduce' if reduce else 'move'} "
                                f"tensors of dtype {tensor.dtype}",
                                hint="use a dtype numpy knows for a reduction "
                                "(float16, float32, ...)") from err
        return np.from_dlpack(tensor._create_view(tuple(tensor.shape), f"uint{bits}"))


def process_group(group: CollectiveGroup, rank: int, devices: Sequence[int]) -> ProcessGroup:
    """``rank``'s group of ``group``, checked against the run's ``devices``.

    Raises
    ------
    CollectiveGroupError
        If the group's mesh has devices the run lacks, or ``rank`` is not on it.
    """
    first, size = group.first_device, math.prod(group.mesh_shape)
    what = f"a collective of group {group}"
    if any(d not in devices for d in (first, first + size - 1)):
        raise CollectiveGroupError(
            f"{what} needs devices {first}..{first + size - 1} but the job has "
            f"{len(devices)} ranks; launch it with at least {first + size}")
    if not first <= rank < first + size:
        raise CollectiveGroupError(
            f"rank {rank} called {what}, whose mesh is devices "
            f"{first}..{first + size - 1}: only the mesh's ranks may call it")
    members = group.members(rank)
    return ProcessGroup(members, members.index(rank))


def abi_functions(backend: Collectives, builtins: str | None = None,
                  empty: Callable | None = None) -> dict[str, Callable[..., None]]:
    """Every ``tvm_distx.ccl.*`` function over ``backend``, by name.

    Parameters
    ----------
    backend : Collectives
        The implementation.
    builtins : str, optional
        Also TVM's disco builtins (:data:`tvm_distx.ccl.DISCO_BUILTINS`, over
        every device of the run) under this prefix: ``"runtime.disco."``
        replaces TVM's dispatchers (an MPI rank, no disco session; with
        ``worker_id``), ``"runtime.disco.."`` implements the CCL whose name is
        empty (disco workers without a C++ CCL).
    empty : callable, optional
        ``empty(shape, dtype)``, the arrays of ``recv_sized`` (numpy's by default,
        what a board's executor holds; TVM tensors for a virtual machine).
    """
    calls = _AbiCalls(backend, empty)
    functions = {
        ccl.ALLREDUCE: calls.allreduce,
        ccl.REDUCE_SCATTER: calls.reducescatter,
        ccl.ALLGATHER: calls.allgather,
        ccl.ALLTOALL: calls.alltoall,
        ccl.BROADCAST: calls.broadcast,
        ccl.LOCAL_SLICE: calls.local_slice,
        ccl.SEND_RECV: calls.send_recv,
        ccl.SEND: calls.send,
        ccl.RECV: calls.recv,
        ccl.RECV_SIZED: calls.recv_sized,
    }
    if builtins is not None:
        functions.update(_tvm_builtins(backend, builtins, _reduced))
    return functions


def _reduced(send: np.ndarray, recv: np.ndarray, code: int, group: ProcessGroup,
             collective: Callable[[int], None]) -> None:
    """Reduce ``send`` into ``recv`` by ``collective(op)``: a copy for a group of one, and
    ``avg`` as the sum divided once."""
    if code not in REDUCERS and code != _AVG:
        raise ArgumentError(f"unknown reduce kind {code}; known: {ccl.REDUCE_KINDS}",
                            hint="the program and the runtime disagree on the ABI of "
                            "tvm_distx.ccl: build and run with one version")
    if group.size == 1:
        np.copyto(recv, send)
        return
    collective(ccl.REDUCE_KINDS["sum"] if code == _AVG else code)
    if code == _AVG:  # the sum, then one division
        if recv.dtype.kind in "fc":
            np.divide(recv, group.size, out=recv)
        else:  # like numpy's sum / n stored back: truncated toward zero
            recv[...] = recv / group.size


class _AbiCalls:
    """The ``tvm_distx.ccl.*`` functions over one backend: each reads the packed arguments
    of its call (the encoded group or send/recv spec, the axes) and checks the shapes.

    Groups and specs are decoded once per encoding and kept.
    """

    def __init__(self, backend: Collectives, empty: Callable | None = None) -> None:
        self.backend = backend
        #: ``empty(shape, dtype)``: the arrays a call that sizes its own result returns
        self.empty = empty if empty is not None else np.empty
        self.groups: dict[tuple, ProcessGroup] = {}
        self.specs: dict[tuple, SendRecvSpec] = {}

    def group_of(self, encoded) -> ProcessGroup:
        """This rank's group of the encoded :class:`~tvm_distx.ccl.CollectiveGroup`."""
        rank = self.backend.rank
        key = (tuple(encoded), rank)
        found = self.groups.get(key)
        if found is None:
            found = self.groups[key] = process_group(CollectiveGroup.decode(key[0]), rank,
                                                     self.backend.devices)
        return found

    def allreduce(self, x, kind, group, out) -> None:
        g = self.group_of(group)
        send, recv = as_numpy(x, reduce=True), as_numpy(out, reduce=True)
        check_shape(recv, send.shape, "allreduce")
        _reduced(send, recv, _reduce_code(kind), g,
                 lambda op: self.backend.all_reduce(send, recv, op, g))

    def reducescatter(self, x, kind, group, axes, out) -> None:
        g = self.group_of(group)
        send, recv = as_numpy(x, reduce=True), as_numpy(out, reduce=True)
        dim = int(axes[0])
        check_shape(recv, _split(send.shape, dim, g.size), "reducescatter")
        _reduced(send, recv, _reduce_code(kind), g,
                 lambda op: self.backend.reduce_scatter(send, recv, op, dim, g))

    def allgather(self, x, group, axes, out) -> None:
        g = self.group_of(group)
        send, recv = as_numpy(x), as_numpy(out)
        dim = int(axes[0])
        check_shape(recv, _grown(send.shape, dim, g.size), "allgather")
        if g.size == 1:
            np.copyto(recv, send)
        else:
            self.backend.all_gather(send, recv, dim, g)

    def alltoall(self, x, group, axes, out) -> None:
        g = self.group_of(group)
        send, recv = as_numpy(x), as_numpy(out)
        split, concat = int(axes[0]), int(axes[1])
        check_shape(recv, _grown(_split(send.shape, split, g.size), concat, g.size), "alltoall")
        if g.size == 1:
            np.copyto(recv, send)
        else:
            self.backend.all_to_all(send, recv, split, concat, g)

    def broadcast(self, x, group, axes, out) -> None:
        g = self.group_of(group)
        send, recv = as_numpy(x), as_numpy(out)
        root = int(axes[0])
        if not 0 <= root < g.size:
            raise ArgumentError(f"broadcast: root {root} is not a member index of a group of "
                                f"{g.size}", hint=f"a root from 0 to {g.size - 1}")
        check_shape(recv, send.shape, "broadcast")
        if g.size == 1:
            np.copyto(recv, send)
        else:
            self.backend.broadcast(send if g.index == root else None, recv, root, g)

    def local_slice(self, x, group, axes, out) -> None:
        g = self.group_of(group)
        send, recv = as_numpy(x), as_numpy(out)
        dim = int(axes[0])
        check_shape(recv, _split(send.shape, dim, g.size), "local_slice")
        length = recv.shape[dim]
        index = [slice(None)] * send.ndim
        index[dim] = slice(g.index * length, (g.index + 1) * length)
        np.copyto(recv, send[tuple(index)])

    def spec_of(self, encoded, x, out) -> SendRecvSpec:
        """The encoded send/recv spec, checked: the run has its devices, this rank is one of
        them, and it called the function of its role."""
        key = tuple(encoded)
        spec = self.specs.get(key)
        if spec is None:
            spec = self.specs[key] = SendRecvSpec.decode(key)
        rank, participants = self.backend.rank, spec.participants()
        if participants[-1] not in self.backend.devices:
            raise CollectiveGroupError(
                f"a send/recv needs devices up to {participants[-1]} but the job has "
                f"{len(self.backend.devices)} ranks; launch it with at least "
                f"{participants[-1] + 1}")
        role = spec.role(rank)
        if role is None:
            raise CollectiveGroupError(f"rank {rank} called a send/recv of devices "
                                       f"{participants}, which it is not one of")
        called = _ROLES.get((x is not None, out is not None))
        if called != f"tvm_distx.ccl.{role}":
            raise CollectiveGroupError(f"rank {rank} must call tvm_distx.ccl.{role} for this "
                                       f"move, not {called}")
        return spec

    def send_recv(self, x, spec, out) -> None:
        x, out = as_numpy(x), as_numpy(out)
        spec = self._sized(self.spec_of(spec, x, out), x)
        self.backend.send_recv(x, out, spec)

    def send(self, x, spec) -> None:
        x = as_numpy(x)
        spec = self._sized(self.spec_of(spec, x, None), x)
        self.backend.send(x, spec)

    def recv(self, spec, out) -> None:
        out = as_numpy(out)
        self.backend.recv(out, self._sized(self.spec_of(spec, None, out), None))

    def recv_sized(self, spec, dtype):
        """``recv`` of a move with run-time extents, into a tensor made here of the size the
        senders announce (the caller cannot allocate it: it does not know the size)."""
        spec = self._sized(self.spec_of(spec, None, ()), None)
        out = self.empty(spec.dst.local_shape(spec.shape), str(dtype))
        self.backend.recv(as_numpy(out), spec)
        return out

    def _sized(self, spec: SendRecvSpec, x: np.ndarray | None) -> SendRecvSpec:
        """``spec`` with its run-time extents, which the source's ranks send to the ranks of the
        destination only first (:meth:`SendRecvSpec.header`)."""
        if not spec.run_time_dims:
            return spec
        header = spec.header()
        if x is not None:
            spec = spec.resolved(x.shape)
        if header is None:
            return spec
        shape = np.array(spec.shape, np.int64) if x is not None else None
        received = np.empty(len(spec.shape), np.int64) \
            if self.backend.rank in header.dst.mesh.device_range else None
        self.backend.move(shape, received, header)
        if x is None:
            spec = SendRecvSpec(tuple(int(n) for n in received), spec.src, spec.dst)
        return spec


def _tvm_builtins(backend: Collectives, prefix: str, reduced) -> dict[str, Callable[..., None]]:
    """TVM's disco builtins (:data:`tvm_distx.ccl.DISCO_BUILTINS`) over every device of the run.

    Worker ``k`` is device ``k``; ``in_group`` is ignored (one group of workers).
    ``worker_id`` is TVM's dispatcher itself, not a CCL function, so it is
    given under :data:`tvm_distx.ccl.DISCO_PREFIX` only.
    """

    def world() -> ProcessGroup:
        devices = tuple(backend.devices)
        return ProcessGroup(devices, devices.index(backend.rank))

    def allreduce(x, kind, in_group, out) -> None:
        send, recv = as_numpy(x, reduce=True), as_numpy(out, reduce=True)
        check_shape(recv, send.shape, f"{prefix}allreduce")
        g = world()
        reduced(send, recv, _reduce_code(kind), g,
                lambda op: backend.all_reduce(send, recv, op, g))

    def allgather(x, in_group, out) -> None:
        send, recv, g = as_numpy(x), as_numpy(out), world()
        check_shape(recv, _grown(send.shape, 0, g.size), f"{prefix}allgather")
        if g.size == 1:
            np.copyto(recv, send)
        else:
            backend.all_gather(send, recv, 0, g)

    def broadcast_from_worker0(x, in_group, out) -> None:
        recv, g = as_numpy(out), world()
        send = as_numpy(x) if g.index == 0 else None
        if g.size == 1:
            np.copyto(recv, send)
        else:
            backend.broadcast(send, recv, 0, g)

    def scatter_from_worker0(x, in_group, out) -> None:
        recv, g = as_numpy(out), world()
        send = as_numpy(x) if g.index == 0 else None
        if send is not None:
            check_shape(send, (g.size, *recv.shape), f"{prefix}scatter_from_worker0")
        backend.scatter(send, recv, 0, g)

    def gather_to_worker0(x, in_group, out) -> None:
        send, g = as_numpy(x), world()
        recv = as_numpy(out) if g.index == 0 else None
        backend.gather(send, recv, 0, g)

    def worker_id():
        import tvm_ffi

        return tvm_ffi.Shape((world().index,))

    functions = {"allreduce": allreduce, "allgather": allgather,
                 "broadcast_from_worker0": broadcast_from_worker0,
                 "scatter_from_worker0": scatter_from_worker0,
                 "gather_to_worker0": gather_to_worker0, "worker_id": worker_id}
    assert set(functions) == set(ccl.DISCO_BUILTINS)
    if prefix != ccl.DISCO_PREFIX:
        del functions["worker_id"]
    return {prefix + name: func for name, func in functions.items()}


#: TVM's own ``runtime.disco.*`` dispatchers, kept the first time ours replace them.
_TVM_DISPATCHERS: dict[str, Callable] = {}
_THREAD = threading.local()


def in_disco_worker() -> bool:
    """Whether the calling thread is a worker of a real disco session (cached per thread).

    TVM's own ``runtime.disco.worker_id`` answers only on a disco worker
    thread and raises elsewhere; a thread's answer never changes.
    """
    known = getattr(_THREAD, "in_disco_worker", None)
    if known is None:
        tvm_worker_id = _TVM_DISPATCHERS.get(ccl.DISCO_PREFIX + "worker_id")
        known = False
        if tvm_worker_id is not None:
            try:
                tvm_worker_id()
                known = True
            except Exception:  # noqa: BLE001 - "The current thread is not a DiscoWorker thread"
                known = False
        _THREAD.in_disco_worker = known
    return known


def _unless_in_disco_worker(name: str, ours: Callable) -> Callable:
    """``ours``, except on a real disco worker thread, which keeps TVM's dispatcher."""
    theirs = _TVM_DISPATCHERS.get(name)
    if theirs is None:
        return ours

    def dispatch(*args):
        if in_disco_worker():
            return theirs(*args)
        return ours(*args)

    return dispatch


def register(backend: Collectives, builtins: str | None = None,
             wrap: Callable[[str, Callable], Callable] | None = None) -> None:
    """Make :func:`abi_functions` of ``backend`` this process's global TVM functions.

    A ``relax.VirtualMachine`` resolves its functions once, when it is created:
    register first. With ``builtins=tvm_distx.ccl.DISCO_PREFIX``, TVM's own
    dispatchers are replaced by functions that call ``backend`` from any thread
    but a real disco session's workers, which still reach TVM's (and through it
    their session's CCL): TVM's are kept the first time, so registering again
    (any number of times) replaces ours by ours and never wraps a wrapper.
    ``wrap(name, function)``, when given, returns what is registered in place of
    each of ours (a rank counts its collectives so): one Python call, where
    wrapping the registered function would add a trip through TVM's FFI to each.
    """
    import tvm
    import tvm_ffi

    def empty(shape, dtype):
        return tvm.runtime.empty(shape, dtype)

    for name, func in abi_functions(backend, builtins, empty).items():
        if wrap is not None:
            func = wrap(name, func)
        if builtins == ccl.DISCO_PREFIX and name.startswith(ccl.DISCO_PREFIX):
            if name not in _TVM_DISPATCHERS:
                found = tvm_ffi.get_global_func(name, allow_missing=True)
                if found is not None:
                    _TVM_DISPATCHERS[name] = found
            func = _unless_in_disco_worker(name, func)
        tvm_ffi.register_global_func(name, func, override=True)


# ---------------------------------------------------------------------- shapes
_ROLES = {(True, True): ccl.SEND_RECV, (True, False): ccl.SEND, (False, True): ccl.RECV}


def _reduce_code(kind) -> int:
    """The reduce kind as an int: lowered programs pass an int, TVM's builtin a shape."""
    return int(kind) if isinstance(kind, (int, np.integer)) else int(kind[0])


def _grown(shape: Sequence[int], dim: int, parts: int) -> tuple[int, ...]:
    """``shape`` with dimension ``dim`` ``parts`` times longer."""
    _check_dim(shape, dim)
    return (*shape[:dim], shape[dim] * parts, *shape[dim + 1:])


def _split(shape: Sequence[int], dim: int, parts: int) -> tuple[int, ...]:
    """``shape`` with dimension ``dim`` cut into ``parts`` (which must divide it)."""
    _check_dim(shape, dim)
    if shape[dim] % parts:
        raise ArgumentError(f"dimension {dim} of shape {tuple(shape)} does not split into "
                            f"{parts} equal pieces", hint=f"a collective over {parts} ranks "
                            f"needs dimension {dim} divisible by {parts}")
    return (*shape[:dim], shape[dim] // parts, *shape[dim + 1:])


def _check_dim(shape: Sequence[int], dim: int) -> None:
    if not 0 <= dim < len(shape):
        raise ArgumentError(f"dimension {dim} is out of range for a tensor of shape "
                            f"{tuple(shape)}", hint=f"a dimension from 0 to {len(shape) - 1}")


def check_shape(array: np.ndarray, shape: Sequence[int], what: str) -> None:
    """Raise an :class:`~tvm_distx.errors.ArgumentError` naming ``what`` unless ``array``
    has ``shape``."""
    if array.shape != tuple(shape):
        raise ArgumentError(f"{what}: expected a tensor of shape {tuple(shape)}, got "
                            f"{array.shape}", hint="the rank program and the collective "
                            "disagree on a buffer: a lowering bug")
