"""One MPI rank of a distributed run: ``python -m tvm_distx.runtime.worker BUNDLE JOB``.

:mod:`tvm_distx.runtime.launcher` starts one worker per rank with ``mpiexec``.
Rank ``r`` (its rank in ``MPI.COMM_WORLD``) is device ``r``. It:

1. reads and checks the bundle's manifest, the world size, and its own weight
   files (never another rank's, never the full weights);
2. installs the MPI collectives (:func:`tvm_distx.runtime.mpi_ccl.install`)
   before it creates the virtual machine;
3. runs its entry of the function with its weights from the bundle and its
   input shards from ``JOB/rank<r>/in/<name>.npy`` (for a function lowered by
   TVM's ``LowerDistIR``, the ``"worker0"`` feed of
   :mod:`tvm_distx.bundle.signature`: rank 0 the global inputs, the other ranks
   placeholders of the same shapes);
4. writes the result blocks it is the first to hold to ``JOB/rank<r>/out<i>.npy``.

Its progress is in ``JOB/rank<r>/status`` (``started``, ``loaded``,
``running <entry>``, ``done``), its process id in ``pid``, and the number of
collectives it has entered in ``progress`` (a memory-mapped counter). On any error it writes the traceback to
``JOB/rank<r>/error.txt`` and aborts the whole job (``MPI.COMM_WORLD.Abort``),
so no rank waits forever for it.

Fault injection for tests: ``TVM_DISTX_FAULT="<rank>:<kind>"`` with kind
``raise`` (at start), ``kill`` (SIGKILL at its first collective) or ``hang``
(sleeps forever in its first collective).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

FAULT_ENV = "TVM_DISTX_FAULT"


def _status(folder: Path, text: str) -> None:
    (folder / "status").write_text(text + "\n")


def _fault(rank: int) -> str | None:
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return None
    where, _, kind = spec.partition(":")
    return kind if where.strip() == str(rank) else None


def _count_collectives(folder: Path, fault: str | None) -> None:
    """Wrap every collective to count the calls this rank has made, in ``progress``.

    The count lives in a memory-mapped file, so the launcher can read it after
    a timeout: the rank that made fewer calls than its peers is the one that
    never reached the collective the others wait in. With a ``kill`` or
    ``hang`` fault (test hook), the first call dies or hangs before it counts.
    """
    import tvm
    import tvm_ffi

    from tvm_distx import ccl

    counter = np.memmap(folder / "progress", dtype=np.int64, mode="w+", shape=(1,))

    def wrap(original):
        def call(*args):
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            while fault == "hang":
                time.sleep(1)
            counter[0] += 1
            return original(*args)

        return call

    disco = [ccl.DISCO_PREFIX + n for n in ccl.DISCO_BUILTINS if n != "worker_id"]
    for name in (*ccl.FUNCTIONS, *disco):  # ours, and TVM's builtins of TVM-lowered programs
        tvm_ffi.register_global_func(name, wrap(tvm.get_global_func(name)), override=True)


def _threads_per_rank(comm) -> None:
    """Share this host's cores between its ranks (TVM's pool reads TVM_NUM_THREADS once)."""
    from mpi4py import MPI

    if "TVM_NUM_THREADS" in os.environ:
        return
    local = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_size()
    os.environ["TVM_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // local))


def run(bundle: Path, job: Path, function: str) -> None:
    """Run this process's rank of ``function`` (see the module documentation)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    folder = job / f"rank{rank}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pid").write_text(f"{os.getpid()} {socket.gethostname()}")
    _status(folder, "started")
    try:
        _run(bundle, folder, function, comm, rank)
    except BaseException:  # any failure stops every rank, with the reason on disk
        text = traceback.format_exc()
        (folder / "error.txt").write_text(text)
        sys.stderr.write(f"[tvm_distx] rank {rank} failed:\n{text}")
        sys.stderr.flush()
        comm.Abort(1)


def _run(bundle: Path, folder: Path, function: str, comm, rank: int) -> None:
    from tvm_distx.bundle.manifest import check_weights, read_manifest
    from tvm_distx.errors import BundleError
    from tvm_distx.layout.arrays import first_holder

    _threads_per_rank(comm)
    manifest = read_manifest(bundle)
    if comm.Get_size() != manifest.num_ranks:
        raise BundleError(f"the bundle needs {manifest.num_ranks} ranks, the job has "
                          f"{comm.Get_size()}", hint=f"launch it with -n {manifest.num_ranks}")
    signature = manifest.function(function)
    sizes_file = folder.parent / "sizes.json"  # the launcher's SIZES_FILE
    if signature.symbolic:
        signature = signature.specialize(json.loads(sizes_file.read_text()))
    check_weights(manifest, [rank])
    fault = _fault(rank)
    if fault == "raise":
        raise RuntimeError(f"injected fault on rank {rank} ({FAULT_ENV})")
    entry = manifest.entry(function, rank)

    import tvm
    from tvm import relax

    from tvm_distx.runtime import mpi_ccl

    mpi_ccl.install(comm)  # before the VM exists: it resolves functions once
    _count_collectives(folder, fault if fault in ("kill", "hang") else None)
    _status(folder, "loaded")
    if entry is not None:
        weights = set(manifest.weights.get(function, ()))
        args = []
        for spec in signature.params:
            if not spec.held_by(rank):
                continue
            if not signature.fed(spec, rank):  # TVM's feed: only rank 0's inputs are read
                value = signature.rank_input(spec, None, rank)
            elif spec.name in weights:
                value = manifest.read_weight(rank, spec.name)
            else:
                value = np.load(folder / "in" / f"{spec.name}.npy", allow_pickle=False)
            args.append(tvm.runtime.tensor(value))
        vm = relax.VirtualMachine(tvm.runtime.load_module(str(manifest.library_path)), tvm.cpu())
        _status(folder, f"running {entry}")
        out = vm[entry](*args)
        results = list(out) if signature.tuple_result else [out]
        held = [spec for spec in signature.results if spec.held_by(rank)]
        for index, spec in enumerate(signature.results):
            if spec.held_by(rank) and first_holder(spec.sharding, spec.shape, rank):
                np.save(folder / f"out{index}.npy", results[held.index(spec)].numpy())
    _status(folder, "done")


def main(argv: list[str] | None = None) -> None:
    """Parse the command line and run this rank."""
    parser = argparse.ArgumentParser(prog="python -m tvm_distx.runtime.worker",
                                     description="One rank of a tvm-distx run (started by "
                                     "the launcher under mpiexec).")
    parser.add_argument("bundle", type=Path)
    parser.add_argument("job", type=Path)
    parser.add_argument("--function", default="main")
    args = parser.parse_args(argv)
    run(args.bundle, args.job, args.function)


if __name__ == "__main__":
    main()
