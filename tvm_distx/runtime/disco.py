"""The disco backend's driver: one worker process per rank on this host, shared-memory collectives.

::

    with DiscoSession("bundle/") as session:      # the workers start once
        first = session.run(x)                     # each rank loads its weights here, once
        second = session.run(y)                    # the same processes, weights loaded

A one-shot run is a session called once, and :func:`run_disco` runs compiled
rank programs without a bundle on the same workers. :class:`_Workers` (the
launcher) starts a ``tvm.runtime.disco`` ProcessSession whose workers run
:mod:`tvm_distx.runtime.disco_rank`; disco carries only its two calls
(:func:`~tvm_distx.runtime.disco_rank.open_rank` once,
:func:`~tvm_distx.runtime.disco_rank.call_rank` per call). The data goes
through one anonymous shared-memory segment
(:mod:`tvm_distx.runtime.disco_shm`): each rank's message (already cut into
its shards here), the ranks' collectives, their replies and their status:

* the segment is a ``memfd`` (or, where there is none, a temporary file that
  is unlinked as soon as it is open), so it has no name anyone can guess or
  leak: the worker processes inherit its descriptor, and the memory goes away
  with the last descriptor; it grows when a call's inputs need more room;
* the worker processes are started by our own process-pool callback rather
  than TVM's, to pass that descriptor and to know their process ids;
* worker 0 runs as a thread of this process (disco's design): it gathers every
  rank's reply over the segment and leaves them here;
* a rank that raises records its traceback and stops every other rank's waits;
  nothing raises inside disco, because an exception escaping a disco worker
  kills the worker process and, on worker 0, this process.

Each rank keeps its virtual machine, its stored weights (read once through
:meth:`tvm_distx.bundle.manifest.Manifest.read_weight`) and its resident values
(``state``/``keep``) between calls (:class:`~tvm_distx.runtime.ranks.RankState`).

Failures raise :class:`tvm_distx.LaunchError` naming the rank (and end the
session): a rank that raises (its traceback), a worker process that dies (its
exit code), a call that outlives its timeout. Ctrl-C and any other exception in
the caller end it too. Ending kills every worker process and waits for it,
closes the segment and forgets rank 0's state; a closed session refuses calls.
Calls of disco sessions in one process do not overlap (a lock), because while
one runs the collectives of this process are those of its segment.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Sequence

import numpy as np
import tvm_ffi

from tvm_distx.errors import ArgumentError, LaunchError
from tvm_distx.runtime import disco_rank
from tvm_distx.runtime.base import Call, RankProcess, Session
from tvm_distx.runtime.disco_shm import ABORTED, FAILED, RUNNING, TIMED_OUT, Layout, ShmComm
from tvm_distx.runtime.rank_env import rank_environment

__all__ = ["DiscoSession", "run_disco"]

logger = logging.getLogger(__name__)

#: The module the worker processes run.
ENTRYPOINT = "tvm_distx.runtime.disco_rank"

_POOL = "tvm_distx.disco.create_process_pool"
_SLOT_BYTES = 16 << 20  # per rank; only the pages touched are ever allocated
_INPUT_BYTES = 1 << 20  # the input area to start with; grown on demand
_GRACE = 5.0  # seconds past the deadline before the controller kills workers
_MAX_SLEEP = 2e-3  # seconds between two looks at the ranks' status, at most
_LOCK = threading.Lock()
_ABANDONED: list = []  # sessions whose rank 0 thread never returned (never destroyed)
_HINT = "the session is closed; open a new one"
# A worker runs its entrypoint as ``python -m`` would, but without torch:
# tvm_ffi imports torch whenever it is installed, which costs a worker 2.3 s
# and 210 MB here, and a worker has no use for it.
_LAUNCH = ("import runpy, sys; sys.modules['torch'] = None; "
           "runpy.run_module({entrypoint!r}, run_name='__main__')")


class _Workers:
    """The disco workers of one session (the launcher): started, called, stopped.

    Parameters
    ----------
    world : int
        How many ranks.
    opening : dict
        What :func:`~tvm_distx.runtime.disco_rank.open_rank` opens: ``bundle``
        or ``library``.
    timeout : float
        Seconds for the workers to start and open.
    hint : str, optional
        The hint of the errors that end the workers.

    Raises
    ------
    LaunchError
        If a worker does not start or open, naming its rank.
    """

    def __init__(self, world: int, opening: dict, timeout: float,
                 hint: str | None = None) -> None:
        self.world, self.hint = world, hint
        self.id = uuid.uuid4().hex
        self.layout = Layout(world, _SLOT_BYTES, _INPUT_BYTES)
        self.fd: int | None = _segment(self.layout.size)
        self.pool = _Pool(self.fd)
        self.buf: mmap.mmap | None = None
        self._sess = self._open_rank = self._call_rank = None
        self._dispatched = 0  # calls sent to rank 0 (a thread of this process)
        try:
            self.buf = mmap.mmap(self.fd, self.layout.size)
            with _LOCK:
                api = disco_rank.repair_disco()
                tvm_ffi.register_global_func(_POOL, self.pool.factory, override=True)
                self._sess = api.SessionProcess(world, 1, _POOL, ENTRYPOINT)
                self._open_rank = self._sess.get_global_func(disco_rank.OPEN)
                self._call_rank = self._sess.get_global_func(disco_rank.CALL)
                self._dispatch("_open_rank", opening, [b""] * world, timeout, "starting")
        except BaseException:
            self.stop(failed=True)
            raise

    def processes(self) -> tuple[RankProcess, ...]:
        """Every rank's process: rank 0 is this one."""
        host = socket.gethostname()
        return (RankProcess((0, os.getpid(), host)),) + tuple(
            RankProcess((w, self.pool.procs[w].pid, host)) for w in range(1, self.world))

    def call(self, messages: Sequence[tuple], timeout: float, doing: str) -> dict:
        """Hand each rank its message; every rank's reply, by rank."""
        blobs = [pickle.dumps(m, protocol=pickle.HIGHEST_PROTOCOL) for m in messages]
        with _LOCK:
            return self._dispatch("_call_rank", {}, blobs, timeout, doing)

    def _dispatch(self, func: str, fields: dict, blobs: list[bytes], timeout: float,
                  doing: str):
        """Run one disco call (``self.<func>``) on every rank over the segment; the replies.

        The function is looked up here and not held: a traceback that keeps this
        frame must not keep the disco session alive once it is stopped.
        """
        self._check_workers(doing)
        starts = np.cumsum([0] + [len(b) for b in blobs]).tolist()
        if starts[-1] > self.layout.input_bytes:
            self._grow(starts[-1])
        layout, buf = self.layout, self.buf
        buf[:layout.slots_offset] = bytes(layout.slots_offset)  # status, counters, errors
        for blob, start in zip(blobs, starts):
            at = layout.inputs_offset + start
            buf[at:at + len(blob)] = blob
        deadline = time.time() + timeout
        job = uuid.uuid4().hex
        view = ShmComm(buf, layout, 0, deadline)
        try:
            try:
                self._dispatched += 1
                getattr(self, func)(json.dumps({
                    **fields, "session": self.id, "job": job, "fd": self.fd,
                    "layout": vars(layout), "deadline": deadline,
                    "inputs": [[s, len(b)] for b, s in zip(blobs, starts)]}))
            except Exception as err:  # disco could not reach a worker: which one?
                self._check_workers(doing)
                raise LaunchError(f"the disco workers failed {doing}: {err}",
                                  hint=self.hint) from err
            self._wait(view, deadline + _GRACE)
            error = self._failure(view, doing, timeout)
            if error is not None:
                raise error
            return disco_rank.RESULTS.pop(job, {})
        finally:
            if (view.status == RUNNING).any():
                view.abort()  # wake every wait: the workers are being stopped
            disco_rank.RESULTS.pop(job, None)
            del view

    def _wait(self, view: ShmComm, until: float) -> None:
        """Wait until every rank has a final status; a dead worker process counts as failed."""
        delay = 2e-5
        while (view.status == RUNNING).any() and time.time() < until:
            for rank, code in self.pool.exited().items():
                if view.status[rank] == RUNNING:
                    view.fail(f"the worker process exited with code {code}", rank)
            time.sleep(delay)
            delay = min(2 * delay, _MAX_SLEEP)

    def _failure(self, view: ShmComm, doing: str, timeout: float) -> LaunchError | None:
        """The error naming the rank that ended the call, if one did."""
        status = view.status.tolist()
        failed = [r for r, s in enumerate(status) if s in (FAILED, TIMED_OUT)]
        late = [r for r, s in enumerate(status) if s == RUNNING]
        if not failed and not late:
            aborted = [r for r, s in enumerate(status) if s == ABORTED]
            if aborted:  # pragma: no cover - an abort always has a cause above
                return LaunchError(f"ranks {aborted} stopped {doing}: "
                                   f"{view.message(aborted[0])}", rank=aborted[0],
                                   hint=self.hint)
            return None
        if failed:
            first = int(view.failed[0]) - 1
            rank = first if first in failed else failed[0]
        else:
            rank = late[0]
        code = self.pool.exited().get(rank)
        if code is not None:
            return LaunchError(f"rank {rank} died {doing}: its worker process exited with code "
                               f"{code}", rank=rank, reason="killed" if code < 0 else "exited",
                               hint=self.hint)
        trace = view.message(rank).strip() if failed else ""
        details = f"--- rank {rank} ---\n{trace}" if trace else ""
        if late or status[rank] == TIMED_OUT:
            # the rank that never reported, not the one that gave up waiting for it
            rank = late[0] if late else rank
            return LaunchError(f"rank {rank} did not finish {doing} within {timeout} s",
                               rank=rank, reason="timeout", details=details,
                               hint=(self.hint + "; " if self.hint else "") + "raise timeout=, "
                               "or look for a rank that never reached a collective the others "
                               "wait in")
        summary = trace.splitlines()[-1] if trace else "unknown error"
        return LaunchError(f"rank {rank} failed {doing}: {summary}", rank=rank, reason="raised",
                           details=details, hint=self.hint)

    def _check_workers(self, doing: str) -> None:
        exited = self.pool.exited()
        if exited:
            rank, code = min(exited.items())
            raise LaunchError(f"rank {rank} died {doing}: its worker process exited with "
                              f"code {code}", rank=rank, reason="killed" if code < 0 else
                              "exited", hint=self.hint)

    def _grow(self, need: int) -> None:
        """A larger input area: the workers map the segment anew on every call."""
        layout = Layout(self.layout.world, self.layout.slot_bytes,
                        max(need, 2 * self.layout.input_bytes))
        os.ftruncate(self.fd, layout.size)
        old, self.buf = self.buf, mmap.mmap(self.fd, layout.size)
        self.layout = layout
        try:
            old.close()
        except BufferError:  # a view is still alive somewhere; the GC unmaps it
            pass

    def stop(self, failed: bool) -> None:
        """Kill every worker process and wait for it, close the segment (once)."""
        pool = self.pool
        idle = self._worker0_idle(_GRACE)
        pool.kill([w for w, p in pool.procs.items() if p.poll() is not None or failed
                   or not idle])
        if self._sess is not None:
            _shutdown(self._sess, pool)
            sess, self._sess, self._open_rank, self._call_rank = self._sess, None, None, None
            if idle or self._worker0_idle(_GRACE):
                del sess  # joins worker 0's thread: it must not be running Python then
            else:  # dropping it now would deadlock: the join holds the GIL worker 0 needs
                logger.warning("disco: rank 0 is still running a call; its thread is left "
                               "behind (the worker processes are stopped)")
                _ABANDONED.append(sess)
        pool.reap(_GRACE)
        pool.close()
        disco_rank.forget(self.id)
        if self.buf is not None:
            try:
                self.buf.close()
            except BufferError:  # a traceback holds a view; the GC unmaps it
                pass
            self.buf = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def _worker0_idle(self, timeout: float) -> bool:
        """Wait until rank 0's thread has returned from every call sent to it."""
        until = time.monotonic() + timeout
        while True:
            thread = disco_rank.THREADS.get(self.id)
            done = disco_rank.FINISHED.get(self.id, 0) >= self._dispatched
            if done and (thread is None or thread not in sys._current_frames()):
                return True
            if time.monotonic() > until:
                return False
            time.sleep(1e-3)


