"""Prefill of a random-weight Llama: ours on 1, 2 and 4 ranks against torch eager and transformers.

The model is a ``LlamaForCausalLM`` built from a config in code (no download):
hidden 768, FFN 2048, 12 layers, 12 query heads and 4 KV heads (grouped-query
attention), vocabulary 16384, untied LM head: 101M parameters, float32. One
forward over a prompt of 128 tokens (batch 1) gives the logits of every
position: the prefill of text generation.

Contenders, each timed inside its own processes (launch, imports, compilation
and loading are not timed):

* **ours, p ranks, MPI** (p = 1, 2, 4): the model imported with
  :func:`tvm_distx.from_torch`, made tensor parallel with
  :func:`tvm_distx.plans.presets.tensor_parallel` on a ``(p,)`` mesh, compiled with
  :func:`tvm_distx.compile` and exported as a bundle; ``mpiexec -n p`` runs
  this script's rank job, which reads the bundle as our worker does and times
  ``vm[entry](...)`` and the gather of the logits to rank 0 (transformers'
  plan gathers them too). One TVM thread per rank. With 4 ranks on a 2-core
  machine the ranks share cores, so that row measures overhead, not speed.
* **torch eager, 1 process**: the same ``LlamaForCausalLM`` under
  ``torch.no_grad()``, ``use_cache=False``, with 1 thread and with 2.
* **transformers tp_plan, 2 ranks, gloo**: the checkpoint loaded with
  ``from_pretrained(..., tp_plan="auto")`` (transformers' own tensor
  parallelism on DTensor, which needs ``accelerate``), ``torch.distributed``
  on gloo over 127.0.0.1, one thread per rank. Skipped, and said so, where
  ``accelerate`` is not installed.

Each round launches every contender once, in an order that rotates from round
to round; the tables show the median over rounds, and speed-ups as the median
of per-round ratios. Every contender's logits are checked against torch eager's
(float32, relative to the largest logit).

Usage::

    python scripts/bench/llm_prefill.py                 # 2 rounds
    python scripts/bench/llm_prefill.py --tokens 32 --layers 2 --rounds 1
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (bundle_rank_call, child_env, end_rank_job, free_port,  # noqa: E402
                     llama_parameters, median,
                     run_job, spread, table, time_samples)

from tvm_distx.runtime.mpi import mpiexec_path  # noqa: E402
from tvm_distx.runtime.rank_env import rank_environment  # noqa: E402

import numpy as np  # noqa: E402

SCRIPT = str(Path(__file__).resolve())

#: The model (``--hidden``, ``--layers`` ... change it, e.g. for the smoke test).
MODEL = {"vocab_size": 16384, "hidden_size": 768, "intermediate_size": 2048,
         "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 4}


def contenders(ranks: list[int], with_hf_tp: bool) -> list[tuple[str, str, str, int, int]]:
    """``(key, label, kind, ranks, threads per rank)`` of every contender of this run."""
    rows = [(f"ours{p}", f"ours, {p} rank{'s' if p > 1 else ''} over MPI (1 thread each)",
             "ours", p, 1) for p in ranks]
    rows += [("torch1", "torch eager, 1 process, 1 thread", "torch", 1, 1),
             ("torch2", "torch eager, 1 process, 2 threads", "torch", 1, 2)]
    if with_hf_tp:
        rows.append(("hftp2", "transformers tp_plan, 2 ranks over gloo (1 thread each)",
                     "hftp", 2, 1))
    return rows


def build(folder: Path, config: dict, tokens: int, ranks: list[int]) -> None:
    """Save the model and its reference logits in ``folder``, and a bundle per rank count."""
    import torch
    import transformers

    import tvm_distx as td
    from tvm_distx.plans import presets

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **config, max_position_embeddings=max(512, tokens), tie_word_embeddings=False)).eval()
    model.save_pretrained(folder / "model")
    ids = torch.randint(0, config["vocab_size"], (1, tokens))
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits
    np.save(folder / "ids.npy", ids.numpy())
    np.save(folder / "logits.npy", logits.numpy())
    graph, weights = td.from_torch(model, (ids,))
    input_name = graph["main"].params[0].name
    (folder / "inputs.json").write_text(json.dumps({"ids": input_name}))
    for p in ranks:
        started = time.perf_counter()
        mod = presets.tensor_parallel().apply(presets.set_device_meshes(graph, [(p,)]))
        td.compile(mod).export(folder / f"bundle_{p}", params=weights)
        print(f"  compiled and exported for {p} rank(s) in {time.perf_counter() - started:.0f} s",
              file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- inside the jobs
def _error(logits: np.ndarray, data: str) -> float:
    reference = np.load(Path(data) / "logits.npy")
    return float(np.abs(np.asarray(logits) - reference).max() / np.abs(reference).max())


def ours_job(bundle: str, data: str, out: str, samples: int, calls: int) -> None:
    """A rank of ours: load the bundle like our MPI worker, then time ``vm[entry]``."""
    from mpi4py import MPI

    from tvm_distx.layout.arrays import assemble_results

    comm = MPI.COMM_WORLD
    name = json.loads((Path(data) / "inputs.json").read_text())["ids"]
    func, args, signature = bundle_rank_call(bundle, {name: np.load(Path(data) / "ids.npy")},
                                             comm, with_signature=True)

    def prefill():  # the logits on rank 0, as transformers' gathered output
        local = func(*args).numpy()
        shards = comm.gather(local, root=0)
        return assemble_results(signature, shards) if shards is not None else None

    logits = prefill()
    error = _error(logits, data) if comm.Get_rank() == 0 else 0.0
    times = time_samples(prefill, comm.Barrier,
                         lambda t: comm.allreduce(t, op=MPI.MAX), samples, calls)
    if comm.Get_rank() == 0:
        Path(out).write_text(json.dumps({"times": times, "error": error}))


def torch_job(data: str, out: str, threads: int, samples: int, calls: int) -> None:
    """torch eager in this process, with ``threads`` threads."""
    import torch
    import transformers

    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        Path(data) / "model", dtype=torch.float32).eval()
    ids = torch.from_numpy(np.load(Path(data) / "ids.npy"))

    def forward():
        with torch.no_grad():
            return model(ids, use_cache=False).logits

    error = _error(forward().numpy(), data)
    times = time_samples(forward, lambda: None, lambda t: t, samples, calls)
    Path(out).write_text(json.dumps({"times": times, "error": error}))


def hf_tp_job(data: str, out: str, port: int, samples: int, calls: int) -> None:
    """A rank of transformers' own tensor parallelism (rank and size from MPICH's PMI)."""
    import warnings

    import torch
    import torch.distributed as dist
    import transformers

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    rank, world = int(os.environ["PMI_RANK"]), int(os.environ["PMI_SIZE"])
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        Path(data) / "model", dtype=torch.float32, tp_plan="auto").eval()
    ids = torch.from_numpy(np.load(Path(data) / "ids.npy"))

    def forward():
        with torch.no_grad():
            return model(ids, use_cache=False).logits

    error = _error(forward().numpy(), data)

    def slowest(t: float) -> float:
        value = torch.tensor([t], dtype=torch.float64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return float(value[0])

    times = time_samples(forward, dist.barrier, slowest, samples, calls)
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "error": error}))


# ---------------------------------------------------------------------- the controller
def run_contender(key: str, kind: str, ranks: int, threads: int, folder: Path, samples: int,
                  calls: int, timeout: float) -> dict:
    """Launch one job of one contender; returns its samples and its error."""
    out = folder / f"{key}.json"
    out.unlink(missing_ok=True)
    common = ["--data", str(folder), "--out", str(out), "--samples", str(samples),
              "--calls", str(calls)]
    env = child_env(TVM_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    if kind == "ours":  # the environment our launcher gives ranks
        command = [mpiexec_path(), "-n", str(ranks), sys.executable, SCRIPT, "--ours-job",
                   str(folder / f"bundle_{ranks}")] + common
        env = rank_environment(env)
    elif kind == "hftp":
        command = [mpiexec_path(), "-n", str(ranks), sys.executable, SCRIPT, "--hf-tp-job",
                   str(free_port())] + common
    else:
        command = [sys.executable, SCRIPT, "--torch-job", str(threads)] + common
    return run_job(key, command, env, out, timeout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="launches of every contender")
    parser.add_argument("--samples", type=int, default=3, help="samples per launch")
    parser.add_argument("--calls", type=int, default=2, help="forwards per sample")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    parser.add_argument("--tokens", type=int, default=128, help="prompt length")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4],
                        help="rank counts of ours")
    parser.add_argument("--hidden", type=int, help="hidden size (FFN and vocabulary scale)")
    parser.add_argument("--layers", type=int, help="decoder layers")
    parser.add_argument("--json", help="also write the per-round times to this JSON file")
    parser.add_argument("--ours-job", metavar="BUNDLE", help=argparse.SUPPRESS)
    parser.add_argument("--torch-job", metavar="THREADS", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--hf-tp-job", metavar="PORT", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.ours_job:
        ours_job(opts.ours_job, opts.data, opts.out, opts.samples, opts.calls)
        return 0
    if opts.torch_job:
        torch_job(opts.data, opts.out, opts.torch_job, opts.samples, opts.calls)
        return 0
    if opts.hf_tp_job:
        hf_tp_job(opts.data, opts.out, opts.hf_tp_job, opts.samples, opts.calls)
        end_rank_job()

    config = dict(MODEL)
    if opts.hidden:
        scale = opts.hidden / MODEL["hidden_size"]
        heads = max(4, opts.hidden // 64)  # head_dim 64, at least 4 heads
        config.update(hidden_size=opts.hidden, num_attention_heads=heads,
                      num_key_value_heads=max(2, heads // 3),
                      intermediate_size=max(8, int(MODEL["intermediate_size"] * scale)),
                      vocab_size=max(64, int(MODEL["vocab_size"] * scale)))
    if opts.layers:
        config["num_hidden_layers"] = opts.layers
    with_hf_tp = importlib.util.find_spec("accelerate") is not None
    rows = contenders(opts.ranks, with_hf_tp)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tvm-distx-bench-") as tmp:
        folder = Path(tmp)
        build(folder, config, opts.tokens, opts.ranks)
        times: dict[str, list[float]] = {key: [] for key, *_ in rows}
        errors: dict[str, float] = {}
        for r in range(opts.rounds):
            for key, _, kind, ranks, threads in rows[r % len(rows):] + rows[:r % len(rows)]:
                got = run_contender(key, kind, ranks, threads, folder, opts.samples, opts.calls,
                                    opts.timeout)
                times[key].append(median(got["times"]))
                errors[key] = max(errors.get(key, 0.0), got["error"])
                print(f"  round {r + 1}: {key} {times[key][-1] * 1e3:.1f} ms", file=sys.stderr,
                      flush=True)
    bad = {k: e for k, e in errors.items() if e > 1e-4}
    if bad:
        raise SystemExit(f"logits differ from torch eager's: {bad}")

    base = times["torch1"]
    table_rows = []
    for key, label, *_ in rows:
        speedups = [b / t for b, t in zip(base, times[key])]
        table_rows.append((label, f"{median(times[key]) * 1e3:.1f}",
                           f"{opts.tokens / median(times[key]):.0f}",
                           f"{median(speedups):.2f} ({spread(speedups)})", f"{errors[key]:.1e}"))
    print(f"Llama prefill, {llama_parameters(config) / 1e6:.0f}M parameters "
          f"({config['num_hidden_layers']} layers, hidden {config['hidden_size']}), "
          f"{opts.tokens} tokens, float32, {os.cpu_count()} cores, {opts.rounds} rounds x "
          f"{opts.samples} samples x {opts.calls} forwards "
          f"({time.perf_counter() - started:.0f} s)\n")
    print(table(["contender", "ms per prefill", "tokens/s", "speed-up vs torch eager 1 thread "
                 "(min-max)", "max error vs torch (relative)"], table_rows))
    if not with_hf_tp:
        print("\ntransformers tp_plan: not run (it needs `accelerate`, which is not installed)")
    comparisons = []
    if "ours2" in times and "ours1" in times:
        ratio = [a / b for a, b in zip(times["ours1"], times["ours2"])]
        comparisons.append(("ours 2 ranks vs ours 1 rank (1-rank time / 2-rank time)",
                            f"{median(ratio):.2f} ({spread(ratio)})"))
    if "ours2" in times and "hftp2" in times:
        ratio = [a / b for a, b in zip(times["hftp2"], times["ours2"])]
        comparisons.append(("ours 2 ranks vs transformers tp_plan 2 ranks (theirs / ours)",
                            f"{median(ratio):.2f} ({spread(ratio)})"))
    if "ours2" in times:
        ratio = [a / b for a, b in zip(times["torch2"], times["ours2"])]
        comparisons.append(("ours 2 ranks vs torch eager 2 threads (torch / ours)",
                            f"{median(ratio):.2f} ({spread(ratio)})"))
    if comparisons:
        print()
        print(table(["comparison", "ratio (min-max)"], comparisons))
    if opts.json:
        Path(opts.json).write_text(json.dumps({
            "labels": {key: label for key, label, *_ in rows}, "times": times, "errors": errors,
            "tokens": opts.tokens, "parameters": llama_parameters(config)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
