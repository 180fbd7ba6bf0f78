"""``auto_shard``: every placement chosen by cost under a memory budget, and why.

:func:`auto_shard` reads ``main`` (:mod:`~tvm_distx.autoshard.extract`), solves
the integer program (:mod:`~tvm_distx.autoshard.ilp`) and annotates the
parameters and inputs with the placements it chose, as a preset would: the
rest of the program follows by propagation. The :class:`AutoShardReport` lists
every chosen placement with its cost terms and memory, the predicted time and
bytes, and the runner-up plans.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
import logging
from typing import Mapping, Sequence

import tvm

from tvm_distx.autoshard.costs import DEFAULT_PROFILE, CostProfile
from tvm_distx.autoshard.extract import check_sizes, extract
from tvm_distx.autoshard.graph import CALL_SITE, ShardGraph
from tvm_distx.autoshard.ilp import Solution, kernel_seconds, solve, evaluate
from tvm_distx.autoshard.pin import pin_values
from tvm_distx.autoshard.realized import propagated_placements, realized_choice
from tvm_distx.compiler.pipeline import legalize_operators
from tvm_distx.errors import RuleError, MemoryBudgetError
from tvm_distx.ir.inline import inline_calls
from tvm_distx.layout.mesh import set_device_meshes
from tvm_distx.layout.rules import ShardingRule, rules_for
from tvm_distx.passes import SplitFusedProjections, AnnotateSharding, PropagateSharding
from tvm_distx.plans import moe
from tvm_distx.plans.patterns import Preset

__all__ = ["AutoShardReport", "auto_shard", "plan_cost"]

logger = logging.getLogger(__name__)


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


@dataclass
class AutoShardReport:
    """What :func:`auto_shard` chose and why.

    Attributes
    ----------
    graph : ShardGraph
        The problem (nodes, strategies, repeated-layer classes).
    solution : Solution
        The chosen plan's strategies and predicted costs.
    placements : dict of str to str
        The placement of every input and parameter of ``main``.
    runner_ups : list of (Solution, dict)
        The next best plans, each with the placements in which it differs.
    objective, memory_per_rank, profile
        What was asked.
    """

    graph: ShardGraph
    solution: Solution
    placements: dict[str, str]
    objective: str
    memory_per_rank: int | None
    profile: CostProfile
    runner_ups: list = field(default_factory=list)

    @property
    def predicted_seconds(self) -> float:
        """Predicted seconds per call: compute plus communication."""
        return self.solution.compute_s + self.solution.comm_s

    @property
    def weight_bytes_per_rank(self) -> int:
        """Parameter bytes one rank holds."""
        return self.solution.weight_bytes

    @property
    def replicated_weight_bytes(self) -> int:
        """Parameter bytes of the whole model."""
        return sum(n.nbytes for n in self.graph.nodes if n.kind == "param")

    @property
    def cache_bytes_per_rank(self) -> int:
        """State bytes one rank holds: the key-value cache (0 without one)."""
        return self.solution.state_bytes

    @property
    def replicated_cache_bytes(self) -> int:
        """State bytes of the whole cache."""
        return sum(self.graph.nodes[i].nbytes for i in self.graph.state)

    @property
    def activation_bytes_per_rank(self) -> int:
        """The largest set of live activations one rank holds at once."""
        return self.solution.activation_bytes

    def preset(self):
        """The chosen placements as a :class:`tvm_distx.plans.presets.Preset` (exact names).

        It applies to every function with these parameter names: a plan of
        ``decode`` serves ``prefill`` (``CausalLM.from_hf(model, plan=report.preset())``).
        """

        return Preset(tuple((name, placement, None) for name, placement in
                            self.placements.items()))

    def collectives(self) -> Counter:
        """How many of each collective the plan runs per call (local slices left out)."""
        count: Counter = Counter()
        for _, _, _, _, _, steps in self.solution.moves:
            for kind, _ in steps:
                if kind != "local_slice":
                    count[kind] += 1
        return count

    def rules(self, function: str = "main") -> list[ShardingRule]:
        """The chosen placements as editable rules (one per input and parameter)."""
        return rules_for({name: (p, None) for name, p in self.placements.items()}, function)

    def rules_data(self, function: str = "main") -> list[dict]:
        """The rules as the CLI's ``--rules`` files spell them (JSON or YAML)."""
        return [{"param": name, "result": placement, "function": function}
                for name, placement in self.placements.items()]

    def reasons(self) -> list[tuple[str, str, str]]:
        """``(value, placement, reason)`` for every input and parameter.

        The reason gives the bytes the rank holds, the strategies of the
        value's users (their arithmetic per rank) and what moves it.
        """
        g, sol = self.graph, self.solution
        users: dict[int, list[int]] = {}
        for index, node in enumerate(g.nodes):
            for operand in node.operands:
                users.setdefault(operand, []).append(index)
        moved: dict[int, list[str]] = {}
        for value, src, dst, nbytes, seconds, steps in sol.moves:
            kinds = "+".join(k for k, _ in steps)
            moved.setdefault(value, []).append(f"{kinds} {src}->{dst} ({nbytes} B, "
                                               f"{seconds * 1e6:.1f} us)")
        rows = []
        for index, node in enumerate(g.nodes):
            if node.kind not in ("input", "param"):
                continue
            st = g.strategies[index][sol.choice[index]]
            held = g.local_bytes(index, st)
            parts = [f"holds {held} of {node.nbytes} B"]
            for u in users.get(index, [])[:2]:
                target = u
                while g.nodes[target].view and users.get(target):  # through transposes
                    target = users[target][0]
                ust = g.strategies[target][sol.choice[target]]
                seconds = kernel_seconds(g, target, ust, self.profile)
                parts.append(f"{g.nodes[target].op.removeprefix('relax.')} "
                             f"{g.nodes[target].name} runs {ust.out} on 1/{ust.parts} "
                             f"({seconds * 1e6:.1f} us)")
            parts += moved.get(index, [])
            rows.append((node.name, st.out, "; ".join(parts)))
        return rows

    def __str__(self) -> str:
        sol = self.solution
        lines = [
            f"auto_shard on a {self.graph.mesh_shape} mesh, objective {self.objective}, "
            f"profile {self.profile.name}"
            + (f", {self.graph.layers} identical layers solved once" if self.graph.layers else "")
            + ("".join(f", {k}={v}" for k, v in self.graph.sizes.items())),
            f"  predicted: {self.predicted_seconds * 1e3:.3f} ms per call "
            f"(compute {sol.compute_s * 1e3:.3f} ms, communication {sol.comm_s * 1e3:.3f} ms), "
            f"{sol.comm_bytes} B received per rank",
            f"  memory per rank: weights {_mib(sol.weight_bytes)} of "
            f"{_mib(self.replicated_weight_bytes)}"
            + (f", cache {_mib(sol.state_bytes)} of {_mib(self.replicated_cache_bytes)}"
               if self.graph.state else "")
            + f", activations {_mib(sol.activation_bytes)}, peak {_mib(sol.peak_bytes)}"
            + (f" (budget {_mib(self.memory_per_rank)})" if self.memory_per_rank else ""),
            "  collectives: " + (", ".join(f"{n} {k}" for k, n in
                                             sorted(self.collectives().items())) or "none"),
            f"  solver: {sol.status}, gap {sol.gap:.2g}, {sol.seconds:.2f} s, "
            f"{sol.variables} variables",
            "  value  placement  reason",
        ]
        lines += [f"  {name}  {placement}  {reason}" for name, placement, reason in self.reasons()]
        for rank, (other, diff) in enumerate(self.runner_ups, start=2):
            shown = ", ".join(f"{k} {v}" for k, v in list(diff.items())[:6])
            more = f" (+{len(diff) - 6} more)" if len(diff) > 6 else ""
            lines.append(f"  plan #{rank}: {(other.compute_s + other.comm_s) * 1e3:.3f} ms, "
                         f"weights {_mib(other.weight_bytes)}; differs: {shown}{more}")
        return "\n".join(lines)


