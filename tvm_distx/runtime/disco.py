"""The disco backend: one worker process per rank on this host, collectives over shared memory.

:func:`run_disco` starts a ``tvm.runtime.disco`` ProcessSession whose workers
run :mod:`tvm_distx.runtime.disco_worker`, and calls
:func:`~tvm_distx.runtime.disco_worker.run_rank` on every worker once. Disco
carries only that call; the data goes through one anonymous shared-memory
segment (:mod:`tvm_distx.runtime.disco_shm`), with the ranks' inputs, their
collectives and their status:

* the segment is a ``memfd`` (or, where there is none, a temporary file that
  is unlinked as soon as it is open), so it has no name anyone can guess or
  leak: the worker processes inherit its descriptor, and the memory goes away
  with the last descriptor;
* the worker processes are started by our own process-pool callback rather
  than TVM's, to pass that descriptor and to know their process ids;
* worker 0 runs as a thread of this process (disco's design): it gathers every
  rank's result over the segment and leaves them here;
* a rank that raises records its traceback and stops every other rank's waits;
  nothing raises inside disco, because an exception escaping a disco worker
  kills the worker process and, on worker 0, this process.

Workers never outlive :func:`run_disco`: it shuts the session down, waits for
the processes and kills what is left. Runs do not overlap (a lock serialises
them), and while one runs, the ``tvm_distx.ccl.*`` functions of this process
are those of the segment.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import pickle
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

from tvm_distx.errors import LaunchError

from tvm_distx.runtime import disco_worker
from tvm_distx.runtime.disco_shm import (ABORTED, FAILED, RUNNING, TIMED_OUT, Layout,
                                         ShmComm)
from tvm_distx.runtime.rank_env import rank_environment

__all__ = ["run_disco"]

logger = logging.getLogger(__name__)

#: The module the worker processes run.
ENTRYPOINT = "tvm_distx.runtime.disco_worker"

_POOL = "tvm_distx.disco.create_process_pool"
_SLOT_BYTES = 16 << 20  # per rank; only the pages touched are ever allocated
_GRACE = 5.0  # seconds past the deadline before the controller kills workers
_LOCK = threading.Lock()
# A worker runs its entrypoint as ``python -m`` would, but without torch:
# tvm_ffi imports torch whenever it is installed, which costs a worker 2.3 s
# and 210 MB here, and a worker has no use for it.
_LAUNCH = ("import runpy, sys; sys.modules['torch'] = None; "
           "runpy.run_module({entrypoint!r}, run_name='__main__')")


def run_disco(library: str | os.PathLike, entries: Sequence[str | None],
              inputs: Sequence[Sequence[np.ndarray]], *, timeout: float = 120.0) -> list:
    """Run a compiled rank-local program on one disco worker process per device.

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
        traceback in ``details``), or a rank that did not finish within
        ``timeout`` seconds (``reason="timeout"``).
    ValueError, FileNotFoundError
        On bad arguments.
    """
    entries = list(entries)
    inputs = [list(args) for args in inputs]
    if not entries or len(inputs) != len(entries):
        raise ValueError(f"need one entry and one input list per device, got {len(entries)} "
                         f"entries and {len(inputs)} input lists")
    path = Path(library).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no library at {path}")
    with _LOCK:
        return _run(str(path), entries, inputs, float(timeout))


def _run(library: str, entries: list, inputs: list, timeout: float) -> list:
    world = len(entries)
    blobs = [pickle.dumps([np.asarray(a) for a in args], protocol=pickle.HIGHEST_PROTOCOL)
             for args in inputs]
    starts = np.cumsum([0] + [len(b) for b in blobs]).tolist()
    layout = Layout(world, _SLOT_BYTES, starts[-1])
    deadline = time.time() + timeout
    job = uuid.uuid4().hex
    fd = _segment(layout.size)
    pool = _Pool(fd)
    buf = view = sess = None
    try:
        buf = mmap.mmap(fd, layout.size)
        for blob, start in zip(blobs, starts):
            at = layout.inputs_offset + start
            buf[at:at + len(blob)] = blob
        view = ShmComm(buf, layout, 0, deadline)
        manifest = json.dumps({
            "job": job, "fd": fd, "layout": vars(layout), "deadline": deadline,
            "library": library, "entries": entries,
            "inputs": [[start, len(blob)] for blob, start in zip(blobs, starts)],
        })
        api = disco_worker.repair_disco()
        tvm_ffi.register_global_func(_POOL, pool.factory, override=True)
        sess = api.SessionProcess(world, 1, _POOL, ENTRYPOINT)
        sess.get_global_func(disco_worker.RUN)(manifest)
        _wait(view, pool, deadline + _GRACE)
        error = _error(view, timeout)
        if error is not None:
            raise error
        return disco_worker.RESULTS.pop(job)
    finally:
        if view is not None and (view.status == RUNNING).any():
            view.abort()  # wake every wait, then stop what is still running
        pool.kill([w for w, p in pool.procs.items()
                   if p.poll() is not None or view is None or view.status[w] == RUNNING])
        if sess is not None:
            _shutdown(sess, pool)
            del sess
        pool.reap(_GRACE)
        pool.close()
        disco_worker.RESULTS.pop(job, None)
        del view
        if buf is not None:
            try:
                buf.close()
            except BufferError:  # a traceback holds a view; the GC unmaps it
                pass
        os.close(fd)


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


def _wait(view: ShmComm, pool: "_Pool", until: float) -> None:
    """Wait until every rank has a final status; a dead worker process counts as failed."""
    while (view.status == RUNNING).any() and time.time() < until:
        for rank, code in pool.exited().items():
            if view.status[rank] == RUNNING:
                view.fail(f"the worker process exited with code {code}", rank)
        time.sleep(0.005)


def _error(view: ShmComm, timeout: float) -> BaseException | None:
    status = view.status.tolist()
    failed = [r for r, s in enumerate(status) if s in (FAILED, TIMED_OUT)]
    if failed:
        first = int(view.failed[0]) - 1
        rank = first if first in failed else failed[0]
        trace = view.message(rank).strip()
        summary = trace.splitlines()[-1] if trace else "unknown error"
        reason = "timeout" if status[rank] == TIMED_OUT else "raised"
        return LaunchError(f"rank {rank} failed: {summary}", rank=rank, reason=reason,
                           details=f"--- rank {rank} ---\n{trace}")
    late = [r for r, s in enumerate(status) if s == RUNNING]
    if late:
        return LaunchError(f"ranks {late} did not finish within {timeout} s", rank=late[0],
                           reason="timeout")
    aborted = [r for r, s in enumerate(status) if s == ABORTED]
    if aborted:  # pragma: no cover - an abort always has a cause above
        return LaunchError(f"ranks {aborted} stopped: {view.message(aborted[0])}",
                           rank=aborted[0])
    return None


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
