"""The measurement each MPI rank runs for :func:`tvm_distx.autoshard.measure.measure_profile`.

``python -m tvm_distx.autoshard._probe OUT.json``: rank 0 times a float32
matmul (flops per second), a ping-pong of one byte with rank 1 (the start-up
of a message, half the round trip) and of 4 MiB (the bandwidth), and writes
the three numbers as JSON. Only numpy and mpi4py are used.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main(out: str) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    a = np.random.default_rng(rank).standard_normal((512, 512), dtype=np.float32)
    seconds = _best(lambda: a @ a, 5)
    flops = 2 * 512 ** 3 / seconds
    results = {}
    for size in (1, 4 << 20):
        buf = np.zeros(size, dtype=np.uint8)
        comm.Barrier()

        def ping_pong():
            if rank == 0:
                comm.Send(buf, dest=1)
                comm.Recv(buf, source=1)
            elif rank == 1:
                comm.Recv(buf, source=0)
                comm.Send(buf, dest=0)

        results[size] = _best(ping_pong, 20 if size == 1 else 5) / 2
    flops = comm.allreduce(flops, op=MPI.MIN)
    if rank == 0:
        latency = results[1]
        bandwidth = (4 << 20) / max(results[4 << 20] - latency, 1e-9)
        with open(out, "w", encoding="utf-8") as f:
            json.dump({"flops_per_s": flops, "bytes_per_s": bandwidth, "latency_s": latency}, f)


if __name__ == "__main__":
    main(sys.argv[1])
