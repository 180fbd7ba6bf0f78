"""One rank of a board session: ``python -m tvm_distx.runtime.board.rank BUNDLE DRIVER TAG``.

The same rank as :mod:`tvm_distx.runtime.mpi_rank` (the same connection to the
driver, the same checks, calls and faults), whose program is the bundle's rank
plan run with numpy and ctypes (:class:`~tvm_distx.runtime.board.program.PlanProgram`)
instead of TVM's virtual machine. The collectives are the MPI ones
(:class:`~tvm_distx.runtime.mpi_ccl.MpiCollectives`) called directly on numpy
arrays. Nothing this process imports loads TVM, so it runs where TVM does not
exist: a RISC-V board with Debian's python3-numpy and python3-mpi4py.
"""

from __future__ import annotations

from typing import Callable

from tvm_distx import ccl
from tvm_distx.runtime.board._builtins import aligned_empty
from tvm_distx.runtime.board.program import RUNTIME_LIBRARY, PlanProgram, read_plan
from tvm_distx.runtime import mpi_rank
from tvm_distx.runtime.collectives import abi_functions
from tvm_distx.runtime.mpi_ccl import MpiCollectives

__all__ = ["plan_program", "main"]


def plan_program(manifest, comm, count: Callable) -> PlanProgram:
    """The bundle's rank plan over its library, every collective counted by ``count``."""
    functions = abi_functions(MpiCollectives(comm), builtins=ccl.DISCO_PREFIX,
                              empty=aligned_empty)
    runtime = manifest.root / RUNTIME_LIBRARY
    return PlanProgram(read_plan(manifest), manifest.library_path,
                       {name: count(f) for name, f in functions.items()},
                       runtime if runtime.is_file() else None)


def main(argv: list[str] | None = None) -> None:
    """Parse the command line and serve this rank from the plan."""
    mpi_rank.main(argv, program=plan_program, prog="python -m tvm_distx.runtime.board.rank")


if __name__ == "__main__":
    main()
