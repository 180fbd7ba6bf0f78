"""The disco worker side of :mod:`tvm_distx.runtime.disco`: one rank of a disco session.

Run as ``python -m tvm_distx.runtime.disco_rank <worker id> <workers> <groups>
<read fd> <write fd>`` by the process pool of :mod:`tvm_distx.runtime.disco`:
it repairs ``tvm.runtime.disco`` (whose first import fails quietly in the pinned
wheel), registers :func:`open_rank` and :func:`call_rank` and serves the
controller's pipe. Worker 0 is a thread of the controller process, so the
controller imports this module as well; there, rank 0 also leaves every rank's
replies in :data:`RESULTS` for the controller to pick up.

:func:`open_rank` runs once per worker and keeps its
:class:`~tvm_distx.runtime.ranks.RankState` (virtual machine, stored weights
loaded once, resident values) in :data:`SESSIONS`; :func:`call_rank` then hands
it each message of a call over the same shared-memory segment
(:mod:`tvm_distx.runtime.disco_shm`). A session of a bundle and a run of
compiled rank programs without one (:func:`tvm_distx.runtime.disco.run_disco`)
are the same two calls.

Fault injection for tests (:data:`tvm_distx.runtime.ranks.FAULT_ENV`): ``kill``,
``raise`` and ``hang`` at the start of a call. Rank 0 is a thread of the
controller: it may raise, but is never killed nor hung.
"""

from __future__ import annotations

import importlib
import json
import logging
import mmap
import pickle
import sys
import threading
import traceback
from typing import Sequence

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

from tvm_distx.bundle.manifest import check_weights, read_manifest
from tvm_distx.runtime.disco_shm import DONE, Layout, ShmComm, install
from tvm_distx.runtime.ranks import RankState, VMProgram, inject_fault

__all__ = ["OPEN", "CALL", "RESULTS", "SESSIONS", "repair_disco", "open_rank", "call_rank",
           "forget", "main"]

logger = logging.getLogger(__name__)

#: The global functions of a session: open it once, then one per call.
OPEN = "tvm_distx.disco.session_open"
CALL = "tvm_distx.disco.session_call"

#: Replies of finished calls in the controller process, by job id: per rank.
RESULTS: dict[str, dict] = {}

#: This process's rank of each open session, by session id
#: (:class:`~tvm_distx.runtime.ranks.RankState`).
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
    importlib.import_module("tvm.runtime.disco")  # ``import tvm`` half-failed to import it
    api = sys.modules["tvm.runtime.disco._ffi_api"]
    if not hasattr(api, "SessionProcess"):
        tvm_ffi.init_ffi_api("runtime.disco", api.__name__)
    return api


def _worker_id() -> int:
    value = tvm_ffi.get_global_func("runtime.disco.worker_id")()
    return int(value[0]) if hasattr(value, "__len__") else int(value)


@tvm_ffi.register_global_func(OPEN, override=True)
def open_rank(message: str) -> int:
    """Join a session: check the bundle, create this rank's virtual machine.

    It never raises: an exception escaping a disco worker kills its process,
    and on worker 0 the controller too. Errors go to the rank's status and
    error message in the segment instead.

    Parameters
    ----------
    message : str
        JSON: ``session`` (id), ``bundle`` (its directory) or ``library`` (a
        library's path, for rank-local functions only), and the segment fields
        of :func:`call_rank`.

    Returns
    -------
    int
        0, or 1 when the segment could not even be mapped.
    """
    return _in_segment(message, _open)


@tvm_ffi.register_global_func(CALL, override=True)
def call_rank(message: str) -> int:
    """Run one call of a session on this rank; rank 0 gathers the replies.

    Parameters
    ----------
    message : str
        JSON: ``session`` and ``job`` (ids), ``fd`` (the segment), ``layout``
        (of :class:`~tvm_distx.runtime.disco_shm.Layout`), ``deadline``
        (``time.time()``), and ``inputs``: per rank, offset and length in the
        input area of its pickled message (of
        :meth:`tvm_distx.runtime.ranks.RankState.handle`).

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
    """This rank's state: of a bundle (``"bundle"``), or of a library alone (``"library"``)."""
    rank = comm.rank
    manifest = None
    if "bundle" in job:
        manifest = read_manifest(job["bundle"])
        check_weights(manifest, [rank])
        library = str(manifest.library_path)
    else:
        library = job["library"]
    vm = relax.VirtualMachine(tvm.runtime.load_module(library), tvm.cpu())
    SESSIONS[job["session"]] = RankState(manifest, rank, VMProgram(vm))
    everyone = tuple(range(comm.layout.world))
    comm.meet("the opening of the session", everyone, None, ())


def _call(job: dict, comm: ShmComm) -> None:
    """Hand this rank's message to its state; rank 0 gathers every rank's reply."""
    rank, world = comm.rank, comm.layout.world
    me = SESSIONS[job["session"]]
    inject_fault(rank, ("kill", "raise", "hang"), process=rank != 0)
    offset, length = job["inputs"][rank]
    reply = me.handle(pickle.loads(comm.inputs[offset:offset + length]))
    blob = np.frombuffer(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    everyone = tuple(range(world))
    posted = comm.meet("the gathering of results", everyone, blob,
                       everyone if rank == 0 else ())
    if rank == 0:
        RESULTS[job["job"]] = {d: pickle.loads(posted[d]) for d in everyone}


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
