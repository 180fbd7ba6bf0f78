"""Benchmark our scheduled x86 kernels: matmuls against numpy, matvecs per weight format.

For every shape it builds ``R.matmul`` through ``LegalizeOps`` and
:class:`tvm_distx.compiler.schedule.ScheduleCPU`, compiles the kernel with
``tvm.compile`` for the host CPU, checks it against numpy, then times both in
alternating rounds and prints a markdown table of GFLOP/s (medians over the
rounds) and their ratio.

Both sides run on every core: numpy through its multithreaded BLAS, TVM
through its own thread pool (sized by :func:`tvm_distx.compiler.schedule.use_cpu_threads`,
since TVM would otherwise take half the cores on x86). Only the kernel is
timed, with preallocated outputs on both sides (``np.matmul(..., out=)``).
The two thread pools spin for a while after each call, so the script pauses
between the two sides. The machine may be shared: compare the ratios, and
repeat runs.

**Matrix-vector products per weight format** (``--matvec``): one token times
a weight stored ``(out, in)`` in each format of
:mod:`tvm_distx.sources.formats` (``f32``, ``bf16``, ``f16``, ``q8``, ``q4``),
compiled as a program compiles it: :func:`tvm_distx.quantize` writes the
decode, ``legalize_ops`` folds the transpose, :func:`tvm_distx.compiler.schedule.fuse_kernels`
fuses the decode into the matvec kernel and :class:`~tvm_distx.compiler.schedule.ScheduleCPU`
schedules it. Each kernel is checked against numpy on the decoded weight, then
timed on 1 thread (``--threads``) cycling through enough copies of the stored
weight to exceed ``--mib`` MiB, so that the weight comes from memory as in a
decode step. The table gives the GB/s of *stored* bytes (data and scales), their
fraction of the read bandwidth one thread gets (``llm_decode.py``'s STREAM-like
numpy read, measured right after each kernel; decode is bound by that
bandwidth, and the issue asks for at least 0.6 of it in every format), and
their ratio to the float32 kernel's GB/s on the same shape (the float32 matvec
streams its weight with one multiply-add per value: on a loaded host, where
numpy's read drops below it, it is the steadier yardstick).

**Projections of a prompt** (``--prefill``): ``(n, in) @ W.T`` for the weights
``(out, in)`` of a language model's linear layers (a 1024-wide Llama with a
4096-wide FFN, whole and split over 2 ranks), compiled once with the row count
``n`` known only at run time, as ``export_decoder``'s prefill is, then called
with ``n`` = 16, 128 and 512 tokens. One core against one core: TVM on one
thread, numpy's BLAS started with one thread (``OPENBLAS_NUM_THREADS=1``), on
the same (decoded) weight. The issue on time to first token asks for at least
0.7 of numpy on every shape.

Usage::

    python scripts/bench/kernels.py                      # the default shapes
    python scripts/bench/kernels.py --sizes 512 1024 --rounds 7
    python scripts/bench/kernels.py --shapes 128x128x64  # M x K x N
    python scripts/bench/kernels.py --matvec             # every format, LLM shapes, 1 thread
    python scripts/bench/kernels.py --matvec --formats q8 q4 --weights 4096x1024
    python scripts/bench/kernels.py --prefill            # prompt projections, 1 thread
    python scripts/bench/kernels.py --prefill --formats f16 q8 --rows 16 128
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
if "--prefill" in sys.argv and "--threads" not in sys.argv:
    # one core against one core: BLAS sizes its pool when numpy is first imported
    os.environ["OPENBLAS_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = "1"

from tvm_distx.compiler.schedule import (  # noqa: E402 - the paths above come first
    DEFAULT_RULES, RULE_ATTR, MatmulRule, ScheduleCPU, fuse_kernels, use_cpu_threads,
    x86_target)
from llm_decode import stream  # noqa: E402

import numpy as np  # noqa: E402
import tvm  # noqa: E402
from tvm import relax  # noqa: E402

#: The tensor-parallel MLP shards of tests/data/seed_tensor_parallel.py on 2
#: ranks: x @ A-shard (column split) and relu(.) @ B-shard (row split).
TP_SHAPES = [("TP x @ A-shard", 128, 128, 64), ("TP h @ B-shard", 128, 64, 128)]
SQUARE_SIZES = [256, 512, 1024, 2048]


def matmul_kernel(m: int, k: int, n: int, target: tvm.target.Target,
                  rule: MatmulRule | None = None, schedule: bool = True):
    """Compile ``(m, k) @ (k, n)`` in float32; return the kernel's module."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((m, k), "float32"))
    w = relax.Var("w", relax.TensorType((k, n), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.matmul(x, w))
        bb.emit_func_output(out)
    mod = relax.transform.LegalizeOps()(bb.get())
    if schedule:
        mod = ScheduleCPU(target, (rule,) if rule is not None else DEFAULT_RULES)(mod)
    (kernel,) = [f for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    if schedule and not kernel.attrs.get("tirx.is_scheduled", False):
        raise RuntimeError(f"the {m}x{k}x{n} matmul was not scheduled")
    kernel_mod = tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")})
    return tvm.compile(kernel_mod, target=target).mod


def _calls_for(flop: float, seconds: float = 0.05) -> int:
    """Calls per timed sample: about ``seconds`` at 100 GFLOP/s."""
    return max(1, int(seconds * 100e9 / flop))


def time_numpy(a: np.ndarray, b: np.ndarray, c: np.ndarray, calls: int, samples: int) -> float:
    """Median seconds per ``np.matmul(a, b, out=c)``."""
    for _ in range(max(2, calls // 4)):
        np.matmul(a, b, out=c)
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(calls):
            np.matmul(a, b, out=c)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def time_tvm(kernel, args, calls: int, samples: int) -> float:
    """Median seconds per kernel call, with TVM's own timer."""
    timer = kernel.time_evaluator("main", tvm.cpu(), number=calls, repeat=samples,
                                  min_repeat_ms=0)
    return float(np.median(timer(*args).results))


def bench(label: str, m: int, k: int, n: int, target, rounds: int, pause: float,
          rule: MatmulRule | None, baseline: bool) -> dict:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k), dtype="float32")
    b = rng.standard_normal((k, n), dtype="float32")
    c = np.empty((m, n), "float32")
    kernel = matmul_kernel(m, k, n, target, rule)
    args = [tvm.runtime.tensor(v) for v in (a, b, np.zeros((m, n), "float32"))]
    kernel["main"](*args)
    np.testing.assert_allclose(args[2].numpy(), a @ b, rtol=1e-3, atol=1e-3 * np.sqrt(k))

    flop = 2.0 * m * n * k
    calls = _calls_for(flop)
    ours, theirs, ratios = [], [], []
    for _ in range(rounds):
        time.sleep(pause)
        t_np = time_numpy(a, b, c, calls, samples=3)
        time.sleep(pause)
        t_tvm = time_tvm(kernel, args, calls, samples=3)
        theirs.append(flop / t_np / 1e9)
        ours.append(flop / t_tvm / 1e9)
        ratios.append(t_np / t_tvm)
    row = {"label": label, "shape": f"{m}x{k}x{n}", "numpy": statistics.median(theirs),
           "tvm": statistics.median(ours), "ratio": statistics.median(ratios),
           "ratio_min": min(ratios), "ratio_max": max(ratios), "default": None}
    if baseline:
        plain = matmul_kernel(m, k, n, target, schedule=False)
        row["default"] = flop / time_tvm(plain, args, max(1, calls // 50), samples=1) / 1e9
    return row


# ------------------------------------------------------------ matvecs per weight format
#: Weight shapes ``(out, in)`` of the matrix-vector family: a 1024-wide model's
#: FFN up (4096 x 1024) and down (1024 x 4096) projections, and a 2816-wide FFN.
MATVEC_WEIGHTS = [(4096, 1024), (1024, 4096), (2816, 1024)]
#: The weight formats, in the order of the table.
MATVEC_FORMATS = ("f32", "bf16", "f16", "q8", "q4")


def matvec_kernel(fmt: str, n: int, k: int, target, rows=1):
    """Our compiled ``(rows, k) @ W.T`` for ``W`` ``(n, k)`` stored in ``fmt``, as compile builds it.

    ``rows`` is a number or a ``tvm.tirx.Var`` (known at run time). Returns the
    kernel, the stored parts of a random ``W`` (``{"data", "scale"}``) and the
    rule that scheduled the kernel.
    """
    import tvm_distx as td
    from tvm_distx.compiler.pipeline import legalize_ops
    from tvm_distx.sources import formats

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((rows, k), "float32"))
    w = relax.Var("w", relax.TensorType((n, k), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.matmul(x, relax.op.permute_dims(w)))
        bb.emit_func_output(out)
    weight = np.random.default_rng(n + k).standard_normal((n, k), dtype="float32")
    mod = bb.get()
    if fmt != "f32":
        mod, _ = td.quantize(mod, {"w": weight}, fmt)
    mod = ScheduleCPU(target)(fuse_kernels(legalize_ops(mod)))
    kernels = [f for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    if len(kernels) != 1:
        raise RuntimeError(f"the {fmt} matvec {n}x{k} is {len(kernels)} kernels, not one")
    (kernel,) = kernels
    rule = kernel.attrs.get(RULE_ATTR, "none") if kernel.attrs is not None else "none"
    built = tvm.compile(tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")}),
                        target=target).mod
    names = [str(p.name) for p in kernel.params]
    return built["main"], names, formats.encode(weight, fmt), str(rule)


def bench_matvec(fmt: str, n: int, k: int, target, rounds: int, mib: int,
                 window: float) -> dict:
    """Time one format's matvec cycling through ``mib`` MiB of weight copies; bandwidth too."""
    from tvm_distx.sources import formats

    func, names, parts, rule = matvec_kernel(fmt, n, k, target)
    stored = sum(int(v.nbytes) for v in parts.values())
    copies = max(1, math.ceil((mib << 20) / stored))
    x = np.random.default_rng(1).standard_normal((1, k), dtype="float32")
    by_name = {"x": x, "w": parts["data"], "w_scale": parts.get("scale")}

    def arguments(copy: int) -> list:
        args = []
        for name in names[:-1]:  # the last parameter is the output
            value = by_name[name]
            args.append(tvm.runtime.tensor(value if copy == 0 or name == "x" else value.copy()))
        return args + [tvm.runtime.tensor(np.zeros((1, n), "float32"))]

    pool = [arguments(c) for c in range(copies)]
    func(*pool[0])
    want = x @ formats.decode(parts, fmt).T
    np.testing.assert_allclose(pool[0][-1].numpy(), want, rtol=1e-4,
                               atol=1e-4 * float(np.abs(want).max()))
    reps = max(1, (4 * (mib << 20)) // (stored * copies))
    seconds = []
    for _ in range(rounds):
        for args in pool:
            func(*args)
        began = time.perf_counter()
        for _ in range(reps):
            for args in pool:
                func(*args)
        seconds.append((time.perf_counter() - began) / (reps * copies))
    del pool
    bandwidth = stream(mib, window=window)["read"]  # right after the kernel's rounds
    return {"format": fmt, "shape": f"{n}x{k}", "rule": rule, "stored": stored,
            "seconds": statistics.median(seconds), "best": min(seconds),
            "gbs": stored / statistics.median(seconds) / 1e9,
            "fraction": stored / statistics.median(seconds) / bandwidth,
            "fraction_best": stored / min(seconds) / bandwidth, "bandwidth": bandwidth}


def matvec_main(opts, target, threads: int) -> int:
    """The ``--matvec`` table."""
    weights = [tuple(int(v) for v in text.lower().split("x")) for text in opts.weights] \
        if opts.weights else MATVEC_WEIGHTS
    print(f"target: {target.attrs['mcpu']} ({target.attrs['num-cores']} cores, as ranks are "
          f"compiled), TVM threads: {threads}, rounds: {opts.rounds}, weights cycled: "
          f"{opts.mib} MiB\n")
    print("| format | weight (out x in) | stored MiB | rule | us/call | GB/s stored | "
          "G weights/s | read bandwidth GB/s | fraction of it (best round) | "
          "GB/s over f32's |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|", flush=True)
    for n, k in weights:
        f32 = None
        for fmt in opts.formats:
            row = bench_matvec(fmt, n, k, target, opts.rounds, opts.mib, opts.window)
            f32 = row["gbs"] if fmt == "f32" else f32
            print(f"| {fmt} | {row['shape']} | {row['stored'] / (1 << 20):.2f} | {row['rule']} | "
                  f"{row['seconds'] * 1e6:.0f} | {row['gbs']:.1f} | "
                  f"{n * k / row['seconds'] / 1e9:.2f} | {row['bandwidth'] / 1e9:.1f} | "
                  f"{row['fraction']:.2f} ({row['fraction_best']:.2f}) | "
                  + (f"{row['gbs'] / f32:.2f} |" if f32 else "- |"), flush=True)
    print("\nread bandwidth: numpy's sum over a float64 array (llm_decode.py's stream(), 1 "
          f"thread, {opts.mib} MiB), measured right after each kernel; medians over "
          f"{opts.rounds} rounds")
    return 0


# ------------------------------------------------------------ projections of a prompt
#: Weights ``(out, in)`` of the prefill family: a 1024-wide Llama's q/o (1024 x 1024),
#: FFN gate/up (4096 x 1024) and down (1024 x 4096), and their shards on 2 ranks.
PREFILL_WEIGHTS = [(1024, 1024), (4096, 1024), (1024, 4096), (512, 1024), (2048, 1024),
                   (1024, 2048)]
#: Prompt rows the prefill family is called with.
PREFILL_ROWS = (16, 128, 512)


def bench_prefill(fmt: str, n: int, k: int, rows: list[int], target, rounds: int,
                  pause: float) -> list[dict]:
    """Compile ``(rows, k) @ W.T`` once for run-time rows; time it against numpy per row count."""
    from tvm_distx.sources import formats

    func, names, parts, rule = matvec_kernel(fmt, n, k, target,
                                             rows=tvm.tirx.Var("n", "int64"))
    weight = formats.decode(parts, fmt).astype("float32")
    weight_t = np.ascontiguousarray(weight.T)  # BLAS reads either layout at one speed
    by_name = {"w": parts["data"], "w_scale": parts.get("scale")}
    out = []
    for m in rows:
        x = np.random.default_rng(m).standard_normal((m, k), dtype="float32")
        args = [tvm.runtime.tensor(x if name == "x" else by_name[name]) for name in names[:-1]]
        args.append(tvm.runtime.tensor(np.zeros((m, n), "float32")))
        func(*args)
        want = x @ weight.T
        np.testing.assert_allclose(args[-1].numpy(), want, rtol=1e-4,
                                   atol=1e-4 * float(np.abs(want).max()))
        c = np.empty((m, n), "float32")
        flop = 2.0 * m * n * k
        calls = _calls_for(flop, 0.1)
        ours, theirs, ratios = [], [], []
        for _ in range(rounds):
            time.sleep(pause)
            t_np = time_numpy(x, weight_t, c, calls, samples=3)
            time.sleep(pause)
            began = time.perf_counter()
            for _ in range(calls):
                func(*args)
            t_tvm = (time.perf_counter() - began) / calls
            theirs.append(flop / t_np / 1e9)
            ours.append(flop / t_tvm / 1e9)
            ratios.append(t_np / t_tvm)
        out.append({"format": fmt, "shape": f"{n}x{k}", "rows": m, "rule": rule,
                    "numpy": statistics.median(theirs), "tvm": statistics.median(ours),
                    "ratio": statistics.median(ratios), "ratio_min": min(ratios),
                    "ratio_max": max(ratios)})
    return out


def prefill_main(opts, target, threads: int) -> int:
    """The ``--prefill`` table."""
    weights = [tuple(int(v) for v in text.lower().split("x")) for text in opts.weights] \
        if opts.weights else PREFILL_WEIGHTS
    formats = opts.formats if opts.formats != list(MATVEC_FORMATS) else ["f32"]
    print(f"target: {target.attrs['mcpu']}, TVM threads: {threads}, numpy {np.__version__} "
          f"(BLAS threads: {os.environ.get('OPENBLAS_NUM_THREADS', 'default')}), rounds: "
          f"{opts.rounds}; rows known at run time\n")
    print("| format | weight (out x in) | rows | rule | numpy GFLOP/s | ours GFLOP/s | "
          "ours / numpy (min-max) |")
    print("|---|---|---:|---|---:|---:|---:|", flush=True)
    worst = math.inf
    for n, k in weights:
        for fmt in formats:
            for row in bench_prefill(fmt, n, k, opts.rows, target, opts.rounds, opts.pause):
                worst = min(worst, row["ratio"])
                print(f"| {fmt} | {row['shape']} | {row['rows']} | {row['rule']} | "
                      f"{row['numpy']:.1f} | {row['tvm']:.1f} | {row['ratio']:.2f} "
                      f"({row['ratio_min']:.2f}-{row['ratio_max']:.2f}) |", flush=True)
    print(f"\nlowest median ratio: {worst:.2f}; numpy multiplies the decoded float32 weight")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=SQUARE_SIZES,
                        help="square sizes N (N x N x N)")
    parser.add_argument("--shapes", nargs="*", default=None,
                        help="extra M x K x N shapes, as 128x128x64")
    parser.add_argument("--no-tp", action="store_true", help="skip the TP MLP shard shapes")
    parser.add_argument("--rounds", type=int, default=5, help="alternating timing rounds")
    parser.add_argument("--pause", type=float, default=0.2,
                        help="seconds between numpy and TVM, so the idle pool stops spinning")
    parser.add_argument("--threads", type=int, default=None,
                        help="TVM's threads (default: TVM_NUM_THREADS, else every core); numpy "
                             "uses its BLAS default, see OPENBLAS_NUM_THREADS")
    parser.add_argument("--tile-rows", type=int, default=None, help="register tile rows (mr)")
    parser.add_argument("--vectors", type=int, default=None,
                        help="register tile columns, in vector registers")
    parser.add_argument("--no-pack", action="store_true", help="do not pack the B panels")
    parser.add_argument("--baseline", action="store_true",
                        help="also time TVM's default (unscheduled) build, sizes <= 512 only")
    parser.add_argument("--matvec", action="store_true",
                        help="the matrix-vector family per weight format instead (1 thread "
                        "unless --threads)")
    parser.add_argument("--prefill", action="store_true",
                        help="the prompt-projection family instead: run-time rows times an "
                        "(out, in) weight, 1 thread against numpy on 1 thread")
    parser.add_argument("--rows", type=int, nargs="*", default=list(PREFILL_ROWS),
                        help="--prefill: the prompt row counts")
    parser.add_argument("--formats", nargs="*", default=list(MATVEC_FORMATS),
                        choices=MATVEC_FORMATS,
                        help="--matvec: the weight formats (--prefill: f32 unless given)")
    parser.add_argument("--weights", nargs="*", default=None,
                        help="--matvec/--prefill: weight shapes OUTxIN (defaults: the module "
                        "docstring)")
    parser.add_argument("--mib", type=int, default=512,
                        help="--matvec: MiB of weight copies cycled through, and of the "
                        "bandwidth's array")
    parser.add_argument("--window", type=float, default=0.5,
                        help="--matvec: seconds of each bandwidth measurement")
    opts = parser.parse_args(argv)
    if (opts.matvec or opts.prefill) and not opts.threads:
        opts.threads = 1

    threads = opts.threads or os.cpu_count() or 1
    if opts.threads:
        os.environ["TVM_NUM_THREADS"] = str(threads)
    tvm_threads = use_cpu_threads(threads)  # before any kernel runs in this thread
    target = x86_target(tvm_threads)
    if opts.matvec:  # compiled for every core, as a rank's program is, run on --threads
        return matvec_main(opts, x86_target(), tvm_threads)
    if opts.prefill:  # compiled as a rank of one thread is
        return prefill_main(opts, target, tvm_threads)
    rule = None
    if opts.tile_rows or opts.vectors or opts.no_pack:
        rule = MatmulRule(rows=opts.tile_rows, vectors=opts.vectors, pack=not opts.no_pack)

    shapes = [(f"square {s}", s, s, s) for s in opts.sizes]
    for text in opts.shapes or []:
        m, k, n = (int(v) for v in text.lower().split("x"))
        shapes.append((f"{m}x{k}x{n}", m, k, n))
    if not opts.no_tp:
        shapes += TP_SHAPES

    print(f"target: {target.attrs['mcpu']}, TVM threads: {tvm_threads}, "
          f"numpy {np.__version__}, rounds: {opts.rounds}, rule: {rule or 'default'}\n")
    header = "| kernel | M x K x N | numpy GFLOP/s | ours GFLOP/s | ours / numpy (min-max) |"
    rule_line = "|---|---|---:|---:|---:|"
    if opts.baseline:
        header += " TVM default GFLOP/s |"
        rule_line += "---:|"
    print(header)
    print(rule_line, flush=True)
    for label, m, k, n in shapes:
        row = bench(label, m, k, n, target, opts.rounds, opts.pause, rule,
                    opts.baseline and max(m, k, n) <= 512)
        line = (f"| {row['label']} | {row['shape']} | {row['numpy']:.1f} | {row['tvm']:.1f} | "
                f"{row['ratio']:.2f} ({row['ratio_min']:.2f}-{row['ratio_max']:.2f}) |")
        if opts.baseline:
            line += f" {row['default']:.1f} |" if row["default"] is not None else " - |"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
