"""One rank running many compiled random programs: ``run_random.py FOLDER``.

Used by ``tests/test_random_programs.py`` to run a whole batch of programs in
one ``mpiexec`` launch. ``FOLDER/programs.json`` lists ``{"name", "library",
"entries"}`` (``entries``: the function each rank calls, or null). Rank ``r``
reads program ``name``'s arguments from ``FOLDER/<name>.rank<r>.in.npz``
(``arg0``, ``arg1``, ...), runs its entry, and writes every result tensor to
``FOLDER/<name>.rank<r>.out.npz`` (``out0``, ``out1``, ...); the test puts the
global results together and compares them with numpy.

Before each program every rank writes ``START <name>`` to its log line on
stdout, so a crash names the program. Any error aborts the whole job.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import numpy as np

os.environ.setdefault("TVM_NUM_THREADS", "1")  # ranks oversubscribe the cores

import tvm  # noqa: E402
from mpi4py import MPI  # noqa: E402
from tvm import relax  # noqa: E402

from tvm_distx.runtime import mpi_ccl  # noqa: E402

COMM = MPI.COMM_WORLD
RANK = COMM.Get_rank()


def main(folder: Path) -> None:
    """Run every program of ``folder`` on this rank."""
    mpi_ccl.install(COMM)  # before any VM exists: a VM resolves its functions once
    programs = json.loads((folder / "programs.json").read_text())
    for program in programs:
        name, entry = program["name"], program["entries"][RANK]
        if RANK == 0:
            print(f"START {name}", flush=True)
        if entry is None:
            continue
        vm = relax.VirtualMachine(tvm.runtime.load_module(str(folder / program["library"])),
                                  tvm.cpu())
        inputs = np.load(folder / f"{name}.rank{RANK}.in.npz")
        args = [tvm.runtime.tensor(inputs[f"arg{i}"]) for i in range(len(inputs.files))]
        result = vm[entry](*args)
        fields = [result] if hasattr(result, "numpy") else list(result)
        np.savez(folder / f"{name}.rank{RANK}.out.npz",
                 **{f"out{i}": f.numpy() for i, f in enumerate(fields)})
    COMM.Barrier()
    if RANK == 0:
        print(f"PROGRAMS DONE {len(programs)}", flush=True)


if __name__ == "__main__":
    try:
        main(Path(sys.argv[1]))
    except BaseException:  # a rank that dies mid-collective would leave the others waiting
        sys.stderr.write(f"rank {RANK} raised:\n{traceback.format_exc()}")
        sys.stderr.flush()
        COMM.Abort(2)