def _fixed_from_rules(graph: ShardGraph, rules, mod: tvm.IRModule, function: str,
                      fill: str | None = None) -> dict[int, str]:
    """Node id -> placement for the parameter rules (and ``fill`` for every other parameter)."""
    if hasattr(rules, "rules"):  # a preset
        rules = rules.rules(mod, function)
    by_name = {node.name: i for i, node in enumerate(graph.nodes)
               if node.kind in ("input", "param")}
    fixed: dict[int, str] = {}
    for rule in rules:
        if not isinstance(rule, ShardingRule) or rule.kind != "param":
            raise RuleError(f"auto_shard takes parameter rules only, got {rule!r}",
                            hint="write ShardingRule(param='name', result='S[0]') for each "
                            "placement auto_shard must keep")
        if rule.function not in (None, function):
            continue
        if rule.param not in by_name:
            raise RuleError(f"auto_shard: no input or parameter {rule.param!r} in {function!r}",
                            var=rule.param, function=function,
                            hint="the names: " + ", ".join(list(by_name)[:8]) + ", ...")
        fixed[by_name[rule.param]] = str(rule.result)
    if fill is not None:
        for name, index in by_name.items():
            if graph.nodes[index].kind == "param":
                fixed.setdefault(index, fill * len(graph.mesh_shape))
    per_class: dict[int, set[str]] = {}
    for index in by_name.values():
        per_class.setdefault(graph.classes[index], set()).add(fixed.get(index, ""))
    if any(len(texts) > 1 for texts in per_class.values()):
        logger.info("the rules place the layers differently: each layer is solved on its own")
        graph.separate_layers()
    return fixed