class DiscoSession(Session):
    """A bundle's ranks as disco worker processes on this host, started once.

    Parameters
    ----------
    bundle : path or tvm_distx.bundle.manifest.Manifest
        A directory written by :meth:`tvm_distx.DistExecutable.export`.
    num_ranks : int, optional
        Must equal the bundle's rank count when given.
    timeout : float
        Seconds the ranks may take to start, and each call by default.

    Raises
    ------
    BundleError
        For a bundle that cannot run here (before anything starts).
    LaunchError
        If the ranks do not start (naming the rank).

    Notes
    -----
    Rank 0 is a thread of this process (disco's design): its
    :class:`RankProcess` has this process's id.

    See Also
    --------
    tvm_distx.runtime.base.Session : :meth:`run`, :meth:`close` and the
        attributes every session has.
    """

    backend = "disco"

    def __init__(self, bundle, *, num_ranks: int | None = None,
                 timeout: float = 300.0) -> None:
        super().__init__(bundle, num_ranks=num_ranks, timeout=timeout)
        started = time.monotonic()
        self._workers = _Workers(self.manifest.num_ranks,
                                 {"bundle": str(self.manifest.root.resolve())}, timeout, _HINT)
        self.ranks = self._workers.processes()
        self._closed = False
        logger.info("disco session: %d ranks ready in %.2f s", len(self.ranks),
                    time.monotonic() - started)

    def _call(self, call: Call, timeout: float):
        replies = self._workers.call(self._messages(call), timeout,
                                     f"running '{call.function}'")
        return ({r: blocks for r, (blocks, _) in replies.items()},
                {r: loaded for r, (_, loaded) in replies.items()})

    def _stop(self, failed: bool) -> None:
        self._workers.stop(failed)


