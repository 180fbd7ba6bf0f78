"""Do auto_shard's predicted times rank plans like their measured times?

Eight plans of the test transformer on 2 MPI ranks: auto_shard's choice with
and without a memory budget and its runner-ups, and the presets (tensor
parallel, Megatron sequence parallel, data parallel, replicated). Each plan is
priced by the cost model on the program it becomes (``auto_shard``'s own plans
are pinned, so the report's cost is the program's; every other plan is priced
by ``plan_cost``, which reads the placements propagation gives it), compiled,
and timed on a persistent MPI session. The machine may be shared: the plans are
timed in turns (``--rounds`` turns of ``--calls`` calls each); a plan's time is
the median of all its calls, and, since the load drifts between rounds, also the
median over rounds of its time divided by the round's median plan (both are
ranked against the prediction). The load average is printed before and after.
The profile is measured first with ``measure_cost_profile(2)`` (typical costs on the host
as it is) unless ``--profile`` gives one. Prints one row per plan and
Spearman's rank correlation.

    python scripts/bench/autoshard_rank.py [--profile machine.json] [--rounds 5] [--calls 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "models"))

import tvm_distx as td  # noqa: E402
from tvm_distx import ShardingRule
from tvm_distx.plans import presets  # noqa: E402
from tvm_distx.autoshard import CostProfile, auto_shard, measure_cost_profile, plan_cost  # noqa: E402
from tvm_distx.compiler.pipeline import run_stages  # noqa: E402
from transformer import Transformer  # noqa: E402


def _collectives(module) -> str:
    rows = td.comm_report(run_stages(module)["local_view"]).rows
    count = Counter(r.collective for r in rows if r.collective != "local_slice")
    return ", ".join(f"{n} {k}" for k, n in sorted(count.items())) or "none"


def _load() -> str:
    return "/".join(f"{v:.1f}" for v in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=Path, default=None,
                        help="a CostProfile JSON (default: measured now on 2 MPI ranks)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--save-profile", type=Path, default=None)
    args = parser.parse_args()
    from scipy.stats import spearmanr

    print(f"load average (1/5/15 min) at start: {_load()}", flush=True)
    profile = CostProfile.load(args.profile) if args.profile else measure_cost_profile(2)
    if args.save_profile:
        profile.save(args.save_profile)
    print(f"profile: {profile}", flush=True)
    torch.manual_seed(0)
    net = Transformer(layers=2).eval()
    x = torch.randn(args.batch, args.seq, 256)
    mod, weights = td.from_torch(net, (x,))
    total = sum(v.nbytes for v in weights.values())
    meshed = presets.set_device_meshes(mod, [(2,)])

    plans = []  # (name, predicted seconds, module to compile)
    annotated, report = auto_shard(mod, (2,), profile=profile, runner_ups=2)
    plans.append(("auto_shard", report.solution.objective, annotated))
    for rank, (_, diff) in enumerate(report.runner_ups, start=2):
        rules = [ShardingRule(param=name, result=placement)
                 for name, placement in {**report.placements, **diff}.items()]
        predicted = plan_cost(mod, (2,), rules, profile=profile).objective
        plans.append((f"auto_shard plan #{rank} (its weights and input only)", predicted,
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
        plans.append((name, predicted, preset.apply(meshed)))

    x = x.numpy()
    built = [(name, predicted, _collectives(module), td.compile(module))
             for name, predicted, module in plans]
    times: dict[str, list[float]] = {name: [] for name, _, _, _ in built}
    ratios: dict[str, list[float]] = {name: [] for name, _, _, _ in built}
    for _ in range(args.rounds):  # in turns: every plan meets the same moods of the host
        medians = {}
        for name, _, _, exe in built:
            with exe.session(params=weights) as session:
                session.run(x)  # warm up
                calls = []
                for _ in range(args.calls):
                    start = time.perf_counter()
                    session.run(x)
                    calls.append(time.perf_counter() - start)
            times[name] += calls
            medians[name] = statistics.median(calls)
        middle = statistics.median(medians.values())  # the load drifts between rounds
        for name, value in medians.items():
            ratios[name].append(value / middle)
    print(f"load average at end: {_load()}")
    print("| plan | collectives per call | predicted | measured (median of all calls) | "
          "measured / the round's median plan (median over rounds) |")
    print("|---|---|---|---|---|")
    rows = []
    for name, predicted, collectives, _ in built:
        measured = statistics.median(times[name])
        ratio = statistics.median(ratios[name])
        rows.append((predicted, measured, ratio))
        print(f"| {name} | {collectives} | {predicted * 1e3:.1f} ms | {measured * 1e3:.1f} ms | "
              f"{ratio:.2f} |")
    for column, what in ((1, "median of all calls"), (2, "per-round ratios")):
        rho = spearmanr([r[0] for r in rows], [r[column] for r in rows]).statistic
        print(f"Spearman rank correlation over {len(rows)} plans, measured as the {what}: "
              f"{rho:.2f} ({args.rounds} rounds x {args.calls} calls per plan)")


if __name__ == "__main__":
    main()
