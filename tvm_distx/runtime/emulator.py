"""The emulated backend: every rank in a thread of one process, collectives over numpy.

It runs the rank-local program that :class:`tvm_distx.legalize.LowerDistIR`
produces exactly as the real backends will, one TVM virtual machine per rank,
and implements the ``tvm_distx.ccl.*`` runtime functions by exchanging numpy
buffers between the threads. It is the fast unit-test backend: no MPI, no
processes, and the same numbers.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Sequence

import numpy as np

from tvm_distx import ccl
from tvm_distx.ccl import CollectiveGroup, SendRecvSpec

__all__ = ["emulate"]

logger = logging.getLogger(__name__)

_REDUCERS = {0: np.add, 1: np.multiply, 2: np.minimum, 3: np.maximum}


class _Exchange:
    """Where the ranks of one run swap buffers.

    Every call of a communication function is a *meeting* of its participants
    (a collective's group, or every device of a send/recv): each posts its
    buffer, waits until all have posted, reads what it needs and leaves. A
    meeting is identified by its participants and by how many meetings of the
    same participants each rank has had before, which is the same on every
    rank because they run the same program order.
    """

    def __init__(self, devices: Sequence[int], timeout: float) -> None:
        self.devices = tuple(devices)
        self.timeout = timeout
        self.cond = threading.Condition()
        self.meetings: dict[tuple, dict] = {}
        self.failed: BaseException | None = None
        self.local = threading.local()

    def meet(self, members: Sequence[int], array: np.ndarray | None,
             read: Callable[[dict[int, np.ndarray]], None]) -> None:
        """Post ``array`` to the meeting of ``members``, then ``read`` every posted buffer."""
        members = tuple(members)
        me = self.local.device
        count = self.local.counts.get(members, 0)
        self.local.counts[members] = count + 1
        key = (members, count)
        with self.cond:
            meeting = self.meetings.setdefault(key, {"posted": {}, "left": 0})
            meeting["posted"][me] = None if array is None else array.copy()
            self.cond.notify_all()
            self._wait(lambda: len(meeting["posted"]) == len(members))
        read(meeting["posted"])
        with self.cond:
            meeting["left"] += 1
            if meeting["left"] == len(members):
                del self.meetings[key]

    def _wait(self, ready: Callable[[], bool]) -> None:
        if not self.cond.wait_for(lambda: ready() or self.failed is not None, self.timeout):
            raise TimeoutError(f"rank {self.local.device} waited {self.timeout} s for its peers")
        if self.failed is not None and not ready():
            raise RuntimeError("another rank failed") from self.failed

    def abort(self, err: BaseException) -> None:
        with self.cond:
            self.failed = err
            self.cond.notify_all()


_ACTIVE: list[_Exchange] = []  # the run in progress (runs do not overlap)


def _group(group) -> tuple[_Exchange, tuple[int, ...], int]:
    exchange = _ACTIVE[-1]
    device = exchange.local.device
    members = CollectiveGroup.decode(group).members(device)
    if device not in members:  # pragma: no cover - a lowering bug
        raise RuntimeError(f"device {device} is not in its own group {members}")
    return exchange, members, members.index(device)


def _reduce(posted: dict[int, np.ndarray], members: tuple[int, ...], kind: int) -> np.ndarray:
    """The reduction of the members' buffers, folded in member order as every backend does
    (the same operations on the same values, so the same bits)."""
    reduce = np.add if kind == 4 else _REDUCERS[kind]
    result = posted[members[0]]
    for d in members[1:]:
        result = reduce(result, posted[d])
    if kind == 4:  # the average: the sum, then one division
        result = result / len(members)
    return result


def _allreduce(x, kind, group, out) -> None:
    exchange, members, _ = _group(group)

    def read(posted):
        np.from_dlpack(out)[...] = _reduce(posted, members, int(kind))

    exchange.meet(members, np.from_dlpack(x), read)


def _reducescatter(x, kind, group, axes, out) -> None:
    exchange, members, me = _group(group)

    def read(posted):
        blocks = np.split(_reduce(posted, members, int(kind)), len(members), axis=int(axes[0]))
        np.from_dlpack(out)[...] = blocks[me]

    exchange.meet(members, np.from_dlpack(x), read)


def _local_slice(x, group, axes, out) -> None:
    _, members, me = _group(group)
    part = np.split(np.from_dlpack(x), len(members), axis=int(axes[0]))[me]
    np.from_dlpack(out)[...] = part


def _allgather(x, group, axes, out) -> None:
    exchange, members, _ = _group(group)

    def read(posted):
        np.from_dlpack(out)[...] = np.concatenate([posted[d] for d in members],
                                                  axis=int(axes[0]))

    exchange.meet(members, np.from_dlpack(x), read)


def _alltoall(x, group, axes, out) -> None:
    exchange, members, me = _group(group)
    split_dim, concat_dim = int(axes[0]), int(axes[1])

    def read(posted):
        pieces = [np.split(posted[d], len(members), axis=split_dim)[me] for d in members]
        np.from_dlpack(out)[...] = np.concatenate(pieces, axis=concat_dim)

    exchange.meet(members, np.from_dlpack(x), read)


def _move(x, spec, out) -> None:
    """Every side of a send/recv: ``x`` is None on a receiver only, ``out`` on a sender only."""
    exchange = _ACTIVE[-1]
    me = exchange.local.device
    move = SendRecvSpec.decode(spec)

    def read(posted):
        if out is not None:
            target = np.from_dlpack(out)
            for piece in move.pieces(me):
                target[piece.target] = posted[piece.sender][piece.source]

    exchange.meet(move.participants(), None if x is None else np.from_dlpack(x), read)


def _send_recv(x, spec, out) -> None:
    _move(x, spec, out)


def _send(x, spec) -> None:
    _move(x, spec, None)


def _recv(spec, out) -> None:
    _move(None, spec, out)


_FUNCTIONS = {
    ccl.ALLREDUCE: _allreduce,
    ccl.ALLGATHER: _allgather,
    ccl.REDUCE_SCATTER: _reducescatter,
    ccl.ALLTOALL: _alltoall,
    ccl.LOCAL_SLICE: _local_slice,
    ccl.SEND_RECV: _send_recv,
    ccl.SEND: _send,
    ccl.RECV: _recv,
}


def _register() -> None:
    import tvm_ffi

    for name, func in _FUNCTIONS.items():
        tvm_ffi.register_global_func(name, func, override=True)


def emulate(executable, inputs: Sequence[Sequence[np.ndarray]], devices: Sequence[int],
            entry: str | Sequence[str | None] = "main", timeout: float = 120.0) -> list:
    """Run a compiled rank program on every device, each in its own thread.

    Parameters
    ----------
    executable : tvm.relax.VMExecutable
        ``tvm.compile`` of the rank-local module.
    inputs : sequence of sequence of numpy.ndarray
        Per device (in ``devices`` order), the local arguments of its entry.
    devices : sequence of int
        The global device ids.
    entry : str or sequence of (str or None)
        The function every device runs, or one per device (in ``devices``
        order, None for a device that runs nothing), as
        :func:`tvm_distx.legalize.lower_distir.rank_entry` gives them.
    timeout : float
        Seconds to wait for every rank, and for any one meeting of ranks.

    Returns
    -------
    list
        Per device, the numpy result (a tuple for tuple results; None for a
        device that ran nothing).

    Raises
    ------
    RuntimeError
        Naming the first rank that failed, chained to its error.
    TimeoutError
        If some rank did not finish in time.
    """
    import tvm
    from tvm import relax

    entries = [entry] * len(devices) if isinstance(entry, str) else list(entry)
    if len(entries) != len(devices) or len(inputs) != len(devices):
        raise ValueError(f"{len(devices)} devices need as many entries and inputs, got "
                         f"{len(entries)} entries and {len(inputs)} inputs")
    _register()
    exchange = _Exchange(devices, timeout)
    results: dict[int, object] = {}
    errors: dict[int, BaseException] = {}

    def rank(device: int, name: str | None, args: Sequence[np.ndarray]) -> None:
        exchange.local.device = device
        exchange.local.counts = {}
        try:
            if name is None:
                results[device] = None
                return
            vm = relax.VirtualMachine(executable, tvm.cpu())
            out = vm[name](*[tvm.runtime.tensor(a) for a in args])
            results[device] = _to_numpy(out)
        except BaseException as err:  # reported below, with the rank
            errors[device] = err
            exchange.abort(err)

    _ACTIVE.append(exchange)
    try:
        threads = [threading.Thread(target=rank, args=(d, e, a), daemon=True)
                   for d, e, a in zip(devices, entries, inputs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
    finally:
        _ACTIVE.pop()
    if errors:
        device, err = sorted(errors.items())[0]
        raise RuntimeError(f"rank {device} failed: {err}") from err
    missing = [d for d in devices if d not in results]
    if missing:
        raise TimeoutError(f"ranks {missing} did not finish within {timeout} s")
    return [results[d] for d in devices]


def _to_numpy(value):
    if hasattr(value, "numpy"):
        return value.numpy()
    return tuple(_to_numpy(v) for v in value)
