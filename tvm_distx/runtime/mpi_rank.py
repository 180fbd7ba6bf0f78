"""One MPI rank of a session: ``python -m tvm_distx.runtime.mpi_rank BUNDLE DRIVER TAG``.

:class:`tvm_distx.runtime.mpi.MPISession` starts one per rank under
``mpiexec``, once; a one-shot run is a session called once. Rank ``r`` (its
rank in ``MPI.COMM_WORLD``) is device ``r``. It may run on any host; ``BUNDLE``
is the bundle's path on that host, ``DRIVER`` the driver's ``host:port`` and
``TAG`` names the session (so that a clean-up on this host can find its
processes). It:

1. connects to the driver, proves it holds the session's key (from its
   environment) and says who it is; from then on it beats every second with
   what it is doing (:class:`tvm_distx.runtime.control.DriverLink`);
2. reads and checks the bundle's manifest, the world size and its own weight
   files (never another rank's), and makes its program once: TVM's virtual
   machine with the MPI collectives installed
   (:func:`tvm_distx.runtime.mpi_ccl.install`, :func:`vm_program`), or another
   maker's (the board's ranks, :mod:`tvm_distx.runtime.board.rank`, run the same loop
   with a program that needs no TVM);
3. rank 0 tells the driver ``ready`` with every rank's ``(rank, pid, host)``;
4. serves calls until ``close``: every rank receives its own message from the
   driver (its shards, see :class:`tvm_distx.runtime.ranks.RankState`), runs
   its entry, with its stored weights loaded from the bundle the first time a
   function needs them and kept, and sends its result blocks back. Between
   calls a rank waits on its connection, asleep: a rank spinning in an MPI
   collective would take a core from the driver and from rank 0 (on a host
   with as many cores as ranks, that costs about a millisecond per call).

Every collective a rank enters is counted and sent with its beats, so that
after a timeout the driver can name the rank that never reached the collective
its peers wait in. A rank that fails sends its traceback to the driver, writes
it to its stderr (which ``mpiexec`` forwards) and aborts the job
(``MPI.COMM_WORLD.Abort``), so no rank waits forever for it. A rank that hears
nothing from the driver for a while exits.

Fault injection for tests (:data:`tvm_distx.runtime.ranks.FAULT_ENV`):
``raise`` at the start of each call, ``kill`` (SIGKILL) and ``hang`` (sleeps
forever) in the rank's first collective.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

from tvm_distx import ccl
from tvm_distx.bundle.manifest import Manifest, check_weights, read_manifest
from tvm_distx.errors import BundleError
from tvm_distx.runtime import mpi_ccl
from tvm_distx.runtime.control import KEY_ENV, DriverLink
from tvm_distx.runtime.kernel_times import PROFILE_ENV, KernelTimes
from tvm_distx.runtime.ranks import (Program, RankState, VMProgram, fault, inject_fault,
                                     one_line)

__all__ = ["serve", "threads_per_rank", "counted", "vm_program", "main"]

logger = logging.getLogger(__name__)

#: ``maker(manifest, comm, count)`` gives the rank's program; ``count`` wraps each collective
#: function so that the driver hears how many this rank entered (see :func:`counted`).
ProgramMaker = Callable[[Manifest, object, Callable], Program]


def threads_per_rank(comm) -> None:
    """Share this host's cores between its ranks (TVM's pool reads TVM_NUM_THREADS once)."""
    from mpi4py import MPI

    if "TVM_NUM_THREADS" in os.environ:
        return
    local = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_size()
    os.environ["TVM_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // local))


def counted(link: DriverLink, kind: str | None) -> Callable[[Callable], Callable]:
    """A wrapper that counts the calls of a collective this rank makes in the current call.

    The count goes to the driver with each beat. With a ``kill`` or ``hang``
    fault (test hook), the first call dies or hangs before it counts.
    """

    def wrap(original):
        def call(*args):
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            while kind == "hang":
                time.sleep(1)
            link.collectives += 1
            return original(*args)

        return call

    return wrap


def vm_program(manifest: Manifest, comm, count: Callable) -> Program:
    """TVM's virtual machine over the bundle's library, the MPI collectives installed first.

    The VM resolves its functions once, so the collectives (counted by
    ``count``) are registered before it exists. With ``TVM_DISTX_PROFILE``
    set, every call it makes is timed (:mod:`tvm_distx.runtime.kernel_times`).
    """
    import tvm
    from tvm.runtime.vm import VirtualMachine  # the runtime's (tvm.relax needs the compiler)

    _load_runtime_extras(tvm)
    # ours, and TVM's builtins of TVM-lowered programs (worker_id is no collective)
    collectives = {*ccl.FUNCTIONS, *(ccl.DISCO_PREFIX + n for n in ccl.DISCO_BUILTINS
                                     if n != "worker_id")}
    mpi_ccl.install(comm, wrap=lambda name, func: count(func) if name in collectives else func)
    library = tvm.runtime.load_module(str(manifest.library_path))
    vm = VirtualMachine(library, tvm.cpu())
    folder = os.environ.get(PROFILE_ENV)
    if folder:  # every kernel and collective timed; the table written when the rank ends
        times = KernelTimes(comm.Get_rank())
        vm.set_instrument(times)
        atexit.register(times.write, folder)
    return VMProgram(vm)


def serve(bundle: Path, driver: str, program: ProgramMaker = vm_program) -> None:
    """Serve calls until the driver says ``close`` (see the module documentation)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, host = comm.Get_rank(), socket.gethostname()
    key = bytes.fromhex(os.environ.pop(KEY_ENV, ""))
    link = None
    try:
        link = DriverLink(driver, key, rank, os.getpid(), host,
                          on_lost=lambda why: _lost(rank, host, why))
        _serve(bundle, link, comm, rank, program)
    except BaseException as err:  # any failure stops every rank, with the reason told
        text = traceback.format_exc()
        summary = one_line(err)
        if link is not None:
            link.finish(("error", text, summary))
        sys.stderr.write(f"[tvm_distx] rank {rank} on {host}: {summary}\n{text}")
        sys.stderr.flush()
        comm.Abort(1)


