"""One tensor-parallel MLP forward: our 1 and 2 ranks, PyTorch DTensor on gloo, numpy.

The model is ``y = relu(x @ W1) @ W2`` with batch 64, hidden 2048, FFN 8192,
float32 (4.3 GFLOP and 128 MiB of weights per forward). Tensor parallel over 2
ranks, Megatron style: ``W1`` column split (``S[1]``), ``W2`` row split
(``S[0]``), ``x`` replicated, one all-reduce of the 512 KiB output.

Contenders, each timed inside its own processes (launch, imports, compilation
and loading are not timed):

* **ours, 2 ranks, MPI**: the annotated module compiled with
  :func:`tvm_distx.compile` (our CPU kernel schedules) and exported as a bundle
  with ``exe.export``; ``mpiexec -n 2`` (the ``mpich`` wheel's) runs this
  script's rank job, which reads the bundle as our worker does
  (:mod:`tvm_distx.runtime.mpi_rank`: its manifest, its weight shards, the MPI
  collectives installed before the VM), and times ``vm[entry](...)``. One TVM
  thread per rank (``TVM_NUM_THREADS=1``, what our worker picks with 2 ranks on
  2 cores).
* **ours, 1 rank**: the same model annotated on a 1-device mesh (so it is not
  split at all), compiled and bundled the same way, run by ``mpiexec -n 1``,
  with 1 TVM thread (the baseline of the speed-ups: one core per rank) and with
  2 threads (the whole machine).
* **DTensor, 2 ranks, gloo**: ``torch.nn.Sequential(Linear, ReLU, Linear)``
  without bias, parallelised with ``ColwiseParallel`` / ``RowwiseParallel`` on
  a ``(2,)`` CPU device mesh, ``torch.distributed`` on gloo over 127.0.0.1, one
  torch thread per rank, under ``torch.no_grad()``.
* **numpy, 1 process**: ``np.maximum(x @ W1, 0) @ W2``, with its BLAS on all
  cores and with one thread.

A sample is a few back-to-back forwards between barriers (the slowest rank
counts); every job takes a warm-up, then several samples, and reports their
median. Each round launches every contender once, in an order that rotates from
round to round; the table shows the median over rounds, and speed-ups as the
median of per-round ratios. Every contender's output is checked against numpy.

Usage::

    python scripts/bench/tp_mlp.py                 # 3 rounds
    python scripts/bench/tp_mlp.py --rounds 5 --samples 7
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (bundle_rank_call, child_env, end_rank_job, free_port, median,  # noqa: E402
                     run_job, spread, table, time_samples)

from tvm_distx.runtime.mpi import mpiexec_path  # noqa: E402
from tvm_distx.runtime.rank_env import rank_environment  # noqa: E402

import numpy as np  # noqa: E402

#: The model's size: batch, hidden, FFN (``--shape`` changes it, e.g. for the smoke test).
SHAPE = (64, 2048, 8192)
SCRIPT = str(Path(__file__).resolve())

#: (key, label, kind, ranks, threads per rank)
CONTENDERS = [
    ("ours1", "ours, 1 rank, 1 thread", "ours", 1, 1),
    ("ours1x2", "ours, 1 rank, 2 threads", "ours", 1, 2),
    ("ours2", "ours, 2 ranks over MPI (1 thread each)", "ours", 2, 1),
    ("dtensor", "DTensor, 2 ranks over gloo (1 thread each)", "torch", 2, 1),
    ("numpy", "numpy, 1 process, all cores", "numpy", 1, 0),
    ("numpy1", "numpy, 1 process, 1 thread", "numpy", 1, 1),
]


def flop(shape: tuple[int, int, int]) -> float:
    """Floating-point operations of one forward of the MLP of ``shape``."""
    batch, hidden, ffn = shape
    return 2.0 * 2 * batch * hidden * ffn


def model_script(ranks: int, shape: tuple[int, int, int]) -> str:
    """TVMScript of the MLP of ``shape`` (batch, hidden, FFN) on a ``(ranks,)`` mesh."""
    BATCH, HIDDEN, FFN = shape  # noqa: N806 - as in the text of the model
    return f'''from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class TPMLP:
    I.module_attrs({{"device_num": {ranks}}})
    I.module_global_infos({{"mesh": [R.dist.device_mesh(({ranks},), I.Range(0, {ranks}))]}})

    @R.function
    def main(x: R.Tensor(({BATCH}, {HIDDEN}), "float32"),
             w1: R.Tensor(({HIDDEN}, {FFN}), "float32"),
             w2: R.Tensor(({FFN}, {HIDDEN}), "float32"),
             ) -> R.Tensor(({BATCH}, {HIDDEN}), "float32"):
        with R.dataflow():
            h = R.matmul(x, w1)
            a = R.nn.relu(h)
            y = R.matmul(a, w2)
            R.output(y)
        return y
'''


def build_bundle(ranks: int, x: np.ndarray, w1: np.ndarray, w2: np.ndarray,
                 folder: Path) -> Path:
    """Compile the annotated MLP for ``ranks`` ranks and export its bundle."""
    import tvm_distx as td
    from tvm_distx import ShardingRule
    from tvm_distx.passes import AnnotateSharding

    source = folder / f"mlp_{ranks}.py"
    source.write_text(model_script(ranks, (*x.shape, w1.shape[1])))
    rules = [ShardingRule(param="w1", result="S[1]"), ShardingRule(param="w2", result="S[0]")]
    exe = td.compile(AnnotateSharding(rules)(td.load_module(source)), target="x86")
    bundle = folder / f"bundle_{ranks}"
    exe.export(bundle, params={"w1": w1, "w2": w2})
    return bundle


# ---------------------------------------------------------------------- inside the jobs
def ours_job(bundle: str, data: str, out: str, samples: int, calls: int) -> None:
    """A rank of ours: load the bundle like our MPI worker, then time ``vm[entry]``."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    func, args = bundle_rank_call(bundle, {"x": np.load(Path(data) / "x.npy")}, comm)
    error = float(np.abs(func(*args).numpy() - np.load(Path(data) / "y.npy")).max())
    times = time_samples(lambda: func(*args), comm.Barrier,
                         lambda t: comm.allreduce(t, op=MPI.MAX), samples, calls)
    if comm.Get_rank() == 0:
        Path(out).write_text(json.dumps({"times": times, "error": error}))


