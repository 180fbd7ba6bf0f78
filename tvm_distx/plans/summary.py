"""The per-layer summary of a tensor-parallel plan: what each layer splits and what it moves.

:meth:`tvm_distx.plans.tensor_parallel.TensorParallel.layers` answers, for every decoder
layer of a model, the questions a user of a tensor-parallel plan asks first:
which weights are split and how, which stay whole and why, and how many
collectives the layer really runs against the ideal: Megatron's one all-reduce
per attention block and one per MLP (or mixture-of-experts) block, and one for
a vocabulary-parallel embedding's lookup.

Layers are found from the graph, not from names: a layer starts at the first
projection of an attention block (a linear whose result is reshaped into
heads) and runs to the next one. What comes before the first layer (the
embeddings) and after the last linear of the last layer that is not the LM
head is reported with the nearest layer; the LM head is its own row.

The collectives are those of the compiled program
(:func:`tvm_distx.reports.comm_report` of the local view, after all-reduces of partial
sums combined linearly were merged), placed in the layer whose span holds the
value they produce. Everything here is pure data; ``str()`` renders it.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm

from tvm_distx.ir import helpers as _ir
from tvm_distx.layout import Placement
from tvm_distx.plans.structure import attention_heads, linear_outputs
from tvm_distx.reports.comm_report import CommRow

__all__ = ["LayerSummary", "PlanSummary", "summarize_layers"]


@dataclass(frozen=True)
class LayerSummary:
    """One layer of the model, as the plan splits it.

    Attributes
    ----------
    name : str
        ``"layer 0"``, ``"layer 1"``, ... or ``"head"`` (the LM head and what follows).
    split : tuple of (str, str, str)
        ``(weight, placement, reason)`` of every weight split in the layer.
    whole : tuple of (str, str)
        ``(weight, reason)`` of every 2-D or larger weight kept whole.
    collectives : tuple of CommRow
        The collectives the compiled program runs in this layer.
    ideal : int
        One all-reduce per split attention block, one per split MLP or
        mixture-of-experts block of the layer, and one per vocabulary-parallel
        embedding lookup (the first layer's).
    missed : tuple of str
        The weights of ``whole`` kept whole because the plan found no block
        around them: the layer is not split as it could be.
    statistics : tuple of str
        The values of ``collectives`` that are a norm's per-token statistics
        (one number per token, last axis 1): a norm over features that are
        split (OLMo2's query and key norms over every head) sums its squares
        over the ranks. Counted apart from the ideal.
    """

    name: str
    split: tuple[tuple[str, str, str], ...]
    whole: tuple[tuple[str, str], ...]
    collectives: tuple[CommRow, ...]
    ideal: int
    missed: tuple[str, ...] = ()
    statistics: tuple[str, ...] = ()

    def _reduces(self) -> list[CommRow]:
        return [r for r in self.collectives if r.collective in ("all_reduce", "reduce_scatter")
                and r.value not in self.statistics]

    @property
    def all_reduces(self) -> int:
        """The all-reduces (and reduce-scatters) of the layer, its norm statistics apart."""
        return len(self._reduces())

    @property
    def extra(self) -> tuple[CommRow, ...]:
        """Collectives beyond the ideal: every move that is not an all-reduce, and
        all-reduces past the ideal count."""
        moves = [r for r in self.collectives if r.collective not in ("all_reduce",
                                                                      "reduce_scatter")]
        surplus = max(0, self.all_reduces - self.ideal)
        reduces = self._reduces()
        return tuple(moves + reduces[len(reduces) - surplus:] if surplus else moves)


@dataclass(frozen=True)
class PlanSummary:
    """Every layer of a tensor-parallel plan (see the module doc)."""

    ranks: int
    layers: tuple[LayerSummary, ...]
    total_text: str
    #: bytes of the matrices (2-D float weights) split, and of all of them
    split_bytes: int = 0
    matrix_bytes: int = 0

    @property
    def ideal(self) -> bool:
        """Whether every layer is split where it can be and moves no more than the ideal."""
        return not any(layer.extra or layer.missed for layer in self.layers)

    def __str__(self) -> str:
        share = self.split_bytes / self.matrix_bytes if self.matrix_bytes else 0.0
        lines = [f"tensor-parallel plan for {self.ranks} ranks, per layer "
                 "(ideal: every block split, one all-reduce per attention block, one per MLP "
                 "or MoE block and one per vocabulary-parallel embedding)",
                 f"weights split: {share:.0%} of the matrices' bytes "
                 f"({self.split_bytes / 2**20:.1f} of {self.matrix_bytes / 2**20:.1f} MiB)"]
        for layer in self.layers:
            faults = ([f"{len(layer.extra)} extra"] if layer.extra else []) + \
                ([f"{len(layer.missed)} matrices whole, no block found"] if layer.missed else [])
            verdict = ", ".join(faults) or "ideal"
            statistics = (f" and {len(layer.statistics)} of norm statistics"
                          if layer.statistics else "")
            lines.append(f"{layer.name}: {layer.all_reduces} all-reduce(s){statistics}, ideal "
                         f"{layer.ideal} ({verdict})")
            for weight, placement, reason in layer.split:
                lines.append(f"  split {placement:<6} {weight}: {reason}")
            for weight, reason in layer.whole:
                lines.append(f"  whole        {weight}: {reason}")
            for row in layer.extra:
                lines.append(f"  extra: {row.collective} of {row.value} ({row.src} -> "
                             f"{row.dst}, {row.bytes_text} bytes)")
        lines.append(f"total received per rank: {self.total_text} bytes")
        return "\n".join(lines)


def summarize_layers(mod: tvm.IRModule, annotated: tvm.IRModule, local_view: tvm.IRModule,
                     plan, report, function: str = "main") -> PlanSummary:
    """Assemble the per-layer summary (see :meth:`TensorParallel.layers`).

    Parameters
    ----------
    mod : tvm.IRModule
        The module the plan was found on (relax operators, fused projections cut).
    annotated : tvm.IRModule
        ``mod`` annotated with the plan (every weight's placement).
    local_view : tvm.IRModule
        The compiled program's local view (its collectives, in program order).
    plan : TensorParallelPlan
        The plan (roles and blocks).
    report : CommReport
        ``comm_report(local_view)``.
    function : str
        The planned function.
    """

    heads = attention_heads(mod, function)
    outputs = linear_outputs(mod, function)
    # positions in the annotated function (names are the same in every version of it)
    order = _binding_order(annotated[function])
    mixing = _activation_products(annotated[function])
    starts = []  # the first projection of every attention block, in program order
    for block in plan.blocks:
        columns = [order[outputs[c]] for c in block.column if c in outputs]
        end = order.get(outputs.get(block.row, ""), -1)
        # attention: its projections are reshaped into heads, or two of its activations
        # are multiplied together (the scores) before the row projection
        if columns and (any(c in heads for c in block.column)
                        or any(min(columns) < m < end for m in mixing)):
            starts.append(min(columns))
    starts = sorted(set(starts))
    head = [r.param for r in plan.roles if r.role == "lm_head"]
    head_at = min((order.get(outputs[w], 0) for w in head if w in outputs), default=None)

    def layer_of(position: int) -> int:
        if head_at is not None and position >= head_at:
            return len(starts)
        index = sum(start <= position for start in starts) - 1
        return max(index, 0)

    placements = _placements(annotated[function])
    # a weight belongs where it meets an activation (its transpose may come earlier)
    weights = set(placements) | {r.param for r in plan.roles}
    uses = _compute_sites(annotated[function], weights)
    roles = {r.param: r for r in plan.roles}
    count = len(starts) + 1
    split: list[list] = [[] for _ in range(count)]
    whole: list[list] = [[] for _ in range(count)]
    missed: list[list] = [[] for _ in range(count)]
    split_bytes = matrix_bytes = 0
    ideal = [0] * count
    for block in plan.blocks:
        if block.kind != "replicated" and block.row in outputs:
            ideal[layer_of(order.get(outputs[block.row], 0))] += 1
    for role in plan.roles:  # a vocabulary-parallel embedding: one all-reduce of its lookup
        if role.lookup and role.param in uses:
            ideal[layer_of(uses[role.param])] += 1
    for param in annotated[function].params:
        shape = _ir.static_shape(param.ty) or ()
        if len(shape) < 2 or param.name not in uses or not _is_float(param.ty):
            continue  # vectors (norms, biases) and token ids are not what a plan splits
        where = layer_of(uses[param.name])
        placement = placements.get(param.name)
        role = roles.get(param.name)
        # planned matrices: a role, or experts split by their own plan (not an input)
        nbytes = _ir.tensor_bytes(param.ty) if role is not None or (
            placement and "S" in placement) else 0
        matrix_bytes += nbytes
        if placement and "S" in placement:
            reason = role.reason if role else "experts (see tvm_distx.plans.moe)"
            split[where].append((param.name, placement, reason))
            split_bytes += nbytes
        else:
            whole[where].append((param.name, role.reason if role else
                                 "not a linear's weight (an input, or a table read by index)"))
            if role is not None and not role.found:
                missed[where].append(param.name)
    expert_layers = {layer_of(uses[p]) for p, placement in placements.items()
                     if p in uses and placement and "S" in placement and p not in roles}
    for where in expert_layers:  # a MoE block: one all-reduce, its shared expert's included
        if not any(b.kind == "mlp" and layer_of(order.get(outputs.get(b.row, ""), 0)) == where
                   for b in plan.blocks):
            ideal[where] += 1
    positions = _binding_order(local_view[function]) if function in \
        [gv.name_hint for gv in local_view.functions] else {}
    rows: list[list] = [[] for _ in range(count)]
    statistics = _per_token_statistics(local_view[function]) if positions else set()
    local_starts = _local_starts(starts, order, positions)
    found = [positions[outputs[w]] for w in head if w in outputs and outputs[w] in positions]
    head_local = min(found) if head_at is not None and found else None
    for row in report.rows:
        if row.collective == "local_slice" or row.function != function:
            continue
        rows[_bucket(positions.get(row.value, 0), local_starts, head_local)].append(row)
    layers = []
    for index in range(count):
        name = ("head" if starts else "model") if index == len(starts) else f"layer {index}"
        layers.append(LayerSummary(
            name, tuple(split[index]), tuple(whole[index]), tuple(rows[index]), ideal[index],
            tuple(missed[index]),
            tuple(r.value for r in rows[index] if r.value in statistics)))
    return PlanSummary(plan.ranks, tuple(layers), report.total_text, split_bytes, matrix_bytes)


def _per_token_statistics(func) -> set[str]:
    """Values of all-reduces with a last axis of 1: a norm's per-token statistics."""
    out = set()
    for block in func.body.blocks:
        for binding in block.bindings:
            if _ir.is_call_to(binding.value, "relax.ccl.allreduce"):
                shape = _ir.static_shape(binding.var.ty)
                if shape and len(shape) > 1 and shape[-1] == 1:
                    out.add(binding.var.name)
    return out


def _is_float(ty) -> bool:
    dtype = getattr(getattr(ty, "tensor_ty", ty), "dtype", "")
    return str(dtype).startswith(("float", "bfloat"))


def _binding_order(func) -> dict[str, int]:
    """Variable name -> position of its binding (the last binding of a name wins)."""
    order = {}
    position = 0
    for block in func.body.blocks:
        for binding in block.bindings:
            order[binding.var.name] = position
            position += 1
    return order


def _compute_sites(func, weights: set[str]) -> dict[str, int]:
    """Parameter name -> position of the first binding where it meets an activation.

    Values computed from the ``weights`` alone (a transposed weight) carry them
    along; the site is the first binding that also reads something else. Any
    other parameter (an input, a table nobody planned) is placed at its first use.
    """

    carried: dict = {p: {p.name} for p in func.params if p.name in weights}
    for p in func.params:
        if p.name not in weights:
            carried.setdefault(p, set())
    activations = {p for p in func.params if p.name not in weights}
    sites: dict[str, int] = {}
    first: dict[str, int] = {}
    position = 0
    for block in func.body.blocks:
        for binding in block.bindings:
            operands = _ir.operand_vars(binding.value)
            held = set().union(*(carried.get(v, set()) for v in operands))
            for v in operands:
                if v in activations:
                    first.setdefault(v.name, position)
            for name in held:
                first.setdefault(name, position)
            if operands and not any(v in activations for v in operands) and \
                    all(v in carried for v in operands):
                carried[binding.var] = held  # still only weights
            else:
                activations.add(binding.var)
                for name in held:
                    sites.setdefault(name, position)
            position += 1
    return {**first, **sites}


def _activation_products(func) -> list[int]:
    """Positions of matmuls of two activations (attention scores and their use of values)."""

    params = {p for p in func.params}
    derived: set = set(params)
    out = []
    position = 0
    for block in func.body.blocks:
        for binding in block.bindings:
            operands = _ir.operand_vars(binding.value)
            if operands and all(v in derived for v in operands):
                derived.add(binding.var)
            if _ir.is_call_to(binding.value, "relax.matmul") and not any(
                    isinstance(a, tvm.relax.Var) and a in derived for a in binding.value.args):
                out.append(position)
            position += 1
    return out


def _placements(func) -> dict[str, str]:
    """Parameter name -> the placement its annotation gives it."""

    out = {}
    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if _ir.is_call_to(value, "relax.dist.annotate_sharding") and \
                    isinstance(value.args[0], tvm.relax.Var):
                out[value.args[0].name] = str(Placement.from_tvm(value.attrs.placement))
    return out


def _local_starts(starts, order, positions) -> list[int]:
    """The layer starts as positions in the local view (names survive lowering)."""
    by_position = {position: name for name, position in order.items()}
    return [positions.get(by_position.get(start, ""), -1) for start in starts]


def _bucket(at: int, local_starts: list[int], head_local: int | None) -> int:
    """The layer (an index into the summary) of a collective at local-view position ``at``."""
    if head_local is not None and at >= head_local:
        return len(local_starts)
    index = sum(0 <= start <= at for start in local_starts) - 1
    return max(index, 0)