def _with_mesh(mod: tvm.IRModule, mesh_shape: tuple[int, ...]) -> tvm.IRModule:
    meshes = mod.global_infos.get("mesh") if mod.global_infos else None
    if meshes:
        if len(meshes) != 1 or tuple(int(s) for s in meshes[0].shape) != tuple(mesh_shape):
            raise RuleError(f"auto_shard: the module's meshes differ from mesh_shape "
                            f"{tuple(mesh_shape)}",
                            hint="pass a module without meshes, or its one mesh's shape")
        return mod
    return set_device_meshes(mod, [tuple(mesh_shape)])


def _split_fused(mod: tvm.IRModule, function: str) -> tvm.IRModule:
    """``mod`` with its fused projections cut per segment, as the tensor-parallel preset cuts them.

    A fused projection (GPT-2's ``c_attn``, a gate|up weight) split evenly
    puts a rank boundary inside a segment; one parameter per segment
    (:class:`tvm_distx.passes.SplitFusedProjections`) lets each be split like
    any other weight. The executable cuts the segments from the user's weight.
    Expert weights are left fused (their plan cuts them when it splits them).
    """

    if moe.expert_weights(mod, function):
        return mod
    return SplitFusedProjections()(mod)


def auto_shard(mod: tvm.IRModule, mesh_shape: Sequence[int], *,
               memory_per_rank: int | None = None, objective: str = "latency",
               rules: Sequence[ShardingRule] = (), profile: CostProfile | None = None,
               time_limit: float = 30.0, runner_ups: int = 2, pin: bool = True,
               function: str = "main", sizes: Mapping[str, int] | None = None
               ) -> tuple[tvm.IRModule, AutoShardReport]:
    """Choose every placement of ``mod`` by cost, under a memory budget.

    Parameters
    ----------
    mod : tvm.IRModule
        A module as :func:`tvm_distx.from_torch` gives it (before ``LegalizeOps``),
        with static shapes. Fused projections are first cut into one weight per
        segment (:class:`tvm_distx.passes.SplitFusedProjections`); the rules and
        the report then name the segments (``..._seg0``).
    mesh_shape : sequence of int
        The device mesh, e.g. ``(2,)`` or ``(2, 2)``.
    memory_per_rank : int, optional
        Bytes per rank for weights, state and live activations. State is an
        input the function returns updated (a key-value cache: ``decode``
        of :func:`tvm_distx.export_decoder`); it counts once, its new value
        included, keeps one placement across the call, and no collective
        touches it.
    objective : {"latency", "throughput"}
        ``"latency"``: the time of one call, each message paying its start-up;
        ``"throughput"``: arithmetic and bytes only (start-ups overlap other
        batches).
    rules : sequence of ShardingRule or a preset
        Parameter rules the plan must keep (hard constraints).
    profile : CostProfile, optional
        The machine; :data:`~tvm_distx.autoshard.costs.DEFAULT_PROFILE` when omitted.
    time_limit : float
        Seconds the solver may take per plan; past it the best plan found is
        used and the report gives the optimality gap.
    runner_ups : int
        How many next-best plans (differing in some parameter or input) to report.
    pin : bool
        Also annotate the values inside the function with the placements the
        solver chose (on the legalized module), so that the program runs the
        plan that was costed. With False only the inputs and parameters are
        annotated, as a preset does, and propagation chooses the rest.
    function : str
        The function to plan.
    sizes : mapping of str to int, optional
        The example size of each symbolic (run-time) extent to price the plan
        at (``sizes={"seq": 128}``); a variable left out is priced at its upper
        bound (``tir_var_upper_bound``, which ``from_torch`` writes from
        ``torch.export.Dim(max=...)``). No strategy splits a symbolic extent and
        no collective other than a completing all-reduce moves a value that has
        one, so the rules serve every size.

    Returns
    -------
    (tvm.IRModule, AutoShardReport)
        The module with its mesh and the chosen placements annotated (legalized
        when ``pin``), and the report.

    Raises
    ------
    MemoryBudgetError
        When no plan fits ``memory_per_rank``.
    SymbolicExtentError
        When a symbolic extent has no size in ``sizes`` and no upper bound.
    RuleError
        For a rule that is not a parameter rule, or a placement a tensor cannot take.

    Examples
    --------
    >>> annotated, report = auto_shard(mod, (2,), memory_per_rank=64 << 20)
    >>> print(report)
    """

    profile = profile or DEFAULT_PROFILE
    mesh_shape = tuple(int(n) for n in mesh_shape)
    if function not in [gv.name_hint for gv in mod.functions]:
        raise RuleError(f"auto_shard(function={function!r}): the module has no such function",
                        function=function, hint="its functions: " + ", ".join(
                            sorted(gv.name_hint for gv in mod.functions)),
                        cli_hint="pick one with --function")
    check_sizes(mod[function], function, sizes or {})

    meshed, legal, graph = _planned_graph(mod, mesh_shape, function, sizes)
    fixed = _fixed_from_rules(graph, rules, meshed, function)
    options = dict(profile=profile, objective=objective, memory_per_rank=memory_per_rank,
                   fixed=fixed, time_limit=time_limit)
    best = solve(graph, **options)
    report_nodes = [i for i, n in enumerate(graph.nodes) if n.kind in ("input", "param")]
    placements = {graph.nodes[i].name: graph.strategies[i][best.choice[i]].out
                  for i in report_nodes}
    others = _runner_ups(graph, best, options, report_nodes, runner_ups)
    report = AutoShardReport(graph, best, placements, objective, memory_per_rank, profile,
                             others)
    logger.info("%s", report)
    if not pin:
        return AnnotateSharding(report.rules(function))(meshed), report
    pinned = _pin_chosen(legal, graph, best, function)
    return AnnotateSharding(report.rules(function))(pinned), report


