"""The emulated backend: every rank in a thread of one process, collectives over numpy.

It runs the rank-local program that :class:`tvm_distx.legalize.LowerDistIR`
produces exactly as the real backends will, one TVM virtual machine per rank,
and implements the collectives (:class:`EmulatedCollectives`, registered as
the ``tvm_distx.ccl.*`` functions by :mod:`tvm_distx.runtime.collectives`) by
exchanging numpy buffers between the threads. It is the fast unit-test backend: no MPI, no
processes, and the same numbers.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Sequence

import numpy as np

from tvm_distx.runtime.collectives import REDUCERS, Collectives, register

__all__ = ["emulate", "EmulatedCollectives"]

logger = logging.getLogger(__name__)

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


class EmulatedCollectives(Collectives):
    """The collectives of the ranks of one run, as meetings of their threads.

    The calling rank is the thread's device; every collective is a meeting of
    its group where each member reads what it needs from the posted buffers.
    """

    def __init__(self, exchange: _Exchange) -> None:
        self.exchange = exchange

    @property
    def rank(self) -> int:
        return self.exchange.local.device

    @property
    def devices(self) -> tuple[int, ...]:
        return self.exchange.devices

    def all_reduce(self, x, out, op, group) -> None:
        def read(posted):
            out[...] = _fold(posted, group.members, op)

        self.exchange.meet(group.members, x, read)

    def reduce_scatter(self, x, out, op, dim, group) -> None:
        def read(posted):
            blocks = np.split(_fold(posted, group.members, op), group.size, axis=dim)
            out[...] = blocks[group.index]

        self.exchange.meet(group.members, x, read)

    def all_gather(self, x, out, dim, group) -> None:
        def read(posted):
            out[...] = np.concatenate([posted[d] for d in group.members], axis=dim)

        self.exchange.meet(group.members, x, read)

    def all_to_all(self, x, out, split, concat, group) -> None:
        def read(posted):
            pieces = [np.split(posted[d], group.size, axis=split)[group.index]
                      for d in group.members]
            out[...] = np.concatenate(pieces, axis=concat)

        self.exchange.meet(group.members, x, read)

    def broadcast(self, x, out, root, group) -> None:
        def read(posted):
            out[...] = posted[group.members[root]]

        self.exchange.meet(group.members, x, read)

    def move(self, x, out, spec) -> None:
        me = self.rank

        def read(posted):
            if out is not None:
                for piece in spec.pieces(me):
                    out[piece.target] = posted[piece.sender][piece.source]

        self.exchange.meet(spec.participants(), x, read)


def _fold(posted: dict[int, np.ndarray], members: tuple[int, ...], op: int) -> np.ndarray:
    """The members' buffers reduced in member order, ``((x0 op x1) op x2) ...``."""
    reduce = REDUCERS[op]
    result = posted[members[0]]
    for d in members[1:]:
        result = reduce(result, posted[d])
    return result


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
    exchange = _Exchange(devices, timeout)
    register(EmulatedCollectives(exchange))  # runs do not overlap
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

    threads = [threading.Thread(target=rank, args=(d, e, a), daemon=True)
               for d, e, a in zip(devices, entries, inputs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
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
