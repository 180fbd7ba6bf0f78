"""The board backend: a rank plan run with numpy, ctypes and mpi4py, with no TVM.

A RISC-V board with Debian's python3-numpy and python3-mpi4py runs it from the bundle
(``./run.sh``, :mod:`~tvm_distx.runtime.board.commands`). It is one of the runtime's
backends (``backend="board"``, :mod:`tvm_distx.runtime.backends`): the same sessions, rank
loop and collectives as the MPI backend, with :mod:`~tvm_distx.runtime.board.executor`
running each rank's plan (:mod:`tvm_distx.compiler.board_plan` writes it from the VM's own
program) instead of TVM's VM.
"""