def _lost(rank: int, host: str, why: str) -> None:
    """The driver is gone: end this rank (``mpiexec`` then ends the others)."""
    sys.stderr.write(f"[tvm_distx] rank {rank} on {host}: lost the driver ({why}); exiting\n")
    sys.stderr.flush()
    os._exit(75)


def _serve(bundle: Path, link: DriverLink, comm, rank: int, make: ProgramMaker) -> None:
    link.status = "loading"
    threads_per_rank(comm)
    manifest = read_manifest(bundle)
    if comm.Get_size() != manifest.num_ranks:
        raise BundleError(f"the bundle needs {manifest.num_ranks} ranks, the job has "
                          f"{comm.Get_size()}", hint=f"launch it with -n {manifest.num_ranks}")
    check_weights(manifest, [rank])
    kind = fault(rank)
    program = make(manifest, comm, counted(link, kind if kind in ("kill", "hang") else None))
    me = RankState(manifest, rank, program)

    ranks = comm.gather((rank, os.getpid(), socket.gethostname()), root=0)
    link.status = "ready"
    if rank == 0:
        link.send(("ready", ranks))
    while True:
        request = link.requests.get()
        if request[0] == "close":
            break
        message = request[1]
        link.collectives = 0
        link.status = f"running {message[1]}"
        inject_fault(rank, ("raise",))
        reply = me.handle(message)
        link.status = "ready"
        link.send(("ok", rank, reply))
    link.status = "done"
    link.finish(("done",))


def runtime_only_imports() -> None:
    """Make this process load TVM's runtime library alone, and never torch.

    A rank runs a built program; it never compiles. TVM's package loads its
    compiler library (about 250 MB) unless ``TVM_USE_RUNTIME_LIB=1``, and TVM's
    FFI imports torch whenever it is installed (about 200 MB more): together
    three quarters of a rank's memory before its weights, on every rank of a
    host. Call this before the first ``import tvm``; a ``TVM_USE_RUNTIME_LIB``
    the user set is kept.
    """
    os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")
    if "torch" not in sys.modules and "tvm" not in sys.modules:
        sys.modules["torch"] = None  # ``import torch`` raises ImportError, which TVM's FFI expects


def _load_runtime_extras(tvm) -> None:
    """Load TVM's runtime extras when its compiler library, which loads them, is not loaded.

    ``libtvm_runtime_extra`` holds run-time functions that kernels call by name
    (``tvm.contrib.sort.topk`` of a router's top-k, say).
    """
    from tvm import base, libinfo

    if "tvm_compiler" in base._LOADED_LIBS or "tvm_runtime_extra" in base._LOADED_LIBS:
        return
    try:
        base._LOADED_LIBS["tvm_runtime_extra"] = base.load_lib_ctypes(
            "tvm", "tvm_runtime_extra", "RTLD_GLOBAL",
            extra_lib_paths=libinfo.package_lib_paths())
    except (OSError, RuntimeError) as err:  # a TVM build without it: kernels name what they miss
        logger.debug("no TVM runtime extras: %s", err)


def main(argv: list[str] | None = None, program: ProgramMaker = vm_program,
         prog: str = "python -m tvm_distx.runtime.mpi_rank") -> None:
    """Parse the command line and serve this rank with ``program``'s maker."""
    runtime_only_imports()
    parser = argparse.ArgumentParser(prog=prog,
                                     description="One rank of a tvm-distx session (started "
                                     "by MPISession under mpiexec).")
    parser.add_argument("bundle", type=Path, help="the bundle's path on this host")
    parser.add_argument("driver", help="the driver's host:port")
    parser.add_argument("tag", help="the session's name")
    args = parser.parse_args(argv)
    serve(args.bundle, args.driver, program)


if __name__ == "__main__":
    main()
