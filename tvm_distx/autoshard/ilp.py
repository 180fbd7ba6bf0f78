"""Choosing every strategy at once: the integer linear program and its exact cost model.

The program (Alpa's formulation, with the redistributions shared per value):

* one binary ``x[c, s]`` per class ``c`` of nodes and strategy ``s``, one-hot per
  class (:class:`tvm_distx.autoshard.graph.ShardGraph` puts the same node of
  every repeated layer in one class);
* **compute**: per node, its kernel's roofline time on the local shapes the
  strategy gives (:func:`kernel_seconds`), times the nodes in its class;
* **redistribution**: per edge from a value to a user, ``e[p, q]`` (continuous)
  has the producer's placement indicators as one marginal and the user's
  wanted-placement indicators as the other, so it is 1 exactly on the move
  that runs (a tight linearisation of the product). A value moved to ``q`` for
  several users is moved once: ``m[p, q] >= e_u[p, q]`` for every user carries
  the cost, the planner's bytes over the bandwidth plus the start-up of each
  message (:func:`tvm_distx.autoshard.costs.step_messages`), plus the local
  packing a collective on an inner dimension needs (:func:`planner_reshard`);
* **memory**: at every program point, the weights, the state (a key-value
  cache: ``ShardGraph.state``, counted once for the whole call, its new value
  included) and the live activations on one device stay under
  ``memory_per_rank`` (equal constraints of repeated layers are kept once);
* **state**: a state input and the result returning it have one placement,
  and no collective moves either (the attention that writes the cache reads it
  where it is held);
* **objective**: ``"latency"`` minimises compute + communication of one call,
  each message paying its start-up; ``"throughput"`` leaves the start-up out
  (with batches in flight it overlaps other work) and counts arithmetic and
  bytes only;
* **rules**: a fixed placement is a hard constraint (every other strategy of
  that node is forbidden).

HiGHS (:func:`scipy.optimize.milp`) solves it; with a time limit the best plan
found and the optimality gap are returned.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import functools
import logging
import time
from typing import Callable, Mapping

import numpy as np

from tvm_distx.autoshard.costs import DEFAULT_PROFILE, CostProfile, step_messages
from tvm_distx.autoshard.graph import ShardGraph, itemsize
from tvm_distx.errors import ArgumentError, MemoryBudgetError, RuleError, UnsupportedProgramError
from tvm_distx.layout import TensorSharding
from tvm_distx.layout.mesh import DeviceMesh
from tvm_distx.legalize.planner import plan_redistribute

__all__ = ["Reshard", "Solution", "evaluate", "kernel_seconds", "planner_reshard", "solve"]

logger = logging.getLogger(__name__)

#: ``(shape, dtype, src, dst, mesh_shape) -> (bytes received per rank,
#: [(collective, group), ...], bytes copied locally per rank)``
Reshard = Callable[[tuple, str, str, str, tuple],
                   "tuple[int, tuple[tuple[str, int], ...], int]"]


@functools.lru_cache(maxsize=65536)
def planner_reshard(shape: tuple, dtype: str, src: str, dst: str,
                    mesh_shape: tuple) -> tuple[int, tuple[tuple[str, int], ...], int]:
    """The planner's bytes and steps for one redistribution (cached), and its local copies.

    The runtime hands a collective contiguous blocks: an all-gather or a
    reduce-scatter along a dimension with a dimension of more than one element
    before it packs or unpacks the whole local tensor once, and an all-to-all
    packs its input and unpacks its output. Those bytes are the third value.
    """

    mesh = DeviceMesh(tuple(mesh_shape), range(0, int(np.prod(mesh_shape))))
    plan = plan_redistribute(TensorSharding(mesh, src), TensorSharding(mesh, dst), shape, dtype)
    steps = tuple((s.collective.value, mesh_shape[s.mesh_axis] if s.mesh_axis is not None
                   else int(np.prod(mesh_shape))) for s in plan.steps)
    copied = 0
    for step in plan.steps:
        kind = step.collective.value
        if kind not in ("all_gather", "reduce_scatter", "all_to_all") or not step.tensor_axes:
            continue
        src_local = step.src.local_shape(tuple(shape))
        dst_local = step.dst.local_shape(tuple(shape))
        size = itemsize(dtype)
        if kind == "all_to_all":
            copied += (int(np.prod(src_local)) + int(np.prod(dst_local))) * size
        elif int(np.prod(src_local[:step.tensor_axes[0]])) > 1:
            copied += max(int(np.prod(src_local)), int(np.prod(dst_local))) * size
    return plan.bytes_received, steps, copied


@dataclass
class Solution:
    """The chosen strategy of every node and what it costs.

    Attributes
    ----------
    choice : list of int
        Per node, the index of its strategy in ``graph.strategies[node]``.
    compute_s, comm_s : float
        Predicted seconds of arithmetic and of communication per call.
    comm_bytes : int
        Bytes received per rank per call.
    weight_bytes : int
        Parameter bytes held per rank.
    peak_bytes : int
        Weights, state and the largest set of live activations, per rank.
    objective : float
        The objective's value (seconds).
    status : str
        ``"optimal"`` or ``"time limit"``.
    gap : float
        The relative optimality gap HiGHS reports (0 when optimal).
    seconds : float
        Solver wall time.
    moves : list of tuple
        ``(value node, src, dst, bytes, seconds, collectives)`` of every redistribution.
    """

    choice: list[int]
    compute_s: float
    comm_s: float
    comm_bytes: int
    weight_bytes: int
    peak_bytes: int
    objective: float
    status: str = "optimal"
    gap: float = 0.0
    seconds: float = 0.0
    moves: list = field(default_factory=list)
    variables: int = 0
    raw_choice: list = field(default_factory=list)
    #: state bytes held per rank (the key-value cache)
    state_bytes: int = 0

    @property
    def activation_bytes(self) -> int:
        """The largest set of live activations per rank (the peak less weights and state)."""
        return self.peak_bytes - self.weight_bytes - self.state_bytes


class _Builder:
    """Columns and rows of a MILP, built incrementally."""

    def __init__(self) -> None:
        self.cost: list[float] = []
        self.integral: list[int] = []
        self.upper: list[float] = []
        self.rows: list[dict[int, float]] = []
        self.lo: list[float] = []
        self.hi: list[float] = []

    def var(self, cost: float = 0.0, binary: bool = False, upper: float = np.inf) -> int:
        self.cost.append(cost)
        self.integral.append(1 if binary else 0)
        self.upper.append(1.0 if binary else upper)
        return len(self.cost) - 1

    def row(self, coeffs: Mapping[int, float], lo: float, hi: float) -> None:
        self.rows.append(dict(coeffs))
        self.lo.append(lo)
        self.hi.append(hi)

    def solve(self, time_limit: float):
        try:
            from scipy.optimize import Bounds, LinearConstraint, milp
            from scipy.sparse import coo_matrix
        except ImportError:
            raise ArgumentError(
                "automatic sharding solves an integer program with scipy, which is not "
                "installed", hint='pip install "tvm-distx[auto]" (or the hf or test extra)'
            ) from None

        data, rows, cols = [], [], []
        for r, coeffs in enumerate(self.rows):
            for c, v in coeffs.items():
                rows.append(r)
                cols.append(c)
                data.append(v)
        n = len(self.cost)
        a = coo_matrix((data, (rows, cols)), shape=(len(self.rows), n)).tocsr()
        constraints = [LinearConstraint(a, np.array(self.lo), np.array(self.hi))] if self.rows \
            else []
        return milp(np.array(self.cost), integrality=np.array(self.integral),
                    bounds=Bounds(np.zeros(n), np.array(self.upper)), constraints=constraints,
                    options={"time_limit": float(time_limit), "disp": False})


def _users(graph: ShardGraph) -> list[list[tuple[int, int]]]:
    users: list[list[tuple[int, int]]] = [[] for _ in graph.nodes]
    for index, node in enumerate(graph.nodes):
        for slot, operand in enumerate(node.operands):
            users[operand].append((index, slot))
    return users


#: The steps a value with a run-time extent may take (the legalizer moves no symbolic
#: extent between ranks; partial sums are completed in place).
SYMBOLIC_MOVES = frozenset({"local_slice", "all_reduce"})


def _collective(node, src: str, dst: str, mesh: tuple, reshard: Reshard,
                allowed: frozenset = frozenset({"local_slice"})) -> bool:
    """Whether moving ``node`` from ``src`` to ``dst`` takes a step not in ``allowed``."""
    if src == dst:
        return False
    steps = reshard(node.shape, node.dtype, src, dst, mesh)[1]
    return any(kind not in allowed for kind, _ in steps)


def _last_use(graph: ShardGraph, users) -> list[int]:
    last = [max([u for u, _ in users[i]] + [i]) for i in range(len(graph.nodes))]
    for out in graph.outputs:
        last[out] = len(graph.nodes)
    for index in range(len(graph.nodes) - 1, -1, -1):  # a view keeps its source alive
        node = graph.nodes[index]
        if node.view:
            for operand in node.operands:
                last[operand] = max(last[operand], last[index])
    return last


def solve(graph: ShardGraph, *, profile: CostProfile = DEFAULT_PROFILE,
          objective: str = "latency", memory_per_rank: int | None = None,
          fixed: Mapping[int, str] | None = None, exclude: list[dict[int, int]] = (),
          time_limit: float = 30.0, reshard: Reshard = planner_reshard) -> Solution:
    """The cheapest strategy of every node.

    Parameters
    ----------
    graph : ShardGraph
    profile : CostProfile
    objective : {"latency", "throughput"}
    memory_per_rank : int, optional
        Bytes per device for weights, state and live activations.
    fixed : mapping of node id to placement text, optional
        Hard constraints: these nodes' results have these placements.
    exclude : list of dict
        Plans to skip (node id -> strategy index over some nodes): the solution
        differs from each in at least one of those nodes (runner-up plans).
    time_limit : float
        Seconds HiGHS may take; the best plan found so far is returned.
    reshard : callable
        Bytes and steps of one redistribution (the planner's by default).

    Raises
    ------
    RuleError
        When a fixed placement is not a strategy of its node.
    UnsupportedProgramError
        When the time limit passes before any plan is found.
    MemoryBudgetError
        When no plan fits (the memory budget is too small).
    """
    if objective not in ("latency", "throughput"):
        raise RuleError(f"auto_shard(objective={objective!r}): unknown objective",
                        hint='use objective="latency" or objective="throughput"')
    start = time.perf_counter()
    fixed = dict(fixed or {})
    b = _Builder()
    x, compute_terms = _strategy_columns(b, graph, profile)
    _fixed_rows(b, graph, x, fixed)
    _complete_output_rows(b, graph, x)
    _state_rows(b, graph, x)
    for plan in exclude:
        picked = {x[graph.classes[n]][s] for n, s in plan.items()}  # one column per class
        b.row({col: 1.0 for col in picked}, -np.inf, len(picked) - 1.0)
    users = _users(graph)
    comm_terms = _redistribution_terms(b, graph, x, users, profile, objective, reshard)
    if memory_per_rank is not None:
        _memory_rows(b, graph, x, users, memory_per_rank)

    scale = 1e3  # milliseconds keep HiGHS's tolerances meaningful
    for col, v in list(compute_terms.items()) + list(comm_terms.items()):
        b.cost[col] += scale * v
    res = _solved(b, graph, time_limit, memory_per_rank)
    choice = [int(np.argmax([res.x[col] for col in x[graph.classes[index]]]))
              for index in range(len(graph.nodes))]
    raw_choice = list(choice)
    _hold_less(graph, choice, users, {**fixed, **dict.fromkeys(graph.state_nodes(), "")},
               reshard)
    solution = evaluate(graph, choice, profile=profile, objective=objective, users=users,
                        reshard=reshard)
    solution.raw_choice = raw_choice
    solution.status = "optimal" if res.status == 0 else "time limit"
    solution.gap = float(getattr(res, "mip_gap", 0.0) or 0.0)
    solution.seconds = time.perf_counter() - start
    solution.variables = len(b.cost)
    logger.info("auto_shard ILP: %d variables, %d rows, %s in %.2f s (gap %.3g)", len(b.cost),
                len(b.rows), solution.status, solution.seconds, solution.gap)
    return solution


def _strategy_columns(b: _Builder, graph: ShardGraph,
                      profile: CostProfile) -> tuple[dict[int, list[int]], dict[int, float]]:
    """The binaries ``x[c, s]``, one-hot per class, and their compute seconds (per column:
    the kernel's time under the strategy, times the nodes of the class)."""
    count: dict[int, int] = {}
    for c in graph.classes:
        count[c] = count.get(c, 0) + 1
    x: dict[int, list[int]] = {}
    compute_terms: dict[int, float] = {}
    for c in sorted(count):
        columns = []
        for s, strategy in enumerate(graph.strategies[c]):
            column = b.var(binary=True)
            compute_terms[column] = count[c] * kernel_seconds(graph, c, strategy, profile)
            columns.append(column)
        x[c] = columns
        b.row({col: 1.0 for col in columns}, 1.0, 1.0)
    return x, compute_terms


def _fixed_rows(b: _Builder, graph: ShardGraph, x: dict[int, list[int]],
                fixed: Mapping[int, str]) -> None:
    """The rules: each fixed node takes one of the strategies giving its placement."""
    classes = graph.classes
    for node, text in fixed.items():
        c = classes[node]
        allowed = [s for s, st in enumerate(graph.strategies[c]) if st.out == text]
        if not allowed:
            raise RuleError(f"auto_shard: {graph.nodes[node].name!r} cannot be {text!r} on a "
                            f"{tuple(graph.mesh_shape)} mesh", placement=text,
                            hint="the placements it can take: " + ", ".join(
                                sorted({st.out for st in graph.strategies[c]})))
        b.row({x[c][s]: 1.0 for s in allowed}, 1.0, 1.0)


def _complete_output_rows(b: _Builder, graph: ShardGraph, x: dict[int, list[int]]) -> None:
    """A result is returned complete, never as partial sums."""
    for out in graph.outputs:
        c = graph.classes[out]
        bad = [x[c][s] for s, st in enumerate(graph.strategies[c]) if "P" in st.out]
        if bad:
            b.row({col: 1.0 for col in bad}, 0.0, 0.0)


def _state_rows(b: _Builder, graph: ShardGraph, x: dict[int, list[int]]) -> None:
    """A state's new value has the placement the next call reads it in: per placement, the
    state input takes it exactly when the new value does."""
    classes = graph.classes
    for value, new in graph.state.items():
        if value == new:
            continue
        a, c = classes[value], classes[new]
        texts = {st.out for st in graph.strategies[a]} | {st.out for st in graph.strategies[c]}
        for text in sorted(texts):  # sorted: the same program whatever the hash seed
            row = {x[a][s]: 1.0 for s, st in enumerate(graph.strategies[a]) if st.out == text}
            for s, st in enumerate(graph.strategies[c]):
                if st.out == text:
                    row[x[c][s]] = row.get(x[c][s], 0.0) - 1.0
            b.row(row, 0.0, 0.0)


def _unmoved_classes(graph: ShardGraph) -> tuple[set[int], set[int]]:
    """The classes of the state and its views (a head axis added), which no collective
    touches, and those with a run-time extent, which a kernel keeps where it is (partial
    sums are completed in place)."""
    untouched = graph.state_nodes()
    for index, node in enumerate(graph.nodes):
        if node.view and any(o in untouched for o in node.operands):
            untouched.add(index)
    state_classes = {graph.classes[i] for i in untouched}
    dynamic_classes = {graph.classes[i] for i, node in enumerate(graph.nodes) if node.dynamic}
    return state_classes, dynamic_classes


def _redistribution_terms(b: _Builder, graph: ShardGraph, x: dict[int, list[int]], users,
                          profile: CostProfile, objective: str,
                          reshard: Reshard) -> dict[int, float]:
    """The moves between producers and users, shared per value, grouped by the classes of
    the value's users; returns each paying column's seconds."""
    mesh = tuple(graph.mesh_shape)
    state_classes, dynamic_classes = _unmoved_classes(graph)
    comm_terms: dict[int, float] = {}
    for (c, user_slots), n in _groups(graph, users).items():
        node = graph.nodes[c]
        gives: dict[str, list[int]] = {}
        for s, st in enumerate(graph.strategies[c]):
            gives.setdefault(st.out, []).append(x[c][s])
        shared: dict[tuple[str, str], int] = {}
        for u, slot in user_slots:
            needs: dict[str, list[int]] = {}
            for s, st in enumerate(graph.strategies[u]):
                needs.setdefault(st.ins[slot], []).append(x[u][s])
            e = _transport(b, gives, needs)
            for (p, q), col in e.items():
                if c in state_classes and _collective(node, p, q, mesh, reshard) or \
                        c in dynamic_classes and _collective(node, p, q, mesh, reshard,
                                                             SYMBOLIC_MOVES):
                    b.upper[col] = 0.0  # no collective touches the cache or a run-time extent
                    continue
                seconds = _move_seconds(node, p, q, mesh, profile, objective, reshard)
                if seconds <= 0:
                    continue
                if len(user_slots) == 1:
                    comm_terms[col] = n * seconds
                    continue
                if (p, q) not in shared:  # one move serves every user wanting q
                    shared[p, q] = b.var(upper=1.0)
                    comm_terms[shared[p, q]] = n * seconds
                b.row({shared[p, q]: 1.0, col: -1.0}, 0.0, np.inf)
    return comm_terms


def _transport(b: _Builder, gives: dict[str, list[int]],
               needs: dict[str, list[int]]) -> dict[tuple[str, str], int]:
    """``e[p, q]`` between the producer's placements and one user's: its marginals are the
    producer's and the user's indicators (tight), so it is 1 on the move that runs."""
    e = {(p, q): b.var(upper=1.0) for p in gives for q in needs}
    for p, cols in gives.items():
        row = {e[p, q]: 1.0 for q in needs}
        for col in cols:
            row[col] = row.get(col, 0.0) - 1.0
        b.row(row, 0.0, 0.0)
    for q, cols in needs.items():
        row = {e[p, q]: 1.0 for p in gives}
        for col in cols:
            row[col] = row.get(col, 0.0) - 1.0
        b.row(row, 0.0, 0.0)
    return e


def _memory_rows(b: _Builder, graph: ShardGraph, x: dict[int, list[int]], users,
                 memory_per_rank: int) -> None:
    """Weights + state + live activations at every program point fit ``memory_per_rank``
    (equal rows, as repeated layers give, kept once)."""
    classes = graph.classes
    weight_row: dict[int, float] = {}
    state = graph.state_nodes()
    for index, node in enumerate(graph.nodes):
        if node.kind == "param" or index in graph.state:
            c = classes[index]
            for s, st in enumerate(graph.strategies[c]):
                col = x[c][s]
                weight_row[col] = weight_row.get(col, 0.0) + graph.local_bytes(c, st)
    last = _last_use(graph, users)
    seen: set = set()
    live: set[int] = set()
    for point, node in enumerate(graph.nodes):
        if node.kind != "param" and not node.view and point not in state:
            live.add(point)
        live = {v for v in live if last[v] >= point}
        if node.kind != "op":
            continue
        row = dict(weight_row)
        for value in live:
            c = classes[value]
            for s, st in enumerate(graph.strategies[c]):
                col = x[c][s]
                row[col] = row.get(col, 0.0) + graph.local_bytes(c, st)
        key = tuple(sorted(row.items()))
        if key not in seen:
            seen.add(key)
            b.row(row, -np.inf, float(memory_per_rank))


def _solved(b: _Builder, graph: ShardGraph, time_limit: float, memory_per_rank: int | None):
    """HiGHS's result for the program; no plan found in time, or none fitting, is an error."""
    mesh = tuple(graph.mesh_shape)
    res = b.solve(time_limit)
    if res.x is None and res.status == 1:
        raise UnsupportedProgramError(
            f"auto_shard: no plan found within the time limit of {time_limit} s on a {mesh} "
            "mesh", hint="raise time_limit", cli_hint="raise --time-limit")
    if res.x is None:
        priced = ", ".join(f"{k}={v}" for k, v in graph.sizes.items())
        raise MemoryBudgetError(
            f"auto_shard: no plan fits {memory_per_rank} bytes per rank on a {mesh} mesh "
            f"({res.message})" + (f", run-time extents priced at {priced}" if priced else ""),
            hint="raise memory_per_rank, use a larger mesh, or relax the rules"
            + (", or price the run-time extents at smaller sizes (sizes={...})"
               if priced else ""),
            cli_hint="raise --memory, use a larger --mesh, or relax --rules"
            + (", or give smaller --size NAME=INT" if priced else ""))
    return res


def _hold_less(graph: ShardGraph, choice: list[int], users, fixed: Mapping[int, str],
               reshard: Reshard) -> None:
    """Among plans of equal cost, hold less: an input or parameter whose users all
    slice it the same way locally (a free move) is held sliced instead."""
    members: dict[int, list[int]] = {}
    for index, node in enumerate(graph.nodes):
        if node.kind in ("input", "param") and index not in fixed:
            members.setdefault(graph.classes[index], []).append(index)
    for c, indices in members.items():
        src = graph.strategies[c][choice[c]].out
        wants = {graph.strategies[u][choice[u]].ins[slot] for i in indices for u, slot in users[i]}
        if len(wants) != 1 or src in wants:
            continue
        dst = wants.pop()
        node = graph.nodes[c]
        if not all(k == "local_slice" for k, _ in
                   reshard(node.shape, node.dtype, src, dst, tuple(graph.mesh_shape))[1]):
            continue
        better = [s for s, st in enumerate(graph.strategies[c]) if st.out == dst]
        if better:
            for i in indices:
                choice[i] = better[0]


def _groups(graph: ShardGraph, users) -> dict[tuple, int]:
    """Values by (class, the classes and slots of their users): how many of each."""
    groups: dict[tuple, int] = {}
    for value in range(len(graph.nodes)):
        if users[value]:
            classes = graph.classes
            key = (classes[value], tuple(sorted({(classes[u], slot) for u, slot in users[value]})))
            groups[key] = groups.get(key, 0) + 1
    return groups


def kernel_seconds(graph: ShardGraph, index: int, strategy, profile: CostProfile) -> float:
    """Seconds of one node's kernel under ``strategy`` on one device (0 for a value or a view).

    The roofline of :meth:`~tvm_distx.autoshard.costs.CostProfile.kernel_time`
    on the node's local arithmetic and the local bytes of its operands and
    result (:meth:`~tvm_distx.autoshard.graph.ShardGraph.kernel_bytes`).
    """
    node = graph.nodes[index]
    if node.kind != "op" or node.view:
        return 0.0
    return profile.kernel_time(graph.flops(index) / strategy.parts,
                               graph.kernel_bytes(index, strategy))


def _move_seconds(node, src: str, dst: str, mesh: tuple, profile: CostProfile, objective: str,
                  reshard: Reshard) -> float:
    """Seconds to move ``node``'s value from ``src`` to ``dst`` (0 when nothing moves)."""
    if src == dst:
        return 0.0
    nbytes, steps, copied = reshard(node.shape, node.dtype, src, dst, mesh)
    messages = sum(step_messages(k, g) for k, g in steps) if objective == "latency" else 0
    return profile.message_time(nbytes, messages) + copied / profile.memory_bytes_per_s


def evaluate(graph: ShardGraph, choice: list[int], *, profile: CostProfile = DEFAULT_PROFILE,
             objective: str = "latency", users=None,
             reshard: Reshard = planner_reshard) -> Solution:
    """What a choice of strategies costs: compute, moves, weights and peak memory per rank.

    Parameters
    ----------
    graph : ShardGraph
    choice : list of int
        Per node, the index of its strategy.
    profile : CostProfile
    objective : {"latency", "throughput"}
        With ``"throughput"`` the start-up of messages is left out (it overlaps
        other batches' work); bytes and arithmetic count the same.
    """
    users = users if users is not None else _users(graph)
    mesh = tuple(graph.mesh_shape)
    strategies = [graph.strategies[i][choice[i]] for i in range(len(graph.nodes))]
    compute = sum(kernel_seconds(graph, i, strategies[i], profile)
                  for i in range(len(graph.nodes)))
    moves, comm, nbytes = [], 0.0, 0
    for value, node in enumerate(graph.nodes):
        src = strategies[value].out
        for dst in sorted({strategies[u].ins[slot] for u, slot in users[value]} - {src}):
            size, steps, _ = reshard(node.shape, node.dtype, src, dst, mesh)
            seconds = _move_seconds(node, src, dst, mesh, profile, objective, reshard)
            moves.append((value, src, dst, size, seconds, steps))
            comm += seconds
            nbytes += size
    weights = sum(graph.local_bytes(i, strategies[i])
                  for i, node in enumerate(graph.nodes) if node.kind == "param")
    state = graph.state_nodes()
    held = sum(graph.local_bytes(i, strategies[i]) for i in graph.state)
    peak = weights + held
    last = _last_use(graph, users)
    live: dict[int, int] = {}
    for point, node in enumerate(graph.nodes):
        if node.kind != "param" and not node.view and point not in state:
            live[point] = graph.local_bytes(point, strategies[point])
        for value in [v for v in live if last[v] < point]:
            del live[value]
        peak = max(peak, weights + held + sum(live.values()))
    return Solution(list(choice), compute, comm, nbytes, weights, peak, compute + comm,
                    moves=moves, state_bytes=held)
