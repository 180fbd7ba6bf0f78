"""The board runtime (PROTOTYPE, issue 31): a rank plan run with numpy, ctypes and mpi4py.

Nothing here imports TVM: a RISC-V board with Debian's python3-numpy and python3-mpi4py runs
it from the bundle. :mod:`~tvm_distx.board.executor` runs one rank's plan
(:mod:`tvm_distx.build.board_plan` writes it from the VM's own program).
"""
