"""Running rank programs.

- :func:`emulate`: every rank in a thread of one process, collectives over numpy
  (the fast unit-test backend);
- :mod:`tvm_distx.runtime.mpi_ccl` and :mod:`tvm_distx.runtime.worker`: ranks as
  MPI processes, launched by :mod:`tvm_distx.runtime.launcher`;
- :mod:`tvm_distx.runtime.disco`: ranks as disco worker processes on one host;
- sessions, whose ranks start once and serve many calls, on each of them:
  :mod:`~tvm_distx.runtime.session` (MPI), :mod:`~tvm_distx.runtime.disco_session`,
  :mod:`~tvm_distx.runtime.emulated_session`, over the shared
  :mod:`~tvm_distx.runtime.session_base` (driver) and
  :class:`~tvm_distx.runtime.session_worker.RankState` (rank).
"""

from tvm_distx.layout.arrays import assemble_array, shard_array
from tvm_distx.runtime.emulator import emulate

__all__ = ["emulate", "shard_array", "assemble_array"]
