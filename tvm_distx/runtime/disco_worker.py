"""The disco worker side of :func:`tvm_distx.runtime.disco.run_disco`.

Run as ``python -m tvm_distx.runtime.disco_worker <worker id> <workers> <groups>
<read fd> <write fd>`` by the process pool of :mod:`tvm_distx.runtime.disco`:
it repairs ``tvm.runtime.disco`` (whose first import fails quietly in the pinned
wheel), registers :func:`run_rank` and serves the controller's pipe.

Worker 0 is a thread of the controller process, so the controller imports this
module as well; there, rank 0 also leaves every rank's result in
:data:`RESULTS` for the controller to pick up.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import pickle
import signal
import sys
import traceback
from typing import Sequence

import numpy as np
import tvm_ffi

from tvm_distx.runtime.disco_shm import DONE, Layout, ShmComm, install

__all__ = ["RUN", "RESULTS", "repair_disco", "run_rank", "main"]

logger = logging.getLogger(__name__)

#: The global function every worker runs once per run.
RUN = "tvm_distx.disco.run"

#: Results of finished runs in the controller process, by job id: one per rank.
RESULTS: dict[str, list] = {}


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


def _inject_fault(rank: int) -> None:
    """The test hook of :mod:`tvm_distx.runtime.worker` (``TVM_DISTX_FAULT="<rank>:kill"``).

    Only ``kill`` applies to disco workers (a raising rank is tested with bad
    inputs); rank 0 is a thread of the controller and is never killed.
    """
    from tvm_distx.runtime.worker import FAULT_ENV

    where, _, kind = os.environ.get(FAULT_ENV, "").partition(":")
    if kind == "kill" and rank != 0 and where.strip() == str(rank):
        os.kill(os.getpid(), signal.SIGKILL)


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
