"""Bytes moved by every change of placement: our planner, the lower bound and PyTorch DTensor.

For a rank-3 float32 tensor (16 x 16 x 16 by default: every dimension divides by
the 8 devices of the largest mesh) and each mesh (2,), (4,), (2, 2), (2, 4) and
(2, 2, 2), every ordered pair of different placements (each mesh axis ``R`` or
``S[k]``, ``k < 3``) is planned three ways, and the bytes **received per rank**
are counted:

* ours: ``tvm_distx.legalize.plan_redistribute(...).bytes_received``, and the
  same planner restricted to single-axis collectives (``allow_send_recv=False``,
  no point-to-point exchange) to show where the send/recv matters;
* the closed-form lower bound, ``tvm_distx.legalize.lower_bound_bytes``;
* PyTorch DTensor: the transform steps its redistribute would run, from
  ``torch.distributed.tensor._redistribute._gen_transform_infos`` (the greedy
  planner ``DTensor.redistribute`` uses by default) and, as a second column,
  from its graph-based min-cost planner (``use_graph_based_transform=True``,
  what ``use_min_cost_redistribution_plan()`` selects). No data moves:
  ``torch.distributed`` runs on the fake process group of
  ``torch.testing._internal.distributed.fake_pg`` (rank 0 of 8; each mesh is a
  ``DeviceMesh`` over the first devices), which is enough for the planner.

DTensor's steps are costed with the ring model of our planner's documentation
(``legalize/planner.py``), with ``s`` the bytes a rank holds before the step and
``p`` the size of the step's mesh axis: ``Shard -> Replicate`` is an all-gather,
``s * (p - 1)``; ``Shard(i) -> Shard(j)`` an all-to-all, ``s * (p - 1) / p``;
``Replicate -> Shard`` a local slice, 0. Collectives move the same amount on
every rank, so a plan's bytes per rank are the sum over its steps (DTensor's
optional merging of consecutive all-gathers into one over a flattened mesh
moves the same bytes). DTensor nests a dimension sharded by several mesh axes
in mesh-axis order by default, the same convention as ours, so both start from
and end at the same layout.

Reported per mesh: how many transitions each plan makes with exactly the lower
bound, the total bytes over all transitions (and the ratio to ours), and the
transitions where DTensor's default plan receives strictly more than ours
(a few examples per mesh, worst first; ``--list`` prints all of them).

Partial sums, "bytes vs the all-reduce plan": a partial sum (``"P"`` on one
mesh axis, the other axes any placement) completed into every destination
placement, planned as the compiler plans it
(``tvm_distx.legalize.partial_sums.plan_completion``: a reduce-scatter where
the destination splits the summed axis) against the all-reduce plan (always
all-reduce, then the planner's steps to the destination, which is what a
row-parallel layer did before reduce-scatters existed). Then the whole
transformer of the PyTorch tests (2 blocks, batch 2, 16 tokens, width 256, on 2
ranks): the comm report of ``megatron(sequence_parallel=True)`` against that of
``megatron()``, which all-reduces after every row-parallel layer
(``--no-model`` skips it).

``--check`` only verifies that every plan of ours equals the lower bound (exit
status 1 otherwise).

Usage::

    python scripts/bench/comm_volume.py
    python scripts/bench/comm_volume.py --check
    python scripts/bench/comm_volume.py --meshes 2x2 --list
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt_bytes, table  # noqa: E402 - the path above comes first

from tvm_distx.legalize import lower_bound_bytes, plan_redistribute  # noqa: E402
from tvm_distx.legalize.partial_sums import PartialSum, plan_completion  # noqa: E402
from tvm_distx.layout.mesh import DeviceMesh  # noqa: E402
from tvm_distx.layout import Partial, Placement, Replicate, Shard, TensorSharding  # noqa: E402

MESHES = [(2,), (4,), (2, 2), (2, 4), (2, 2, 2)]
SHAPE = (16, 16, 16)
DTYPE = "float32"
ITEMSIZE = 4


@dataclass(frozen=True)
class Transition:
    """One change of placement and what every contender receives per rank."""

    mesh: tuple[int, ...]
    src: tuple[int, ...]  # per mesh axis: -1 for R, k for S[k]
    dst: tuple[int, ...]
    bound: int
    ours: int
    ours_collectives: int
    ours_steps: str
    dtensor: int
    dtensor_steps: str
    dtensor_min_cost: int | None


def _text(code: tuple[int, ...]) -> str:
    return "".join("R" if c < 0 else f"S[{c}]" for c in code)


_STEP_NAMES = {"LOCAL_SLICE": "slice", "ALL_GATHER": "all-gather", "ALL_TO_ALL": "all-to-all",
               "SEND_RECV": "send/recv"}


def _ours(mesh: tuple[int, ...], src, dst) -> tuple[int, int, int, str]:
    devices = DeviceMesh(mesh, range(0, math.prod(mesh)))
    a = TensorSharding(devices, Placement(tuple(Replicate() if c < 0 else Shard(c) for c in src)))
    b = TensorSharding(devices, Placement(tuple(Replicate() if c < 0 else Shard(c) for c in dst)))
    plan = plan_redistribute(a, b, SHAPE, DTYPE)
    collectives = plan_redistribute(a, b, SHAPE, DTYPE, allow_send_recv=False)
    steps = " + ".join(_STEP_NAMES[step.collective.name]
                       + ("" if step.mesh_axis is None else f"@{step.mesh_axis}")
                       for step in plan.steps) or "nothing"
    return (lower_bound_bytes(a, b, SHAPE, DTYPE), plan.bytes_received,
            collectives.bytes_received, steps)


class DTensorPlanner:
    """DTensor's redistribute planner on a fake process group (no data moves)."""

    def __init__(self, world: int) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.tensor import Replicate as TR, Shard as TS
        from torch.distributed.tensor import _redistribute
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
        from torch.testing._internal.distributed.fake_pg import FakeStore

        if not dist.is_initialized():
            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        self.torch, self.dist = torch, dist
        self.TR, self.TS, self.Spec = TR, TS, DTensorSpec
        self.redistribute = _redistribute
        stride = tuple(math.prod(SHAPE[i + 1:]) for i in range(len(SHAPE)))
        self.meta = TensorMeta(torch.Size(SHAPE), stride, torch.float32)
        self.meshes: dict[tuple[int, ...], object] = {}

    def mesh(self, shape: tuple[int, ...]):
        from torch.distributed.device_mesh import DeviceMesh as TorchMesh

        if shape not in self.meshes:
            ids = self.torch.arange(math.prod(shape)).reshape(shape)
            self.meshes[shape] = TorchMesh("cpu", ids)
        return self.meshes[shape]

    def spec(self, shape, code):
        placements = tuple(self.TR() if c < 0 else self.TS(c) for c in code)
        return self.Spec(self.mesh(shape), placements, tensor_meta=self.meta)

    def steps(self, shape, src, dst, min_cost: bool = False):
        """DTensor's transform infos for ``src -> dst`` on a mesh of ``shape``."""
        return self.redistribute._gen_transform_infos_non_cached(
            self.spec(shape, src), self.spec(shape, dst), True if min_cost else None)

    @staticmethod
    def bytes_received(shape: tuple[int, ...], src, steps) -> tuple[int, str]:
        """Bytes per rank of ``steps`` from ``src``, with the ring costs above; and the steps."""
        current = list(src)
        total, names = 0.0, []
        for info in steps:
            axis = info.mesh_dim
            before, after = info.src_dst_placements
            p = shape[axis]
            held = math.prod(SHAPE) * ITEMSIZE / math.prod(
                shape[a] for a, c in enumerate(current) if c >= 0)
            if before.is_shard() and after.is_replicate():
                total += held * (p - 1)
                names.append(f"all-gather@{axis}")
                current[axis] = -1
            elif before.is_shard() and after.is_shard():
                total += held * (p - 1) / p
                names.append(f"all-to-all@{axis}")
                current[axis] = after.dim
            elif before.is_replicate() and after.is_shard():
                names.append(f"slice@{axis}")
                current[axis] = after.dim
            else:  # partial placements never occur here
                raise ValueError(f"unexpected DTensor step {before} -> {after}")
        return int(round(total)), " + ".join(names) or "nothing"