def run_disco(library: str | os.PathLike, entries: Sequence[str | None],
              inputs: Sequence[Sequence[np.ndarray]], *, timeout: float = 120.0) -> list:
    """Run a compiled rank-local program on one disco worker process per device.

    The workers of a :class:`DiscoSession`, opened on a library instead of a
    bundle, called once and stopped.

    Parameters
    ----------
    library : str or os.PathLike
        A shared library written by ``tvm.compile(mod, target=...).export_library(path)``
        for a CPU target.
    entries : sequence of (str or None)
        Per device (worker ``d`` is device ``d``), the Relax function it runs,
        or None for a device that runs nothing (see
        :func:`tvm_distx.legalize.lower_distir.rank_entry`).
    inputs : sequence of sequence of numpy.ndarray
        Per device, the arguments of its entry (its local shards).
    timeout : float
        Seconds for the whole run, starting the worker processes included.

    Returns
    -------
    list
        Per device, the numpy result (a tuple for a tuple result; None for a
        device that ran nothing).

    Raises
    ------
    LaunchError
        Naming the first rank that failed (``reason="raised"``, with its
        traceback in ``details``), a worker process that died, or a rank that
        did not finish within ``timeout`` seconds (``reason="timeout"``).
    ArgumentError
        If ``entries`` and ``inputs`` do not give one per device, or there is
        no library at ``library``.
    """
    entries = list(entries)
    inputs = [[np.asarray(a) for a in args] for args in inputs]
    if not entries or len(inputs) != len(entries):
        raise ArgumentError(f"need one entry and one input list per device, got {len(entries)} "
                            f"entries and {len(inputs)} input lists",
                            hint="give one entry and one list of arguments per device")
    path = Path(library).resolve()
    if not path.is_file():
        raise ArgumentError(f"no library at {path}",
                            hint="write one with tvm.compile(mod).export_library(path)")
    deadline = time.monotonic() + timeout
    workers = _Workers(len(entries), {"library": str(path)}, timeout)
    failed = True
    try:
        replies = workers.call([("entry", e, a) for e, a in zip(entries, inputs)],
                               max(1e-3, deadline - time.monotonic()), "running its rank programs")
        failed = False
    finally:
        workers.stop(failed)
    return [replies[d] for d in range(len(entries))]


