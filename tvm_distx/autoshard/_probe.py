"""The measurement each MPI rank runs for :func:`tvm_distx.autoshard.measure.measure_cost_profile`.

``python -m tvm_distx.autoshard._probe OUT.json [KERNELS.so]``: every rank
runs the same measurements at the same time (so each sees the others' load,
as the ranks of a program do), each the median of several repeats (the
typical cost on this host as it is, not the best), and rank 0 writes the
slowest rank's numbers as JSON:

* with ``KERNELS.so`` (built by :func:`tvm_distx.autoshard.measure.build_kernels`,
  the kernels this package compiles): the arithmetic rate of a matmul kernel,
  the memory rate of an elementwise kernel and the time of a call to a kernel
  that does nearly nothing (the fixed cost of one kernel); without it, a
  numpy matmul and add stand in and the kernel cost is left out;
* the collectives of two ranks, as the runtime runs them (MPI through mpi4py,
  from Python): an all-gather of 4 MiB gives the bandwidth; the start-up of a
  message is what an all-gather of 4 bytes adds to a matmul kernel before it
  (at least the time of the all-gather alone), so it counts the wait for the
  other rank that a collective between kernels has on a loaded host.

Only numpy, mpi4py, TVM's runtime and the rank set-up of
:mod:`tvm_distx.runtime.mpi_rank` (the threads per rank) are used.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import tvm
from tvm import relax

from tvm_distx.runtime.mpi_rank import threads_per_rank

#: Kernel names and sizes shared with :func:`tvm_distx.autoshard.measure.build_kernels`.
MATMUL = (256, 256, 1024)  # (m, k, n): x (m, k) times a weight (n, k) transposed
ELEMENTWISE = (1024, 1024)
BIG = 4 << 20


def _typical(fn, repeat: int, burst: int = 1, comm=None) -> float:
    """Seconds of one call of ``fn``: the median over ``repeat`` bursts of ``burst`` calls.

    The median, not the best: a program's kernels and collectives run while the
    host does whatever else it does, and on a loaded host a collective waits
    for the other rank to be scheduled. The best call would describe an idle
    host only. The ranks start each burst together (``comm``).
    """
    times = []
    for _ in range(repeat):
        if comm is not None:
            comm.Barrier()
        start = time.perf_counter()
        for _ in range(burst):
            fn()
        times.append((time.perf_counter() - start) / burst)
    return float(np.median(times))


def _kernels(path: str) -> dict:

    vm = relax.VirtualMachine(tvm.runtime.load_module(path), tvm.cpu())
    rng = np.random.default_rng(0)
    m, k, n = MATMUL
    x = tvm.runtime.tensor(rng.standard_normal((m, k), dtype=np.float32))
    w = tvm.runtime.tensor(rng.standard_normal((n, k), dtype=np.float32))
    a = tvm.runtime.tensor(rng.standard_normal(ELEMENTWISE, dtype=np.float32))
    one = tvm.runtime.tensor(np.ones((1,), dtype=np.float32))
    mm, add, tiny = vm["matmul"], vm["add"], vm["tiny"]
    for fn, args in ((mm, (x, w)), (add, (a, a)), (tiny, (one, one))):
        fn(*args)  # first call: allocation
    # bursts of some 20 ms and more: long enough to meet the host's other work
    call = _typical(lambda: tiny(one, one), 11, 500)
    matmul = _typical(lambda: mm(x, w), 11, 20)
    elementwise = _typical(lambda: add(a, a), 11, 20)
    found = {"flops_per_s": 2 * m * k * n / max(matmul - call, 1e-9),
            "memory_bytes_per_s": 3 * 4 * int(np.prod(ELEMENTWISE)) / max(elementwise - call,
                                                                          1e-9),
            "kernel_s": call}
    found["work"] = lambda: mm(x, w)
    return found


def _numpy() -> dict:
    m, k, n = MATMUL
    rng = np.random.default_rng(0)
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((n, k), dtype=np.float32)
    a = rng.standard_normal(ELEMENTWISE, dtype=np.float32)
    out = np.empty_like(a)
    matmul = _typical(lambda: x @ w.T, 11, 20)
    elementwise = _typical(lambda: np.add(a, a, out=out), 11, 20)
    return {"flops_per_s": 2 * m * k * n / matmul,
            "memory_bytes_per_s": 3 * a.nbytes / elementwise, "work": lambda: x @ w.T}


def main(out: str, kernels: str | None = None) -> None:
    from mpi4py import MPI


    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    threads_per_rank(comm)  # the threads a rank of a program has, before TVM starts
    found = _kernels(kernels) if kernels else _numpy()
    small = np.zeros(1, dtype=np.float32)
    small_all = np.zeros(comm.Get_size(), dtype=np.float32)
    big = np.zeros(BIG // 4 // comm.Get_size(), dtype=np.float32)
    big_all = np.zeros(big.size * comm.Get_size(), dtype=np.float32)
    work = found.pop("work")
    start = _typical(lambda: comm.Allgather(small, small_all), 11, 20, comm)
    whole = _typical(lambda: comm.Allgather(big, big_all), 11, 4, comm)
    # between kernels, as in a program: a rank that reaches the collective first waits
    # for the other, which on a loaded host may not be running
    alone = _typical(work, 11, 20, comm)
    synced = _typical(lambda: (work(), comm.Allgather(small, small_all)), 11, 20, comm)
    received = big.nbytes * (comm.Get_size() - 1)
    found["latency_s"] = max(start, synced - alone) / (comm.Get_size() - 1)  # p - 1 messages
    found["bytes_per_s"] = received / max(whole - start, whole / 2)
    slowest = {}
    for key, value in sorted(found.items()):  # the slowest rank sets the pace
        op = MPI.MAX if key in ("latency_s", "kernel_s") else MPI.MIN
        slowest[key] = comm.allreduce(value, op=op)
    if rank == 0:
        with open(out, "w", encoding="utf-8") as f:
            json.dump(slowest, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
