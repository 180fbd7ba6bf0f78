"""Do auto_shard's predicted times rank plans like their measured times?

Six or more plans of the test transformer on 2 MPI ranks: auto_shard's choice
with and without a memory budget and its runner-ups, and the presets
(tensor parallel, Megatron sequence parallel, data parallel, replicated). Each
plan is priced by the cost model (``plan_cost`` for the presets), compiled, and
timed on a persistent MPI session (median of the calls). Prints one row per
plan and Spearman's rank correlation.

    python scripts/bench/autoshard_rank.py [--profile machine.json] [--calls 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "models"))

import tvm_distx as td  # noqa: E402
from tvm_distx import ShardingRule, presets  # noqa: E402
from tvm_distx.autoshard import CostProfile, auto_shard, plan_cost  # noqa: E402
from transformer import Transformer  # noqa: E402


def _time(exe, x, weights, calls: int) -> float:
    with exe.session(params=weights) as session:
        session.run(x)  # warm up
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            session.run(x)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=Path, default=None,
                        help="a CostProfile JSON (default: measured now on 2 MPI ranks)")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()
    from scipy.stats import spearmanr

    profile = CostProfile.load(args.profile) if args.profile else td.profile(2)
    print(f"profile: {profile}")
    torch.manual_seed(0)
    net = Transformer(layers=2).eval()
    x = torch.randn(args.batch, args.seq, 256)
    mod, weights = td.from_torch(net, (x,))
    total = sum(v.nbytes for v in weights.values())
    meshed = presets.with_meshes(mod, [(2,)])

    plans = []  # (name, predicted seconds, module to compile)
    annotated, report = auto_shard(mod, (2,), profile=profile, runner_ups=2)
    plans.append(("auto_shard", report.solution.objective, annotated))
    for rank, (other, diff) in enumerate(report.runner_ups, start=2):
        rules = [ShardingRule(param=name, result=placement)
                 for name, placement in {**report.placements, **diff}.items()]
        plans.append((f"auto_shard plan #{rank}", other.objective,
                       td.passes.AnnotateSharding(rules)(meshed)))
    annotated, budget = auto_shard(mod, (2,), profile=profile, runner_ups=0,
                                   memory_per_rank=int(0.55 * total) + 8 * x.numel() * 4)
    plans.append(("auto_shard, 0.55 x weights + activations", budget.solution.objective,
                  annotated))
    for name, preset in (("tensor_parallel()", presets.tensor_parallel()),
                         ("megatron(sequence_parallel=True)",
                          presets.megatron(sequence_parallel=True)),
                         ("data_parallel()", presets.data_parallel()),
                         ("replicated", presets.Preset((("*", "R", None),)))):
        predicted = plan_cost(mod, (2,), preset, profile=profile).objective
        module = preset.apply(meshed)
        plans.append((name, predicted, module))

    x = x.numpy()
    rows = []
    for name, predicted, module in plans:
        measured = _time(td.compile(module), x, weights, args.calls)
        rows.append((name, predicted, measured))
        print(f"| {name} | {predicted * 1e3:.3f} ms | {measured * 1e3:.3f} ms |", flush=True)
    rho = spearmanr([r[1] for r in rows], [r[2] for r in rows]).statistic
    print(f"Spearman rank correlation over {len(rows)} plans: {rho:.2f}")


if __name__ == "__main__":
    main()