def transitions(meshes, min_cost: bool) -> list[Transition]:
    """Every transition of every mesh, planned by every contender."""
    planner = DTensorPlanner(max(math.prod(m) for m in meshes))
    out = []
    for mesh in meshes:
        codes = list(itertools.product(range(-1, len(SHAPE)), repeat=len(mesh)))
        for src, dst in itertools.permutations(codes, 2):
            bound, ours, collectives, ours_steps = _ours(mesh, src, dst)
            greedy, steps = planner.bytes_received(mesh, src, planner.steps(mesh, src, dst))
            best = None
            if min_cost:
                best, _ = planner.bytes_received(mesh, src, planner.steps(mesh, src, dst, True))
            out.append(Transition(mesh, src, dst, bound, ours, collectives, ours_steps, greedy,
                                  steps, best))
    return out


def totals(rows: list[Transition]) -> list[dict]:
    """Per mesh: transitions, plans at the bound and total bytes of every contender."""
    out = []
    for mesh in dict.fromkeys(r.mesh for r in rows):
        group = [r for r in rows if r.mesh == mesh]
        entry = {"mesh": _mesh_text(mesh), "transitions": len(group)}
        for key in ("bound", "ours", "ours_collectives", "dtensor", "dtensor_min_cost"):
            values = [getattr(r, key) for r in group]
            if None not in values:
                entry[key] = sum(values)
                entry[f"{key}_optimal"] = sum(v == r.bound for v, r in zip(values, group))
        out.append(entry)
    return out


