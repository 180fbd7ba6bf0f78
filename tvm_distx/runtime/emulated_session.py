"""A persistent session of emulated ranks: every rank a thread of this process.

The emulated backend (:mod:`tvm_distx.runtime.emulator`) as a session::

    with EmulatedSession("bundle/") as session:    # one virtual machine per rank, once
        first = session.run(x)                      # each rank loads its weights here, once
        second = session.run(y)                     # the same machines, weights loaded

It serves a bundle like the other sessions, and with the same rank code
(:class:`~tvm_distx.runtime.session_worker.RankState`): each rank keeps its
virtual machine over the bundle's library, its stored weights (read once
through :meth:`tvm_distx.bundle.manifest.Manifest.read_weight`) and its resident values
(``state``/``keep``). Each call runs every rank in a thread of its own, with
the collectives of :class:`~tvm_distx.runtime.emulator.EmulatedCollectives`;
nothing leaves the process, so it is the fast way to test what a session does.

A rank that raises, or a call that outlives its timeout, ends the session with
:class:`tvm_distx.LaunchError` naming the rank, as on the other backends. A
rank thread stuck in a kernel cannot be stopped from outside: it is a daemon
thread, told to stop at its next collective, and the session no longer waits
for it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import traceback

from tvm_distx.errors import ArgumentError, LaunchError
from tvm_distx.runtime.collectives import register
from tvm_distx.runtime.emulator import EmulatedCollectives, _Exchange
from tvm_distx.runtime.session_base import Call, RankProcess, Session
from tvm_distx.runtime.session_worker import RankState, assemble_reply
from tvm_distx.bundle.signature import WORKER0

__all__ = ["EmulatedSession"]

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()  # calls do not overlap: the ccl functions are process-wide


class EmulatedSession(Session):
    """A bundle's ranks as threads of this process, with their machines and weights kept.

    Parameters
    ----------
    bundle : path
        A directory written by :meth:`tvm_distx.DistExecutable.export`.
    num_ranks : int, optional
        Must equal the bundle's rank count when given.
    timeout : float
        Seconds each call may take by default.

    Raises
    ------
    BundleError
        For a bundle that cannot run here.

    Notes
    -----
    Every :class:`RankProcess` has this process's id.

    See Also
    --------
    tvm_distx.runtime.session_base.Session : :meth:`run`, :meth:`close` and the
        attributes every session has.
    """

    backend = "emulate"

    def __init__(self, bundle, *, num_ranks: int | None = None,
                 timeout: float = 300.0) -> None:
        import tvm
        from tvm import relax

        super().__init__(bundle, num_ranks=num_ranks, timeout=timeout)
        lowered_by_tvm = [f for f, s in self.manifest.functions.items() if s.feed == WORKER0]
        if lowered_by_tvm:
            raise ArgumentError(
                f"'{lowered_by_tvm[0]}' was lowered by TVM's LowerDistIR (rank 0 takes the global "
                "inputs and the program calls TVM's runtime.disco.* functions), which emulated "
                "ranks do not provide", hint='open the session with backend="mpi" or "disco"')
        devices = tuple(range(self.manifest.num_ranks))
        # one collectives object for the session's life: the machines hold its functions,
        # and each call gives it a fresh exchange
        self._collectives = EmulatedCollectives(_Exchange(devices, timeout))
        library = tvm.runtime.load_module(str(self.manifest.library_path))
        with _LOCK:
            register(self._collectives)  # before the machines: they resolve functions once
            self._ranks = [RankState(self.manifest, rank,
                                     relax.VirtualMachine(library, tvm.cpu()))
                           for rank in devices]
        host = socket.gethostname()
        self.ranks = tuple(RankProcess((rank, os.getpid(), host)) for rank in devices)
        self._closed = False

    def _call(self, call: Call, timeout: float):
        devices = tuple(range(self.manifest.num_ranks))
        exchange = _Exchange(devices, timeout)
        blocks: dict[int, dict] = {}
        failures: list[tuple[int, BaseException, str]] = []  # in the order they happened

        def rank(state: RankState) -> None:
            exchange.local.device = state.rank
            exchange.local.counts = {}
            try:
                blocks[state.rank] = state.call(call.function, call.values, call.sizes,
                                                call.state, call.keep)
            except BaseException as err:  # noqa: BLE001 - reported by the caller, with the rank
                with exchange.cond:
                    failures.append((state.rank, err, traceback.format_exc()))
                exchange.abort(err)

        with _LOCK:
            self._collectives.exchange = exchange
            register(self._collectives)  # another run may have registered its own since
            threads = [threading.Thread(target=rank, args=(state,), daemon=True,
                                        name=f"tvm-distx-emulated-rank{state.rank}")
                       for state in self._ranks]
            deadline = time.monotonic() + timeout
            for thread in threads:
                thread.start()
            try:
                for thread in threads:
                    thread.join(max(0.0, deadline - time.monotonic()))
            finally:
                if any(thread.is_alive() for thread in threads):
                    exchange.abort(TimeoutError("the session ended"))
        doing = f"running '{call.function}'"
        if failures:
            rank, err, trace = failures[0]
            raise LaunchError(f"rank {rank} failed {doing}: {type(err).__name__}: {err}",
                              rank=rank, reason="raised", details=f"--- rank {rank} ---\n{trace}",
                              hint="the session is closed; open a new one")
        late = [d for d in devices if d not in blocks]
        if late:
            raise LaunchError(f"ranks {late} did not finish {doing} within {timeout} s",
                              rank=late[0], reason="timeout",
                              hint="the session is closed; raise timeout=")
        result = assemble_reply(self.manifest, call.function, call.sizes, call.keep, blocks)
        return result, {state.rank: len(state.loaded) for state in self._ranks}

    def _stop(self, failed: bool) -> None:
        self._collectives.exchange.abort(RuntimeError("the session is closed"))
        self._ranks = []
