"""The emulated backend: every rank a thread of this process, collectives over numpy.

It runs the rank-local program that :class:`tvm_distx.legalize.LowerDistIR`
produces exactly as the real backends do, one TVM virtual machine per rank,
and implements the collectives (:class:`EmulatedCollectives`, registered as
the ``tvm_distx.ccl.*`` functions by :mod:`tvm_distx.runtime.collectives`) by
exchanging numpy buffers between the threads. It is the fast unit-test
backend: no MPI, no processes, and the same numbers.

* :class:`EmulatedSession` serves a bundle like the other sessions, with the
  same rank code (:class:`~tvm_distx.runtime.ranks.RankState`)::

      with EmulatedSession("bundle/") as session:    # one virtual machine per rank, once
          first = session.run(x)                      # each rank loads its weights here, once
          second = session.run(y)                     # the same machines, weights loaded

* :func:`emulate` runs a compiled rank program without a bundle (the rank
  programs of a lowering, with each rank's arguments), on the same ranks.

Each call runs every rank in a thread of its own. A rank that raises, or a call
that outlives its timeout, raises :class:`tvm_distx.LaunchError` naming the
rank (and ends a session), as on the other backends. A rank thread stuck in a
kernel cannot be stopped from outside: it is a daemon thread, told to stop at
its next collective, and nobody waits for it any longer.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import traceback
from typing import Callable, Sequence

import numpy as np
import tvm
from tvm import relax

from tvm_distx.bundle.signature import WORKER0
from tvm_distx.errors import ArgumentError, LaunchError, PeerFailedError
from tvm_distx.runtime.base import Call, RankProcess, Session
from tvm_distx.runtime.collectives import REDUCERS, Collectives, register
from tvm_distx.runtime.ranks import RankState, VMProgram

__all__ = ["emulate", "EmulatedSession", "EmulatedCollectives"]

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()  # runs do not overlap: the ccl functions are process-wide


class _Exchange:
    """Where the ranks of one call swap buffers.

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
        self.failed_rank: int | None = None
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
            raise LaunchError(f"rank {self.local.device} waited {self.timeout} s for its peers",
                              rank=self.local.device, reason="timeout")
        if self.failed is not None and not ready():
            raise PeerFailedError(self.failed_rank) from self.failed

    def abort(self, err: BaseException, rank: int | None = None) -> None:
        """Stop every wait: ``rank`` failed with ``err`` (None: the driver stopped the call)."""
        with self.cond:
            self.failed, self.failed_rank = err, rank
            self.cond.notify_all()