def _mesh_text(mesh) -> str:
    return "x".join(map(str, mesh)) if len(mesh) > 1 else f"({mesh[0]},)"


def report(rows: list[Transition], examples: int, list_all: bool) -> str:
    min_cost = rows[0].dtensor_min_cost is not None
    meshes = list(dict.fromkeys(r.mesh for r in rows))
    body = []
    groups = {m: [r for r in rows if r.mesh == m] for m in meshes}
    groups["all"] = rows
    for key, group in groups.items():
        bound = sum(r.bound for r in group)
        ours = sum(r.ours for r in group)
        coll = sum(r.ours_collectives for r in group)
        dt = sum(r.dtensor for r in group)
        line = [f"**{key}**" if key == "all" else _mesh_text(key), len(group),
                sum(r.ours == r.bound for r in group),
                sum(r.ours_collectives == r.bound for r in group),
                sum(r.dtensor == r.bound for r in group)]
        if min_cost:
            line.append(sum(r.dtensor_min_cost == r.bound for r in group))
        line += [fmt_bytes(bound), fmt_bytes(ours), f"{coll / ours:.2f}", f"{dt / ours:.2f}"]
        if min_cost:
            line.append(f"{sum(r.dtensor_min_cost for r in group) / ours:.2f}")
        line.append(sum(r.dtensor > r.ours for r in group))
        body.append(line)
    headers = ["mesh", "transitions", "optimal: ours", "optimal: ours, collectives only",
               "optimal: DTensor"]
    if min_cost:
        headers.append("optimal: DTensor min-cost")
    headers += ["total bytes: lower bound", "total bytes: ours",
                "total: ours collectives-only / ours", "total: DTensor / ours"]
    if min_cost:
        headers.append("total: DTensor min-cost / ours")
    headers.append("DTensor strictly worse")
    out = ["Bytes received per rank, summed over the transitions of a "
           f"{'x'.join(map(str, SHAPE))} {DTYPE} tensor; 'optimal' counts the plans that "
           "receive exactly the lower bound.", "", table(headers, body)]

    worse = [r for r in rows if r.dtensor > r.ours]
    if worse:
        which = ("all of them" if list_all else
                 f"per mesh, the worst of each kind of DTensor plan, at most {examples}")
        out += ["", f"Where DTensor's default plan receives more than ours ({len(worse)} "
                f"transitions; {which}; worst first by DTensor / ours):", ""]
        lines = []
        for mesh in meshes:
            mine = sorted((r for r in worse if r.mesh == mesh),
                          key=lambda r: (-r.dtensor / r.ours, _text(r.src), _text(r.dst)))
            if not list_all:  # one example per DTensor step sequence, for variety
                kinds = {}
                for r in mine:
                    kinds.setdefault(r.dtensor_steps, r)
                mine = list(kinds.values())[:examples]
            for r in mine:
                lines.append((_mesh_text(mesh), f"{_text(r.src)} -> {_text(r.dst)}",
                              fmt_bytes(r.bound), fmt_bytes(r.dtensor),
                              f"{r.dtensor / r.ours:.2f}", r.ours_steps, r.dtensor_steps))
        out.append(table(["mesh", "transition", "lower bound = ours", "DTensor",
                          "DTensor / ours", "our steps", "DTensor's steps"], lines, "llrrrll"))
    better = [r for r in rows if r.dtensor < r.ours]
    out += ["", f"Transitions where DTensor receives less than ours: {len(better)}."]
    return "\n".join(out)


def _all_reduce_plan_bytes(partial: PartialSum, dst: TensorSharding) -> int:
    """All-reduce the sum, then the planner's steps to ``dst`` (no reduce-scatter)."""
    completed = plan_completion(partial, None, SHAPE, DTYPE)
    if partial.completed == dst:
        return completed.bytes_received
    return (completed.bytes_received
            + plan_redistribute(partial.completed, dst, SHAPE, DTYPE).bytes_received)


def partial_sum_rows(meshes) -> list[list]:
    """Per mesh: partial sums completed into every placement, ours against all-reduce."""
    rows = []
    for mesh in meshes:
        devices = DeviceMesh(mesh, range(0, math.prod(mesh)))
        codes = list(itertools.product(range(-1, len(SHAPE)), repeat=len(mesh)))
        count = fewer = 0
        ours_total = allreduce_total = 0
        for axis in range(len(mesh)):
            for src in codes:
                if src[axis] != -1:
                    continue  # the summed axis holds full-shape addends
                entries = list(_placement(src).entries)
                entries[axis] = Partial()
                partial = PartialSum(None, TensorSharding(devices, Placement(tuple(entries))))
                for dst in codes:
                    target = TensorSharding(devices, _placement(dst))
                    ours = plan_completion(partial, target, SHAPE, DTYPE).bytes_received
                    baseline = _all_reduce_plan_bytes(partial, target)
                    count += 1
                    fewer += ours < baseline
                    ours_total += ours
                    allreduce_total += baseline
        rows.append([_mesh_text(mesh), count, fewer, fmt_bytes(ours_total),
                     fmt_bytes(allreduce_total), f"{ours_total / allreduce_total:.2f}"])
    return rows