def torch_job(data: str, out: str, port: int, samples: int, calls: int) -> None:
    """A rank of DTensor tensor parallelism over gloo (rank and size from MPICH's PMI)."""
    import warnings

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    rank, world = int(os.environ["PMI_RANK"]), int(os.environ["PMI_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    hidden, ffn = np.load(Path(data) / "w1.npy", mmap_mode="r").shape
    net = torch.nn.Sequential(torch.nn.Linear(hidden, ffn, bias=False), torch.nn.ReLU(),
                              torch.nn.Linear(ffn, hidden, bias=False))
    with torch.no_grad():  # Linear keeps (out, in): y = x @ W.T
        net[0].weight.copy_(torch.from_numpy(np.load(Path(data) / "w1.npy")).T)
        net[2].weight.copy_(torch.from_numpy(np.load(Path(data) / "w2.npy")).T)
    net = parallelize_module(net, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.from_numpy(np.load(Path(data) / "x.npy"))

    def forward():
        with torch.no_grad():
            return net(x)

    error = float(np.abs(forward().numpy() - np.load(Path(data) / "y.npy")).max())

    def slowest(t: float) -> float:
        value = torch.tensor([t], dtype=torch.float64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return float(value[0])

    times = time_samples(forward, dist.barrier, slowest, samples, calls)
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "error": error}))


def numpy_job(data: str, out: str, samples: int, calls: int) -> None:
    """numpy in this process (its BLAS threads set by the environment)."""
    x, w1, w2 = (np.load(Path(data) / f"{n}.npy") for n in ("x", "w1", "w2"))
    h = np.empty((x.shape[0], w1.shape[1]), np.float32)
    y = np.empty(x.shape, np.float32)

    def forward():
        np.matmul(x, w1, out=h)
        np.maximum(h, 0, out=h)
        return np.matmul(h, w2, out=y)

    error = float(np.abs(forward() - np.load(Path(data) / "y.npy")).max())
    times = time_samples(forward, lambda: None, lambda t: t, samples, calls)
    Path(out).write_text(json.dumps({"times": times, "error": error}))


# ---------------------------------------------------------------------- the controller
def run_contender(key: str, kind: str, ranks: int, threads: int, folder: Path,
                  bundles: dict[int, Path], samples: int, calls: int, timeout: float) -> dict:
    """Launch one job of one contender; returns its samples and its error against numpy."""
    out = folder / f"{key}.json"
    out.unlink(missing_ok=True)
    common = ["--data", str(folder), "--out", str(out), "--samples", str(samples),
              "--calls", str(calls)]
    env = child_env(TVM_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads or 2))
    if kind == "ours":  # the environment our launcher gives ranks
        env = rank_environment(env)
        command = [mpiexec_path(), "-n", str(ranks), sys.executable, SCRIPT, "--ours-job",
                   str(bundles[ranks])] + common
    elif kind == "torch":
        command = [mpiexec_path(), "-n", str(ranks), sys.executable, SCRIPT, "--torch-job",
                   str(free_port())] + common
    else:
        command = [sys.executable, SCRIPT, "--numpy-job"] + common
        if threads:
            env.update(OPENBLAS_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        else:
            for name in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS"):
                env.pop(name, None)
    return run_job(key, command, env, out, timeout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="launches of every contender")
    parser.add_argument("--samples", type=int, default=5, help="samples per launch")
    parser.add_argument("--calls", type=int, default=4, help="forwards per sample")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    parser.add_argument("--shape", type=int, nargs=3, default=SHAPE,
                        metavar=("BATCH", "HIDDEN", "FFN"), help="the model's size")
    parser.add_argument("--json", help="also write the per-round times to this JSON file")
    parser.add_argument("--ours-job", metavar="BUNDLE", help=argparse.SUPPRESS)
    parser.add_argument("--torch-job", metavar="PORT", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--numpy-job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.ours_job:
        ours_job(opts.ours_job, opts.data, opts.out, opts.samples, opts.calls)
        return 0
    if opts.torch_job:
        torch_job(opts.data, opts.out, opts.torch_job, opts.samples, opts.calls)
        end_rank_job()
    if opts.numpy_job:
        numpy_job(opts.data, opts.out, opts.samples, opts.calls)
        return 0

    started = time.perf_counter()
    rng = np.random.default_rng(0)
    batch, hidden, ffn = opts.shape
    x = rng.standard_normal((batch, hidden), dtype=np.float32)
    w1 = (rng.standard_normal((hidden, ffn), dtype=np.float32) / np.sqrt(hidden)).astype(
        np.float32)
    w2 = (rng.standard_normal((ffn, hidden), dtype=np.float32) / np.sqrt(ffn)).astype(
        np.float32)
    y = (np.maximum(x.astype(np.float64) @ w1, 0) @ w2).astype(np.float32)
    with tempfile.TemporaryDirectory(prefix="tvm-distx-bench-") as tmp:
        folder = Path(tmp)
        for name, value in (("x", x), ("w1", w1), ("w2", w2), ("y", y)):
            np.save(folder / f"{name}.npy", value)
        bundles = {ranks: build_bundle(ranks, x, w1, w2, folder) for ranks in (1, 2)}
        times: dict[str, list[float]] = {key: [] for key, *_ in CONTENDERS}
        errors: dict[str, float] = {}
        for r in range(opts.rounds):
            order = CONTENDERS[r % len(CONTENDERS):] + CONTENDERS[:r % len(CONTENDERS)]
            for key, _, kind, ranks, threads in order:
                got = run_contender(key, kind, ranks, threads, folder, bundles, opts.samples,
                                    opts.calls, opts.timeout)
                times[key].append(median(got["times"]))
                errors[key] = max(errors.get(key, 0.0), got["error"])
                print(f"  round {r + 1}: {key} {times[key][-1] * 1e3:.1f} ms", file=sys.stderr,
                      flush=True)
    scale = float(np.abs(y).max())
    bad = {k: e for k, e in errors.items() if e > 1e-4 * scale + 1e-4}
    if bad:
        raise SystemExit(f"outputs differ from numpy: {bad}")

    base = times["ours1"]
    rows = []
    for key, label, *_ in CONTENDERS:
        speedups = [b / t for b, t in zip(base, times[key])]
        rows.append((label, f"{median(times[key]) * 1e3:.1f}",
                     f"{flop(opts.shape) / median(times[key]) / 1e9:.0f}",
                     f"{median(speedups):.2f} ({spread(speedups)})", f"{errors[key]:.1e}"))
    vs_dtensor = [d / o for o, d in zip(times["ours2"], times["dtensor"])]
    vs_two_threads = [d / o for o, d in zip(times["ours2"], times["ours1x2"])]
    print(f"MLP {batch}x{hidden} -> {ffn} -> {hidden} float32, {os.cpu_count()} cores, "
          f"{opts.rounds} rounds x {opts.samples} samples x {opts.calls} forwards "
          f"({time.perf_counter() - started:.0f} s)\n")
    print(table(["contender", "ms per forward", "GFLOP/s", "speed-up vs ours 1 rank 1 thread "
                 "(min-max)", "max abs error vs numpy"], rows))
    print()
    print(table(["comparison", "ratio (min-max)"], [
        ("ours 2 ranks vs DTensor 2 ranks (DTensor time / ours)",
         f"{median(vs_dtensor):.2f} ({spread(vs_dtensor)})"),
        ("ours 2 ranks vs ours 1 rank on 2 threads (1-rank time / 2-rank time)",
         f"{median(vs_two_threads):.2f} ({spread(vs_two_threads)})"),
    ]))
    if opts.json:
        Path(opts.json).write_text(json.dumps({
            "labels": {key: label for key, label, *_ in CONTENDERS}, "times": times,
            "errors": errors, "flop": flop(opts.shape),
            "shape": list(opts.shape)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
