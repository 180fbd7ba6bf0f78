"""One rank running compiled programs over the MPI collectives: ``run_programs.py FOLDER``.

``FOLDER/programs.json`` lists programs as ``{"name", "library", "entries"}``
(``entries``: the function each rank calls, or null). For program ``name``,
rank ``r`` reads its arguments from ``FOLDER/<name>.rank<r>.in.npz``
(``arg0``, ``arg1``, ...) and compares its result with
``FOLDER/<name>.rank<r>.want.npy`` when that file exists. Each rank loads the library with
``tvm.runtime.load_module`` and runs it in a ``relax.VirtualMachine`` created
after :func:`tvm_distx.runtime.mpi_ccl.install`.

Prints ``FAIL <name> rank <r>: ...`` on a mismatch and exits 1; rank 0 prints
``PROGRAMS OK <n>`` when every rank matched.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import numpy as np
import tvm
from mpi4py import MPI
from tvm import relax

from tvm_distx.runtime import mpi_ccl

COMM = MPI.COMM_WORLD
RANK = COMM.Get_rank()


def main(folder: Path) -> None:
    mpi_ccl.install(COMM)  # before any VM exists: a VM resolves its functions once
    programs = json.loads((folder / "programs.json").read_text())
    failures = 0
    for program in programs:
        name, entry = program["name"], program["entries"][RANK]
        if entry is None:
            continue
        vm = relax.VirtualMachine(tvm.runtime.load_module(str(folder / program["library"])),
                                  tvm.cpu())
        inputs = np.load(folder / f"{name}.rank{RANK}.in.npz")
        args = [tvm.runtime.tensor(inputs[f"arg{i}"]) for i in range(len(inputs.files))]
        result = vm[entry](*args)
        expected = folder / f"{name}.rank{RANK}.want.npy"
        if not expected.exists():  # e.g. a pipeline stage whose result is sent on
            continue
        got, want = result.numpy(), np.load(expected)
        if got.shape != want.shape or not np.allclose(got, want, rtol=1e-5, atol=1e-5):
            failures += 1
            error = np.max(np.abs(got - want)) if got.shape == want.shape else got.shape
            print(f"FAIL {name} rank {RANK}: {error}", flush=True)
    if COMM.allreduce(failures):
        sys.exit(1)
    if RANK == 0:
        print(f"PROGRAMS OK {len(programs)}", flush=True)


if __name__ == "__main__":
    try:
        main(Path(sys.argv[1]))
    except SystemExit:
        raise
    except BaseException:  # a rank that dies mid-collective would leave the others waiting
        sys.stderr.write(f"rank {RANK} raised:\n{traceback.format_exc()}")
        sys.stderr.flush()
        COMM.Abort(2)
