"""One MPI rank of a session: ``python -m tvm_distx.runtime.mpi_rank BUNDLE DIR SOCKET``.

:class:`tvm_distx.runtime.mpi.MPISession` starts one per rank under
``mpiexec``, once; a one-shot run is a session called once. Rank ``r`` (its
rank in ``MPI.COMM_WORLD``) is device ``r``. It:

1. writes ``<pid> <host>`` to ``DIR/rank<r>/pid`` and its progress to
   ``DIR/rank<r>/status`` (``started``, ``ready``, ``running <function>``,
   ``done``);
2. reads and checks the bundle's manifest, the world size and its own weight
   files (never another rank's), installs the MPI collectives
   (:func:`tvm_distx.runtime.mpi_ccl.install`) and creates its virtual machine
   once;
3. rank 0 connects to the driver's socket and says ``ready`` with every rank's
   ``(rank, pid, host)``;
4. serves calls until ``close``: rank 0 receives one message per rank (this
   rank's shards, see :class:`tvm_distx.runtime.ranks.RankState`) and scatters
   them; every rank runs its entry, with its stored weights loaded from the
   bundle the first time a function needs them and kept; rank 0 gathers the
   result blocks and sends them to the driver.

Every collective a rank enters is counted in ``DIR/rank<r>/progress`` (a
memory-mapped counter, reset at each call), so that after a timeout the driver
can name the rank that never reached the collective its peers wait in. A rank
that fails writes its traceback to ``DIR/rank<r>/error.txt`` and aborts the
job (``MPI.COMM_WORLD.Abort``), so no rank waits forever for it. Messages are
length-prefixed pickles on a Unix socket that only the driver's user can reach
(the session directory is private).

Fault injection for tests (:data:`tvm_distx.runtime.ranks.FAULT_ENV`):
``raise`` at the start of each call, ``kill`` (SIGKILL) and ``hang`` (sleeps
forever) in the rank's first collective.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

from tvm_distx import ccl
from tvm_distx.bundle.manifest import check_weights, read_manifest
from tvm_distx.errors import BundleError
from tvm_distx.runtime import mpi_ccl
from tvm_distx.runtime.mpi import receive_message, send_message
from tvm_distx.runtime.ranks import RankState, fault, inject_fault

__all__ = ["serve", "threads_per_rank", "main"]

def _status(folder: Path, text: str) -> None:
    (folder / "status").write_text(text + "\n")


def threads_per_rank(comm) -> None:
    """Share this host's cores between its ranks (TVM's pool reads TVM_NUM_THREADS once)."""
    from mpi4py import MPI

    if "TVM_NUM_THREADS" in os.environ:
        return
    local = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_size()
    os.environ["TVM_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // local))


def _count_collectives(folder: Path, kind: str | None) -> np.memmap:
    """Wrap every collective to count the calls this rank has made, in ``progress``.

    The count lives in a memory-mapped file, so the driver can read it after a
    timeout. With a ``kill`` or ``hang`` fault (test hook), the first call dies
    or hangs before it counts.
    """
    counter = np.memmap(folder / "progress", dtype=np.int64, mode="w+", shape=(1,))

    def wrap(original):
        def call(*args):
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            while kind == "hang":
                time.sleep(1)
            counter[0] += 1
            return original(*args)

        return call

    disco = [ccl.DISCO_PREFIX + n for n in ccl.DISCO_BUILTINS if n != "worker_id"]
    for name in (*ccl.FUNCTIONS, *disco):  # ours, and TVM's builtins of TVM-lowered programs
        tvm_ffi.register_global_func(name, wrap(tvm.get_global_func(name)), override=True)
    return counter


def serve(bundle: Path, folder: Path, address: str) -> None:
    """Serve calls until the driver says ``close`` (see the module documentation)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    mine = folder / f"rank{rank}"
    mine.mkdir(parents=True, exist_ok=True)
    (mine / "pid").write_text(f"{os.getpid()} {socket.gethostname()}")
    _status(mine, "started")
    try:
        _serve(bundle, mine, address, comm, rank)
    except BaseException:  # any failure stops every rank, with the reason on disk
        text = traceback.format_exc()
        (mine / "error.txt").write_text(text)
        sys.stderr.write(f"[tvm_distx] rank {rank} failed:\n{text}")
        sys.stderr.flush()
        comm.Abort(1)


def _serve(bundle: Path, mine: Path, address: str, comm, rank: int) -> None:
    threads_per_rank(comm)
    manifest = read_manifest(bundle)
    if comm.Get_size() != manifest.num_ranks:
        raise BundleError(f"the bundle needs {manifest.num_ranks} ranks, the job has "
                          f"{comm.Get_size()}", hint=f"launch it with -n {manifest.num_ranks}")
    check_weights(manifest, [rank])
    kind = fault(rank)
    mpi_ccl.install(comm)  # before the VM exists: it resolves functions once
    counter = _count_collectives(mine, kind if kind in ("kill", "hang") else None)
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(manifest.library_path)), tvm.cpu())
    me = RankState(manifest, rank, vm)

    conn = None
    ranks = comm.gather((rank, os.getpid(), socket.gethostname()), root=0)
    _status(mine, "ready")
    if rank == 0:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(address)
        send_message(conn, ("ready", ranks))
    closing = [("close",)] * comm.Get_size()
    while True:
        messages = None
        if rank == 0:
            request = receive_message(conn)  # None: the driver went away
            messages = closing if request is None or request[0] == "close" else request[1]
        message = comm.scatter(messages, root=0)
        if message[0] == "close":
            break
        counter[0] = 0
        _status(mine, f"running {message[1]}")
        inject_fault(rank, ("raise",))
        reply = me.handle(message)
        _status(mine, "ready")
        replies = comm.gather(reply, root=0)
        if rank == 0:
            send_message(conn, ("ok", replies))
    _status(mine, "done")
    if conn is not None:
        conn.close()


def main(argv: list[str] | None = None) -> None:
    """Parse the command line and serve this rank."""
    parser = argparse.ArgumentParser(prog="python -m tvm_distx.runtime.mpi_rank",
                                     description="One rank of a tvm-distx session (started "
                                     "by MPISession under mpiexec).")
    parser.add_argument("bundle", type=Path)
    parser.add_argument("folder", type=Path)
    parser.add_argument("address")
    args = parser.parse_args(argv)
    serve(args.bundle, args.folder, args.address)


if __name__ == "__main__":
    main()
