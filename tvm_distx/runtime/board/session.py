"""The board backend: an MPI session whose ranks run the bundle's plan, with no TVM.

``backend="board"`` (:data:`tvm_distx.runtime.backends.BACKENDS`) is
:class:`~tvm_distx.runtime.mpi.MPISession` with one difference: each rank runs
:mod:`tvm_distx.runtime.board.rank`, which executes the bundle's rank plan
(``plan.json``, the program the virtual machine runs, as data) over the bundle's
library with numpy and ctypes. It takes the same options (hosts, hostfiles,
deployment) and gives the same results as ``backend="mpi"``; on this host it
is how the suite checks what a RISC-V board runs.
"""

from __future__ import annotations

from tvm_distx.runtime.board.program import read_plan
from tvm_distx.runtime.mpi import MPISession

__all__ = ["BoardSession"]


class BoardSession(MPISession):
    """An :class:`~tvm_distx.runtime.mpi.MPISession` whose ranks run the plan, not the VM."""

    backend = "board"
    rank_module = "tvm_distx.runtime.board.rank"

    def _check_bundle(self, manifest) -> None:
        read_plan(manifest)  # a bundle without a plan is refused before any rank starts
