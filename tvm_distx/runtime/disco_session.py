"""A persistent session on disco workers: started once, called many times.

:func:`tvm_distx.runtime.disco.run_disco` starts a disco ``ProcessSession``,
runs one call and stops it. :class:`DiscoSession` keeps it::

    with DiscoSession("bundle/") as session:      # the workers start once
        first = session.run(x)                     # each rank loads its weights here, once
        second = session.run(y)                    # the same processes, weights loaded

It is the same machinery as :mod:`tvm_distx.runtime.disco`: one worker process
per rank on this host, started by our own process pool with the descriptor of
one anonymous shared-memory segment (a ``memfd``, no name to leak), worker 0 a
thread of this process, and the collectives of
:mod:`tvm_distx.runtime.disco_shm` over the segment. Disco carries only the
two calls of :mod:`tvm_distx.runtime.disco_worker`
(:func:`~tvm_distx.runtime.disco_worker.open_rank` once,
:func:`~tvm_distx.runtime.disco_worker.call_rank` per call); the inputs
(already cut into each rank's shards here), the results and every rank's
status go through the segment. The segment grows when a call's inputs need
more room. Each rank keeps its virtual machine, its stored weights (read once
through :meth:`tvm_distx.bundle.manifest.Manifest.read_weight`) and its resident values
(``state``/``keep``) between calls, as MPI ranks do
(:class:`~tvm_distx.runtime.session_worker.RankState`).

Failures end the session with :class:`tvm_distx.LaunchError` naming the rank: a
rank that raises (its traceback), a worker process that dies (its exit code),
a call that outlives its timeout. Ctrl-C and any other exception in the caller
end it too. Ending kills every worker process and waits for it, closes the
segment (its memory goes with the last descriptor) and forgets rank 0's state;
a closed session refuses calls. Calls of disco runs and sessions in one process
do not overlap (the lock of :mod:`tvm_distx.runtime.disco`), because while one
runs the collectives of this process are those of its segment.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import pickle
import socket
import sys
import time
import uuid

import numpy as np
import tvm_ffi

from tvm_distx.errors import LaunchError
from tvm_distx.runtime import disco_worker
from tvm_distx.runtime.disco import (_GRACE, _LOCK, _POOL, _SLOT_BYTES, ENTRYPOINT, _error,
                                     _Pool, _segment, _shutdown)
from tvm_distx.runtime.disco_shm import RUNNING, Layout, ShmComm
from tvm_distx.runtime.session_base import Call, RankProcess, Session
from tvm_distx.runtime.session_worker import assemble_reply

__all__ = ["DiscoSession"]

logger = logging.getLogger(__name__)

_INPUT_BYTES = 1 << 20  # the input area to start with; grown on demand
_MAX_SLEEP = 2e-3  # seconds between two looks at the ranks' status, at most
_ABANDONED: list = []  # sessions whose rank 0 thread never returned (never destroyed)


class DiscoSession(Session):
    """A bundle's ranks as disco worker processes on this host, started once.

    Parameters
    ----------
    bundle : path
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
    tvm_distx.runtime.session_base.Session : :meth:`run`, :meth:`close` and the
        attributes every session has.
    """

    backend = "disco"

    def __init__(self, bundle, *, num_ranks: int | None = None,
                 timeout: float = 300.0) -> None:
        super().__init__(bundle, num_ranks=num_ranks, timeout=timeout)
        world = self.manifest.num_ranks
        self._id = uuid.uuid4().hex
        self._layout = Layout(world, _SLOT_BYTES, _INPUT_BYTES)
        self._fd = _segment(self._layout.size)
        self._pool = _Pool(self._fd)
        self._buf: mmap.mmap | None = None
        self._sess = self._open = self._call_rank = None
        self._dispatched = 0  # calls sent to rank 0 (a thread of this process)
        self._closed = False
        started = time.monotonic()
        try:
            self._buf = mmap.mmap(self._fd, self._layout.size)
            with _LOCK:
                api = disco_worker.repair_disco()
                tvm_ffi.register_global_func(_POOL, self._pool.factory, override=True)
                self._sess = api.SessionProcess(world, 1, _POOL, ENTRYPOINT)
                self._open = self._sess.get_global_func(disco_worker.OPEN)
                self._call_rank = self._sess.get_global_func(disco_worker.CALL)
                self._dispatch(self._open, {"bundle": str(self.manifest.root.resolve())},
                               [b""] * world, timeout, "starting")
            host = socket.gethostname()
            self.ranks = (RankProcess((0, os.getpid(), host)),) + tuple(
                RankProcess((w, self._pool.procs[w].pid, host)) for w in range(1, world))
        except BaseException:
            self._shut(failed=True)
            raise
        logger.info("disco session: %d ranks ready in %.2f s", world,
                    time.monotonic() - started)

    # -- calls
    def _call(self, call: Call, timeout: float):
        manifest = self.manifest
        signature = manifest.function(call.function)
        if signature.symbolic:
            signature = signature.specialize(call.sizes)
        blobs = []
        for rank in range(manifest.num_ranks):  # each rank gets only its shards
            shards = {spec.name: signature.rank_input(spec, call.values[spec.name], rank)
                      for spec in signature.params
                      if spec.name in call.values and spec.held_by(rank)}
            blobs.append(pickle.dumps((call.function, shards, call.sizes, call.state,
                                       call.keep), protocol=pickle.HIGHEST_PROTOCOL))
        with _LOCK:
            replies = self._dispatch(self._call_rank, {}, blobs, timeout,
                                     f"running '{call.function}'")
        result = assemble_reply(manifest, call.function, call.sizes, call.keep,
                                {r: blocks for r, (blocks, _) in replies.items()})
        return result, {r: n for r, (_, n) in replies.items()}

    def _dispatch(self, func, fields: dict, blobs: list[bytes], timeout: float, doing: str):
        """Run one disco call on every rank over the segment; rank 0's results, if any."""
        self._check_workers(doing)
        starts = np.cumsum([0] + [len(b) for b in blobs]).tolist()
        if starts[-1] > self._layout.input_bytes:
            self._grow(starts[-1])
        layout, buf = self._layout, self._buf
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
                func(json.dumps({**fields, "session": self._id, "job": job, "fd": self._fd,
                                 "layout": vars(layout), "deadline": deadline,
                                 "inputs": [[s, len(b)] for b, s in zip(blobs, starts)]}))
            except Exception as err:  # disco could not reach a worker: which one?
                self._check_workers(doing)
                raise LaunchError(f"the disco session failed {doing}: {err}",
                                  hint="the session is closed; open a new one") from err
            self._wait(view, deadline + _GRACE)
            error = self._failure(view, doing, timeout)
            if error is not None:
                raise error
            return disco_worker.RESULTS.pop(job, {})
        finally:
            if (view.status == RUNNING).any():
                view.abort()  # wake every wait: the session is ending
            disco_worker.RESULTS.pop(job, None)
            del view

    def _wait(self, view: ShmComm, until: float) -> None:
        """Wait until every rank has a final status; a dead worker process counts as failed."""
        delay = 2e-5
        while (view.status == RUNNING).any() and time.time() < until:
            for rank, code in self._pool.exited().items():
                if view.status[rank] == RUNNING:
                    view.fail(f"the worker process exited with code {code}", rank)
            time.sleep(delay)
            delay = min(2 * delay, _MAX_SLEEP)

    def _failure(self, view: ShmComm, doing: str, timeout: float) -> LaunchError | None:
        """The error naming the rank that ended the call, if one did (see ``disco._error``)."""
        error = _error(view, timeout)
        if error is None:
            return None
        rank, hint = error.rank, "the session is closed; open a new one"
        code = self._pool.exited().get(rank)
        if code is not None:
            return LaunchError(f"rank {rank} died {doing}: its worker process exited with code "
                               f"{code}", rank=rank, reason="killed" if code < 0 else "exited",
                               hint=hint)
        trace = error.details.split("\n", 1)[-1].strip()
        late = [r for r, s in enumerate(view.status.tolist()) if s == RUNNING]
        if error.reason == "timeout" or late:
            # the rank that never reported, not the one that gave up waiting for it
            rank = late[0] if late else rank
            return LaunchError(f"rank {rank} did not finish {doing} within {timeout} s",
                               rank=rank, reason="timeout", details=error.details,
                               hint="the session is closed; raise timeout=, or look for a rank "
                               "that never reached a collective the others wait in")
        summary = trace.splitlines()[-1] if trace else "unknown error"
        return LaunchError(f"rank {rank} failed {doing}: {summary}", rank=rank, reason="raised",
                           details=error.details, hint=hint)

    def _check_workers(self, doing: str) -> None:
        exited = self._pool.exited()
        if exited:
            rank, code = min(exited.items())
            raise LaunchError(f"rank {rank} died {doing}: its worker process exited with "
                              f"code {code}", rank=rank, reason="killed" if code < 0 else
                              "exited", hint="the session is closed; open a new one")

    def _grow(self, need: int) -> None:
        """A larger input area: the workers map the segment anew on every call."""
        layout = Layout(self._layout.world, self._layout.slot_bytes,
                        max(need, 2 * self._layout.input_bytes))
        os.ftruncate(self._fd, layout.size)
        old, self._buf = self._buf, mmap.mmap(self._fd, layout.size)
        self._layout = layout
        try:
            old.close()
        except BufferError:  # a view is still alive somewhere; the GC unmaps it
            pass

    # -- life cycle
    def _stop(self, failed: bool) -> None:
        pool = self._pool
        idle = self._worker0_idle(_GRACE)
        pool.kill([w for w, p in pool.procs.items() if p.poll() is not None or failed
                   or not idle])
        if self._sess is not None:
            _shutdown(self._sess, pool)
            sess, self._sess, self._open, self._call_rank = self._sess, None, None, None
            if idle or self._worker0_idle(_GRACE):
                del sess  # joins worker 0's thread: it must not be running Python then
            else:  # dropping it now would deadlock: the join holds the GIL worker 0 needs
                logger.warning("disco session: rank 0 is still running a call; its thread "
                               "is left behind (the worker processes are stopped)")
                _ABANDONED.append(sess)
        pool.reap(_GRACE)
        pool.close()
        disco_worker.forget(self._id)
        if self._buf is not None:
            try:
                self._buf.close()
            except BufferError:  # a traceback holds a view; the GC unmaps it
                pass
            self._buf = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _worker0_idle(self, timeout: float) -> bool:
        """Wait until rank 0's thread has returned from every call sent to it."""
        until = time.monotonic() + timeout
        while True:
            thread = disco_worker.THREADS.get(self._id)
            done = disco_worker.FINISHED.get(self._id, 0) >= self._dispatched
            if done and (thread is None or thread not in sys._current_frames()):
                return True
            if time.monotonic() > until:
                return False
            time.sleep(1e-3)
