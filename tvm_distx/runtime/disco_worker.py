"""The disco worker side of :func:`tvm_distx.runtime.disco.run_disco`.

Run as ``python -m tvm_distx.runtime.disco_worker <worker id> <workers> <groups>
<read fd> <write fd>`` by the process pool of :mod:`tvm_distx.runtime.disco`:
it repairs ``tvm.runtime.disco`` (whose first import fails quietly in the pinned
wheel), registers :func:`run_rank` and serves the controller's pipe.

Worker 0 is a thread of the controller process, so the controller imports this
module as well; there, rank 0 also leaves every rank's result in
:data:`RESULTS` for the controller to pick up.

The same workers serve a persistent session
(:class:`tvm_distx.runtime.disco_session.DiscoSession`): :func:`open_rank` runs
once per worker and keeps its :class:`~tvm_distx.runtime.session_worker.RankState`
(virtual machine, stored weights loaded once, resident values) in
:data:`SESSIONS`; :func:`call_rank` then runs each call over the same segment.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import pickle
import signal
import sys
import threading
import traceback
from typing import Sequence

import numpy as np
import tvm_ffi

from tvm_distx.runtime.disco_shm import DONE, Layout, ShmComm, install

__all__ = ["RUN", "OPEN", "CALL", "RESULTS", "SESSIONS", "repair_disco", "run_rank",
           "open_rank", "call_rank", "forget", "main"]

logger = logging.getLogger(__name__)

#: The global function every worker runs once per run.
RUN = "tvm_distx.disco.run"

#: The global functions of a persistent session: open it once, then one call per call.
OPEN = "tvm_distx.disco.session_open"
CALL = "tvm_distx.disco.session_call"

#: Results of finished runs in the controller process, by job id: one per rank.
RESULTS: dict[str, list] = {}

#: This process's rank of each open session, by session id
#: (:class:`~tvm_distx.runtime.session_worker.RankState`).
SESSIONS: dict[str, object] = {}
#: Per session id: this process's mapping of its segment, the thread that last ran one of
#: its calls, and how many calls this process has finished.
MAPPINGS: dict[str, mmap.mmap] = {}
THREADS: dict[str, int] = {}
FINISHED: dict[str, int] = {}


def repair_disco():
    """Import ``tvm.runtime.disco`` and fill in its FFI functions; returns its ``_ffi_api``.

    In the pinned wheel the import inside ``import tvm`` fails quietly and
    leaves ``tvm.runtime.disco._ffi_api`` empty (and not an attribute of its
    package).
    """
    import importlib

    import tvm  # noqa: F401  (the import that half-fails)

    importlib.import_module("tvm.runtime.disco")
    api = sys.modules["tvm.runtime.disco._ffi_api"]
    if not hasattr(api, "SessionProcess"):
        tvm_ffi.init_ffi_api("runtime.disco", api.__name__)
    return api


def _worker_id() -> int:
    value = tvm_ffi.get_global_func("runtime.disco.worker_id")()
    return int(value[0]) if hasattr(value, "__len__") else int(value)


@tvm_ffi.register_global_func(RUN, override=True)
def run_rank(manifest: str) -> int:
    """Run this worker's part of a job, reporting through the shared segment.

    It never raises: an exception escaping a disco worker kills its process,
    and on worker 0 the controller too. Errors go to the rank's status and
    error message in the segment instead.

    Parameters
    ----------
    manifest : str
        JSON: ``job`` (id), ``fd`` (the segment), ``layout`` (of
        :class:`~tvm_distx.runtime.disco_shm.Layout`), ``deadline``
        (``time.time()``), ``library``, ``entries`` and ``inputs`` (per rank,
        offset and length of its pickled arguments in the input area).

    Returns
    -------
    int
        0, or 1 when the segment could not even be mapped.
    """
    try:
        job = json.loads(manifest)
        layout = Layout(**job["layout"])
        buf = mmap.mmap(job["fd"], layout.size)
        comm = ShmComm(buf, layout, _worker_id(), job["deadline"])
    except BaseException:  # noqa: BLE001 - nothing may escape a disco worker
        logger.exception("a disco worker could not join its run")
        return 1
    try:
        install(comm)
        _run(job, comm)
    except BaseException:  # noqa: BLE001
        logger.exception("disco rank %d failed", comm.rank)
        comm.fail(traceback.format_exc())
    finally:
        install(None)
        del comm
        try:
            buf.close()
        except BufferError:  # a traceback still holds a view; the GC unmaps it
            pass
    return 0


def _run(job: dict, comm: ShmComm) -> None:
    """Run the rank's entry on its inputs, then hand every result to rank 0."""
    import tvm
    from tvm import relax

    rank, world = comm.rank, comm.layout.world
    _inject_fault(rank)
    try:
        offset, length = job["inputs"][rank]
        args = pickle.loads(comm.inputs[offset:offset + length])
        entry = job["entries"][rank]
        result = None
        if entry is not None:
            vm = relax.VirtualMachine(tvm.runtime.load_module(job["library"]), tvm.cpu())
            result = _to_numpy(vm[entry](*[tvm.runtime.tensor(a) for a in args]))
        blob = np.frombuffer(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
        everyone = tuple(range(world))
        posted = comm.meet("the gathering of results", everyone, blob,
                           everyone if rank == 0 else ())
    except BaseException:  # noqa: BLE001
        comm.fail(traceback.format_exc())
        return
    if rank == 0:
        RESULTS[job["job"]] = [pickle.loads(posted[d]) for d in everyone]
    comm.finish(DONE)


@tvm_ffi.register_global_func(OPEN, override=True)
def open_rank(message: str) -> int:
    """Join a persistent session: check the bundle, create this rank's virtual machine.

    Parameters
    ----------
    message : str
        JSON: ``session`` (id), ``bundle`` (its directory), and the segment
        fields of :func:`call_rank`.

    Returns
    -------
    int
        0, or 1 when the segment could not even be mapped (it never raises;
        see :func:`run_rank`).
    """
    return _in_segment(message, _open)


@tvm_ffi.register_global_func(CALL, override=True)
def call_rank(message: str) -> int:
    """Run one call of a persistent session on this rank; rank 0 gathers the results.

    Parameters
    ----------
    message : str
        JSON: ``session`` and ``job`` (ids), ``fd``, ``layout`` and
        ``deadline`` (as for :func:`run_rank`), and ``inputs``: per rank,
        offset and length of its pickled ``(function, shards, sizes, state,
        keep)`` in the input area.

    Returns
    -------
    int
        0, or 1 when the segment could not even be mapped.
    """
    return _in_segment(message, _call)


def _in_segment(message: str, work) -> int:
    """Run ``work(job, comm)`` over the session's segment with its collectives installed.

    The rank's mapping of the segment stays open between calls (a new one only
    when the segment has grown), and the final status is the last thing written:
    once every rank has one, the controller may end the session, and worker 0
    (a thread of the controller) must then have nothing left to do but return.
    """
    try:
        job = json.loads(message)
        session = job["session"]
        layout = Layout(**job["layout"])
        THREADS[session] = threading.get_ident()
        buf = _mapping(session, job["fd"], layout.size)
        comm = ShmComm(buf, layout, _worker_id(), job["deadline"])
    except BaseException:  # noqa: BLE001 - nothing may escape a disco worker
        logger.exception("a disco worker could not join its session")
        return 1
    failure = ""
    try:
        install(comm)  # before a virtual machine exists: it resolves functions once
        work(job, comm)
    except BaseException:  # noqa: BLE001
        # text only: a traceback kept by a log handler would keep the segment mapped
        failure = traceback.format_exc()
        logger.debug("disco rank %d failed:\n%s", comm.rank, failure)
    install(None)
    FINISHED[session] = FINISHED.get(session, 0) + 1
    if failure:
        comm.fail(failure)
    else:
        comm.finish(DONE)
    return 0


def _mapping(session: str, fd: int, size: int) -> mmap.mmap:
    """This rank's mapping of a session's segment, of ``size`` bytes (remapped when it grew)."""
    held = MAPPINGS.get(session)
    if held is None or len(held) != size:
        held = MAPPINGS[session] = mmap.mmap(fd, size)
    return held


def forget(session: str) -> None:
    """Drop what this process keeps of a session (its rank state and its mapping)."""
    SESSIONS.pop(session, None)
    THREADS.pop(session, None)
    FINISHED.pop(session, None)
    held = MAPPINGS.pop(session, None)
    if held is not None:
        try:
            held.close()
        except BufferError:  # a view is still alive somewhere; the GC unmaps it
            pass


def _open(job: dict, comm: ShmComm) -> None:
    import tvm
    from tvm import relax

    from tvm_distx.bundle.manifest import check_weights, read_manifest
    from tvm_distx.runtime.session_worker import RankState

    rank = comm.rank
    manifest = read_manifest(job["bundle"])
    check_weights(manifest, [rank])
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(manifest.library_path)), tvm.cpu())
    SESSIONS[job["session"]] = RankState(manifest, rank, vm)
    everyone = tuple(range(comm.layout.world))
    comm.meet("the opening of the session", everyone, None, ())