def _placement(code) -> Placement:
    return Placement(tuple(Replicate() if c < 0 else Shard(c) for c in code))


def model_rows() -> list[list]:
    """The test transformer on 2 ranks: comm report of sequence parallel against all-reduce."""
    import torch

    import tvm_distx as td
    from tvm_distx.frontend.pytorch import from_torch
    from tvm_distx.compiler.pipeline import run_stages
    from tvm_distx.plans.presets import megatron, set_device_meshes

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "models"))
    from transformer import Transformer

    torch.manual_seed(0)
    mod, _ = from_torch(Transformer(layers=2).eval(), (torch.randn(2, 16, 256),))
    mod = set_device_meshes(mod, [(2,)])
    plans = []
    for name, preset in (("megatron() (all-reduce plan)", megatron()),
                         ("megatron(sequence_parallel=True)", megatron(sequence_parallel=True))):
        rows = td.comm_report(run_stages(preset.apply(mod))["local_view"]).rows
        kinds: dict[str, int] = {}
        for r in rows:
            kinds[r.collective] = kinds.get(r.collective, 0) + 1
        plans.append((name, ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())),
                      sum(r.bytes_per_rank for r in rows)))
    baseline = plans[0][2]
    return [[name, kinds, fmt_bytes(total), f"{total / baseline:.2f}"]
            for name, kinds, total in plans]


def partial_report(meshes, model: bool) -> str:
    """The section "bytes vs the all-reduce plan"."""
    out = ["Partial sums: bytes vs the all-reduce plan. A sum over one mesh axis (\"P\" there, "
           "any placement elsewhere) completed into every placement of the mesh: ours "
           "reduce-scatters where the destination splits the summed axis; the all-reduce plan "
           "all-reduces, then moves.", "",
           table(["mesh", "completions", "fewer bytes than the all-reduce plan",
                  "total bytes: ours", "total bytes: all-reduce plan",
                  "ours / all-reduce plan"], partial_sum_rows(meshes))]
    if model:
        out += ["", "The PyTorch test transformer (2 blocks, 2x16 tokens, width 256) on 2 ranks, "
                "bytes received per rank per forward:", "",
                table(["plan", "collectives", "bytes/rank", "vs the all-reduce plan"],
                      model_rows(), "llrr")]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--meshes", nargs="*", default=None,
                        help="mesh shapes such as 2 4 2x2 2x4 2x2x2 (default: all five)")
    parser.add_argument("--check", action="store_true",
                        help="only check that every plan of ours meets the lower bound")
    parser.add_argument("--no-min-cost", action="store_true",
                        help="skip DTensor's graph-based planner (the slow part)")
    parser.add_argument("--examples", type=int, default=6,
                        help="transitions listed per mesh where DTensor is worse")
    parser.add_argument("--list", action="store_true", help="list every such transition")
    parser.add_argument("--json", help="also write per-mesh totals to this JSON file")
    parser.add_argument("--no-model", action="store_true",
                        help="skip the transformer's sequence-parallel comparison")
    opts = parser.parse_args(argv)
    meshes = ([tuple(int(v) for v in m.split("x")) for m in opts.meshes] if opts.meshes
              else MESHES)

    if opts.check:
        bad = []
        count = 0
        for mesh in meshes:
            codes = list(itertools.product(range(-1, len(SHAPE)), repeat=len(mesh)))
            for src, dst in itertools.permutations(codes, 2):
                bound, ours, _, _ = _ours(mesh, src, dst)
                count += 1
                if ours != bound:
                    bad.append(f"{_mesh_text(mesh)} {_text(src)} -> {_text(dst)}: "
                               f"{ours} bytes, bound {bound}")
        print("\n".join(bad) if bad else f"OK: all {count} plans meet the lower bound")
        return 1 if bad else 0

    warnings.filterwarnings("ignore")
    logging.getLogger("torch").setLevel(logging.ERROR)
    import torch

    rows = transitions(meshes, min_cost=not opts.no_min_cost)
    print(f"PyTorch {torch.__version__}, tensor {SHAPE} {DTYPE}\n")
    print(report(rows, opts.examples, opts.list))
    print()
    print(partial_report(meshes, model=not opts.no_model))
    if opts.json:
        Path(opts.json).write_text(json.dumps(totals(rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