def _planned_graph(mod: tvm.IRModule, mesh_shape: tuple[int, ...], function: str,
                   sizes: Mapping[str, int] | None
                   ) -> tuple[tvm.IRModule, tvm.IRModule, ShardGraph]:
    """The module on its mesh (fused projections split), its legalized form with the calls
    inlined, and the graph the solver plans from that form."""
    meshed = _split_fused(_with_mesh(mod, mesh_shape), function)
    # calls to private functions planned through: each call site priced on its own operands,
    # its values named <name>__call<k> (CALL_SITE) so that repeated sites are solved once
    inlined, sites = inline_calls(meshed, function, CALL_SITE)
    if sites:
        logger.info("auto_shard: %s calls private functions at %d sites; planned through the "
                    "calls (inlined)", function, sites)
    legal = legalize_operators(inlined, fuse=False)
    graph = extract(legal, mesh_shape, function, legalized=True, sizes=sizes)
    return meshed, legal, graph


def _runner_ups(graph: ShardGraph, best: Solution, options: dict, report_nodes: list[int],
                runner_ups: int) -> list[tuple[Solution, dict[str, str]]]:
    """Up to ``runner_ups`` next-best plans, each with the placements it changes.

    They differ from the best, and from each other, in an input or a weight of some size,
    not in a bias alone; a plan that comes back equal to one seen once tidied is skipped.
    """
    total = sum(graph.nodes[i].nbytes for i in report_nodes)
    key_nodes = [i for i in report_nodes
                 if graph.nodes[i].kind == "input" or graph.nodes[i].nbytes * 100 >= total]
    seen = [{i: best.choice[i] for i in key_nodes}, {i: best.raw_choice[i] for i in key_nodes}]
    others: list = []
    for _ in range(5 * runner_ups):  # a plan may come back equal to one seen once tidied
        if len(others) == runner_ups:
            break
        try:
            other = solve(graph, **options, exclude=list(seen))
        except Exception as err:  # noqa: BLE001 - no further plan is not an error
            logger.info("no runner-up plan: %s", err)
            break
        mine = {i: other.choice[i] for i in key_nodes}
        if mine in seen:
            seen.append({i: other.raw_choice[i] for i in key_nodes})
            continue
        seen.append(mine)
        diff = {graph.nodes[i].name: graph.strategies[i][other.choice[i]].out
                for i in report_nodes if other.choice[i] != best.choice[i]}
        others.append((other, diff))
    return others