def _shutdown(sess, pool: "_Pool") -> None:
    """``sess.shutdown()``, which must not hang the caller.

    Disco's shutdown writes a command to every worker and waits for them; a
    worker that neither exits nor reads (stuck, or half dead) would block it
    forever. It runs in a thread: past ``_GRACE`` seconds every worker is
    killed, which ends any wait on their pipes; a shutdown still blocked after
    that is abandoned with a warning (its thread is a daemon).
    """

    def shut() -> None:
        try:
            sess.shutdown()
        except Exception:  # noqa: BLE001 - keep cleaning up
            logger.warning("disco session shutdown failed", exc_info=True)

    thread = threading.Thread(target=shut, name="tvm-distx-disco-shutdown", daemon=True)
    thread.start()
    thread.join(_GRACE)
    if thread.is_alive():
        logger.warning("disco session shutdown is stuck; killing every worker")
        pool.kill([w for w, p in pool.procs.items() if p.poll() is None])
        thread.join(_GRACE)
        if thread.is_alive():
            logger.error("disco session shutdown did not return; abandoning it")


def _segment(size: int) -> int:
    """A descriptor of ``size`` bytes of shared memory with no name in any file system."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("tvm_distx_disco")
    else:  # pragma: no cover - not Linux
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, name = tempfile.mkstemp(prefix="tvm_distx_disco_", dir=shm)
        os.unlink(name)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


class _Pool:
    """The worker processes of one session, started by disco through :meth:`factory`.

    Parameters
    ----------
    fd : int
        The shared-memory descriptor every worker inherits (same number).
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.procs: dict[int, subprocess.Popen] = {}
        self.pipes: dict[int, tuple[int, int]] = {}  # our ends, used by disco
        self.released = False  # the session is gone

    def factory(self, workers: int, groups: int, entrypoint: str):
        """Disco's process-pool callback: returns ``start(worker_id)``."""

        def start(worker_id: int):
            if worker_id == 0:  # the session is being destroyed
                self.released = True
                return None
            to_worker, from_worker = os.pipe(), os.pipe()
            cmd = [sys.executable, "-c", _LAUNCH.format(entrypoint=entrypoint), str(worker_id),
                   str(workers), str(groups), str(to_worker[0]), str(from_worker[1])]
            env = rank_environment()
            env.setdefault("TVM_NUM_THREADS", "1")  # the ranks are the parallelism
            try:
                proc = subprocess.Popen(cmd, env=env,
                                        pass_fds=(to_worker[0], from_worker[1], self.fd))
            except BaseException:
                os.close(to_worker[1])
                os.close(from_worker[0])
                raise
            finally:
                os.close(to_worker[0])
                os.close(from_worker[1])
            self.procs[worker_id] = proc
            self.pipes[worker_id] = (from_worker[0], to_worker[1])
            logger.debug("disco worker %d is process %d", worker_id, proc.pid)
            return tvm_ffi.Shape([from_worker[0], to_worker[1]])

        return start

    def exited(self) -> dict[int, int]:
        """Workers whose process has ended, with the exit code."""
        return {w: p.returncode for w, p in self.procs.items() if p.poll() is not None}

    def kill(self, workers) -> None:
        """Kill ``workers`` (or reap them if dead) and point disco's pipe ends at /dev/null.

        Disco writes a shutdown command to every worker; a write to a dead
        worker's pipe raises, and raises again in the session's destructor,
        which aborts this process.
        """
        null = os.open(os.devnull, os.O_RDWR)
        try:
            for worker in workers:
                self.procs[worker].kill()
                code = self.procs[worker].wait()
                for end in self.pipes[worker]:
                    os.dup2(null, end)
                logger.warning("stopped disco worker %d (exit code %d)", worker, code)
        finally:
            os.close(null)

    def close(self) -> None:
        """Close our pipe ends once the session is gone (disco never closes them)."""
        if not self.released:
            logger.debug("the disco session is still referenced; its pipes stay open")
            return
        for ends in self.pipes.values():
            for end in ends:
                os.close(end)
        self.pipes.clear()

    def reap(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for every worker to exit, then kill the rest."""
        until = time.time() + timeout
        for worker, proc in self.procs.items():
            try:
                proc.wait(max(0.0, until - time.time()))
            except subprocess.TimeoutExpired:
                logger.warning("disco worker %d did not exit; killing it", worker)
                proc.kill()
                proc.wait()