def _call(job: dict, comm: ShmComm) -> None:
    rank, world = comm.rank, comm.layout.world
    me = SESSIONS[job["session"]]
    _inject_fault(rank, ("kill", "raise", "hang"))
    offset, length = job["inputs"][rank]
    function, values, sizes, state, keep = pickle.loads(comm.inputs[offset:offset + length])
    blocks = me.call(function, values, sizes, state, keep, local=True)
    blob = np.frombuffer(pickle.dumps((blocks, len(me.loaded)),
                                      protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    everyone = tuple(range(world))
    posted = comm.meet("the gathering of results", everyone, blob,
                       everyone if rank == 0 else ())
    if rank == 0:
        RESULTS[job["job"]] = {d: pickle.loads(posted[d]) for d in everyone}


def _inject_fault(rank: int, kinds: tuple[str, ...] = ("kill",)) -> None:
    """The test hook of :mod:`tvm_distx.runtime.worker` (``TVM_DISTX_FAULT="<rank>:<kind>"``).

    A one-shot run takes only ``kill`` (a raising rank is tested with bad
    inputs); a session call takes ``kill``, ``raise`` and ``hang`` (sleeps past
    any deadline). Rank 0 is a thread of the controller: it may raise, but is
    never killed nor hung.
    """
    import time

    from tvm_distx.runtime.worker import FAULT_ENV

    where, _, kind = os.environ.get(FAULT_ENV, "").partition(":")
    if kind not in kinds or where.strip() != str(rank):
        return
    if kind == "raise":
        raise RuntimeError(f"injected fault on rank {rank} ({FAULT_ENV})")
    if rank != 0 and kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if rank != 0 and kind == "hang":
        time.sleep(3600)


def _to_numpy(value):
    if value is None:
        return None
    if hasattr(value, "numpy"):
        return value.numpy()
    return tuple(_to_numpy(v) for v in value)


def main(argv: Sequence[str] | None = None) -> None:
    """Serve a disco controller: ``<worker id> <workers> <groups> <read fd> <write fd>``."""
    worker_id, workers, groups, reader, writer = (int(a) for a in (argv or sys.argv[1:]))
    repair_disco()
    try:
        tvm_ffi.get_global_func("runtime.disco.WorkerProcess")(worker_id, workers, groups,
                                                                reader, writer)
    except Exception:  # noqa: BLE001 - the controller went away
        logger.debug("disco worker %d: the controller went away", worker_id, exc_info=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
