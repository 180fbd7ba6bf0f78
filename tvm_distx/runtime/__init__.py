"""Running rank programs: sessions of a bundle on a backend, and the ranks' collectives.

- :mod:`~tvm_distx.runtime.backends`: the one list of backends, :func:`open_session`
  and :func:`launch` (a session called once);
- :mod:`~tvm_distx.runtime.base`: what every session's driver shares
  (:class:`~tvm_distx.runtime.base.Session`); :mod:`~tvm_distx.runtime.ranks`: what
  every rank shares (:class:`~tvm_distx.runtime.ranks.RankState`);
- one module per backend: :mod:`~tvm_distx.runtime.mpi` (ranks as MPI processes,
  each running :mod:`~tvm_distx.runtime.mpi_rank`, collectives in
  :mod:`~tvm_distx.runtime.mpi_ccl`), :mod:`~tvm_distx.runtime.disco` (disco worker
  processes on this host running :mod:`~tvm_distx.runtime.disco_rank`, collectives
  in :mod:`~tvm_distx.runtime.disco_shm`), :mod:`~tvm_distx.runtime.emulated` (every
  rank a thread of this process; :func:`emulate`, the fast unit-test backend);
- :mod:`~tvm_distx.runtime.launcher`: the launchers of rank processes (MPICH's and Open
  MPI's ``mpiexec``): their command lines and their reports of a dead rank.

``emulate`` is loaded on first use (PEP 562): it imports TVM, which takes seconds,
and the command line and the rank processes import this package without it.
"""

import importlib

from tvm_distx.layout.arrays import assemble_array, shard_array

__all__ = ["emulate", "shard_array", "assemble_array"]


def __getattr__(name: str):
    if name == "emulate":
        value = importlib.import_module("tvm_distx.runtime.emulated").emulate
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