class EmulatedCollectives(Collectives):
    """The collectives of the ranks of one call, as meetings of their threads.

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


class _Ranks:
    """The emulated ranks (the launcher): one :class:`RankState` per device, one thread per call.

    Parameters
    ----------
    library : tvm.runtime.Module or tvm.relax.VMExecutable
        The rank programs.
    manifest : tvm_distx.bundle.manifest.Manifest or None
        The bundle they serve (None: rank-local functions only).
    devices : sequence of int
        The global device ids.
    timeout : float
        Seconds any one meeting of ranks may wait, until a call sets its own.
    """

    def __init__(self, library, manifest, devices: Sequence[int], timeout: float) -> None:
        self.devices = tuple(devices)
        # one collectives object for the ranks' life: the machines hold its functions,
        # and each call gives it a fresh exchange
        self.collectives = EmulatedCollectives(_Exchange(self.devices, timeout))
        with _LOCK:
            register(self.collectives)  # before the machines: they resolve functions once
            self.states = [RankState(manifest, d, VMProgram(relax.VirtualMachine(library, tvm.cpu())))
                           for d in self.devices]

    def dispatch(self, messages: Sequence[tuple], timeout: float, doing: str) -> dict:
        """Hand each rank its message, every rank in a thread; the replies by rank.

        Raises
        ------
        LaunchError
            Naming the first rank that raised, or the ranks that did not finish
            within ``timeout`` seconds.
        """
        exchange = _Exchange(self.devices, timeout)
        replies: dict[int, object] = {}
        failures: list[tuple[int, BaseException, str]] = []  # in the order they happened

        def rank(state: RankState, message: tuple) -> None:
            exchange.local.device = state.rank
            exchange.local.counts = {}
            try:
                replies[state.rank] = state.handle(message)
            except BaseException as err:  # noqa: BLE001 - reported below, with the rank
                with exchange.cond:
                    failures.append((state.rank, err, traceback.format_exc()))
                exchange.abort(err, state.rank)

        with _LOCK:
            self.collectives.exchange = exchange
            register(self.collectives)  # another run may have registered its own since
            threads = [threading.Thread(target=rank, args=(state, message), daemon=True,
                                        name=f"tvm-distx-emulated-rank{state.rank}")
                       for state, message in zip(self.states, messages)]
            deadline = time.monotonic() + timeout
            for thread in threads:
                thread.start()
            try:
                for thread in threads:
                    thread.join(max(0.0, deadline - time.monotonic()))
            finally:
                if any(thread.is_alive() for thread in threads):
                    exchange.abort(LaunchError(f"the ranks did not finish {doing}",
                                               reason="timeout"))
        if failures:
            rank, err, trace = failures[0]
            raise LaunchError(f"rank {rank} failed {doing}: {type(err).__name__}: {err}",
                              rank=rank, reason="raised",
                              details=f"--- rank {rank} ---\n{trace}") from err
        late = [d for d in self.devices if d not in replies]
        if late:
            raise LaunchError(f"ranks {late} did not finish {doing} within {timeout} s",
                              rank=late[0], reason="timeout")
        return replies

    def stop(self) -> None:
        """Wake any rank still waiting in a meeting, and drop the machines."""
        self.collectives.exchange.abort(LaunchError("the ranks were stopped"))
        self.states = []


class EmulatedSession(Session):
    """A bundle's ranks as threads of this process, with their machines and weights kept.

    Parameters
    ----------
    bundle : path or tvm_distx.bundle.manifest.Manifest
        A directory written by :meth:`tvm_distx.DistExecutable.export`.
    num_ranks : int, optional
        Must equal the bundle's rank count when given.
    timeout : float
        Seconds each call may take by default.

    Raises
    ------
    BundleError
        For a bundle that cannot run here.
    ArgumentError
        For a bundle lowered by TVM's ``LowerDistIR``, whose builtins emulated
        ranks do not provide.

    Notes
    -----
    Every :class:`RankProcess` has this process's id.

    See Also
    --------
    tvm_distx.runtime.base.Session : :meth:`run`, :meth:`close` and the
        attributes every session has.
    """

    backend = "emulate"

    def __init__(self, bundle, *, num_ranks: int | None = None,
                 timeout: float = 300.0) -> None:
        super().__init__(bundle, num_ranks=num_ranks, timeout=timeout)
        lowered_by_tvm = [f for f, s in self.manifest.functions.items() if s.feed == WORKER0]
        if lowered_by_tvm:
            raise ArgumentError(
                f"'{lowered_by_tvm[0]}' was lowered by TVM's LowerDistIR (rank 0 takes the global "
                "inputs and the program calls TVM's runtime.disco.* functions), which the "
                "emulator does not provide", hint='run it with backend="mpi" or "disco"')
        devices = tuple(range(self.manifest.num_ranks))
        library = tvm.runtime.load_module(str(self.manifest.library_path))
        self._ranks = _Ranks(library, self.manifest, devices, timeout)
        host = socket.gethostname()
        self.ranks = tuple(RankProcess((rank, os.getpid(), host)) for rank in devices)
        self._closed = False

    def _call(self, call: Call, timeout: float):
        replies = self._ranks.dispatch(self._messages(call), timeout,
                                       f"running '{call.function}'")
        return ({r: blocks for r, (blocks, _) in replies.items()},
                {r: loaded for r, (_, loaded) in replies.items()})

    def _stop(self, failed: bool) -> None:
        self._ranks.stop()


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
    ArgumentError
        If ``entry`` or ``inputs`` do not give one per device.
    LaunchError
        Naming the first rank that failed (chained to its error), or the ranks
        that did not finish in time.
    """
    entries = [entry] * len(devices) if isinstance(entry, str) else list(entry)
    if len(entries) != len(devices) or len(inputs) != len(devices):
        raise ArgumentError(f"{len(devices)} devices need as many entries and inputs, got "
                            f"{len(entries)} entries and {len(inputs)} inputs",
                            hint="give one entry and one list of arguments per device")
    ranks = _Ranks(executable, None, devices, timeout)
    doing = f"running '{entry}'" if isinstance(entry, str) else "running its rank programs"
    try:
        replies = ranks.dispatch([("entry", e, list(a)) for e, a in zip(entries, inputs)],
                                 timeout, doing)
    finally:
        ranks.stop()
    return [replies[d] for d in devices]