def _pin_chosen(legal: tvm.IRModule, graph: ShardGraph, best: Solution,
                function: str) -> tvm.IRModule:
    """``legal`` with the solver's placements pinned: every value that is not a partial sum,
    every move the solver costed for a call (its operand as that call reads it), and the
    inputs and parameters as held."""
    pins, reads = {}, {}
    chosen = [graph.strategies[i][best.choice[i]] for i in range(len(graph.nodes))]
    for index, node in enumerate(graph.nodes):
        if node.kind != "op" or node.labels is None:
            continue
        if "P" not in chosen[index].out:
            pins[graph.variables[index]] = chosen[index].out
        for operand, wanted in zip(node.operands, chosen[index].ins):
            held = chosen[operand].out
            if wanted != held and "P" not in held:  # a move the solver costed for this call
                reads.setdefault(graph.variables[index], {})[graph.variables[operand]] = wanted
    held = {graph.variables[i]: chosen[i].out for i, node in enumerate(graph.nodes)
            if node.kind in ("input", "param")}
    return pin_values(legal, pins, function, reads, held)


def plan_cost(mod: tvm.IRModule, mesh_shape: Sequence[int], rules, *,
              objective: str = "latency", profile: CostProfile | None = None,
              memory_per_rank: int | None = None, function: str = "main",
              time_limit: float = 30.0, sizes: Mapping[str, int] | None = None) -> Solution:
    """The predicted cost of a hand-written plan (a preset or parameter rules), as it runs.

    The plan is applied as :func:`tvm_distx.compile` would apply it (a preset's
    ``apply``, which may first cut fused projections; rules through
    :class:`tvm_distx.passes.AnnotateSharding`) and propagated; every value
    then has the placement propagation gave it, and the plan is priced by
    :func:`tvm_distx.autoshard.ilp.evaluate` with the model :func:`auto_shard`
    minimises (:mod:`tvm_distx.autoshard.realized`). Compare with
    :attr:`AutoShardReport.solution` to see what :func:`auto_shard` gains.
    ``sizes`` prices symbolic extents as :func:`auto_shard` does.

    Raises
    ------
    MemoryBudgetError
        When the plan does not fit ``memory_per_rank`` (its weights plus the
        live activations at some point of the program exceed it).
    """

    del time_limit  # nothing is solved: the program is read
    mesh_shape = tuple(int(n) for n in mesh_shape)
    meshed = _with_mesh(mod, mesh_shape)
    if hasattr(rules, "apply"):  # a preset
        prepared = rules.prepare(meshed, function) if hasattr(rules, "prepare") else meshed
        annotated = rules.apply(meshed, function)
    else:
        prepared, annotated = meshed, AnnotateSharding(list(rules))(meshed)
    graph = extract(prepared, mesh_shape, function, sizes=sizes)
    propagated = PropagateSharding(require_legalized=True)(
        legalize_operators(annotated, fuse=False))
    choice = realized_choice(graph, propagated_placements(propagated, function))
    solution = evaluate(graph, choice, profile=profile or DEFAULT_PROFILE, objective=objective)
    if memory_per_rank is not None and solution.peak_bytes > memory_per_rank:
        raise MemoryBudgetError(
            f"plan_cost: the plan needs {solution.peak_bytes} bytes per rank (weights "
            f"{solution.weight_bytes}), over the budget of {memory_per_rank} on a {mesh_shape} "
            "mesh", hint="raise memory_per_rank or split more weights")
    return solution
