"""Tensor-parallel plans found from a model's graph, not from its layer names.

:func:`tensor_parallel` reads the Relax graph of ``main`` as
:func:`tvm_distx.from_torch` imports it (before ``LegalizeOps``) and decides,
for every weight, Megatron's placement:

* A **linear** is a ``matmul`` of an activation with a weight parameter, seen
  directly (``(in, out)``, as GPT-2's ``Conv1D`` stores it) or through a
  ``permute_dims`` (``(out, in)``, as ``torch.nn.Linear`` stores it), with an
  optional bias ``add`` of a parameter.
* A linear whose result goes, through reshapes, transposes and scalings only,
  into an ``add`` is **row parallel**: it writes the residual branch. Its weight
  is split on its input features; the product is a partial sum, completed by
  one all-reduce. Two such branches added together (a shared expert beside the
  routed experts) share one all-reduce.
* Walking back from a row-parallel linear's input, every linear reached before
  any other linear is **column parallel**: they read the block's input
  (the q, k, v projections of an attention, the gate and up projections of a
  gated MLP, the first layer of a plain MLP). Their weights are split on their
  output features, so the block between them runs on each rank's share with
  no communication.
* A plain **MLP chain** with no residual add after it, ``relu(x @ A) @ B``
  (or a gated one), is such a block too: a linear whose input is computed from
  other linears' results by elementwise operators only, which nothing else
  reads, is row parallel, and those linears are column parallel
  (:meth:`~tvm_distx.plans.structure.ModelGraph.elementwise_columns`).
* Calls to **private functions** are planned through: each call's linears are
  read where it runs (:func:`tvm_distx.ir.inline.inline_calls`), and the plan
  places the caller's parameters, which propagation carries into the callee.
  A function called twice with the same weights is one block per call.
* **Attention** splits whole heads only. A column-parallel linear whose result
  is reshaped to ``(..., heads, head_dim)`` is split only when ``heads``
  divides by the rank count. Key and value projections with fewer heads than
  ranks (grouped-query attention) stay replicated: each rank slices the heads
  its query heads need, locally, so the rank count is not limited to the key
  and value head count. If the query heads do not divide, the whole block
  stays replicated. A projection of an attention block that is not cut into
  heads (the rotary key of multi-head latent attention, one per token and
  shared by every head) stays whole too: it is small, and a split would be
  gathered back at once.
* The **LM head**, the linear whose result is the function's output, is column
  parallel (its vocabulary split); the logits are gathered at the end.
* A token **embedding** (``take(table, ids, axis=0)`` of a ``(V, H)`` table
  whose ids come from the function's inputs) is **vocabulary parallel** where
  that saves memory: each rank holds ``V/p`` rows, and one all-reduce of the
  ``(tokens, H)`` hidden states completes each lookup. Otherwise (a table tied
  to a whole LM head, a vocabulary that does not divide, or one smaller than
  twice the tokens looked up) it stays replicated; the criterion is
  :func:`tvm_distx.plans.vocab.embedding_roles`.
* **Fused projections** (q|k|v, gate|up) are first cut into one parameter per
  segment (:class:`tvm_distx.passes.SplitFusedProjections`), so each segment is
  column parallel on its own. **Experts** (3-D weights) follow
  :func:`tvm_distx.plans.moe.choose_expert_plan`, the cheaper of expert and tensor
  parallelism.

The plan is pure data (:class:`TensorParallelPlan`): one :class:`WeightRole`
per weight, with its reason, and one :class:`ParallelBlock` per parallel
region; ``str(plan)`` is the per-block summary.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
import logging
import os

import tvm

from tvm_distx.compiler.pipeline import run_stages
from tvm_distx.errors import RuleError
from tvm_distx.ir import helpers as _ir
from tvm_distx.ir.inline import inline_calls
from tvm_distx.layout.rules import ShardingRule, pattern_entries, rules_for
from tvm_distx.passes import (SplitFusedProjections, GroupedQueryAttention, VocabParallelEmbedding,
                              AnnotateSharding)
from tvm_distx.passes.quantize import weight_formats
from tvm_distx.plans import moe
from tvm_distx.plans.patterns import Preset
from tvm_distx.plans.structure import (LinearSite, ModelGraph, WeightRole, attention_heads,
                                       linear_outputs, tied_weights)
from tvm_distx.plans.summary import summarize_layers
from tvm_distx.plans.vocab import embedding_roles
from tvm_distx.reports.comm_report import comm_report

__all__ = ["ParallelBlock", "TensorParallel", "TensorParallelPlan", "WeightRole",
           "attention_heads", "linear_outputs", "tensor_parallel", "tied_weights"]

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class ParallelBlock:
    """One parallel region: column-parallel linears, then the row-parallel one that ends it.

    Attributes
    ----------
    name : str
        The common prefix of its weights' names (for reading only).
    kind : str
        ``"attention"`` (its columns are reshaped to heads), ``"mlp"`` or
        ``"replicated"`` (it could not be split, see the roles' reasons).
    column : tuple of str
        Its column-parallel weights.
    row : str
        The row-parallel weight.
    """

    name: str
    kind: str
    column: tuple[str, ...]
    row: str


@dataclass(frozen=True)
class TensorParallelPlan:
    """The roles of every linear's weight and the parallel blocks, for ``ranks`` ranks."""

    ranks: int
    roles: tuple[WeightRole, ...]
    blocks: tuple[ParallelBlock, ...]

    def role(self, param: str) -> WeightRole | None:
        """The role of ``param``, None for a parameter that is not a linear's weight."""
        return next((r for r in self.roles if r.param == param), None)

    def placements(self, model_axis: int = 0, mesh_ndim: int = 1) -> dict[str, str]:
        """Placement text of every split weight (replicated weights are not listed)."""
        out = {}
        for r in self.roles:
            if r.axis is None:
                continue
            entries = ["R"] * mesh_ndim
            entries[model_axis] = f"S[{r.axis}]"
            out[r.param] = "".join(entries)
        return out

    @property
    def matrix_bytes(self) -> int:
        """Bytes of every planned matrix (linear weights and embedding tables, no biases)."""
        return sum(r.nbytes for r in self.roles if not r.bias)

    @property
    def split_bytes(self) -> int:
        """Bytes of the planned matrices that are split."""
        return sum(r.nbytes for r in self.roles if not r.bias and r.axis is not None)

    @property
    def missed(self) -> tuple[WeightRole, ...]:
        """Matrices kept whole because no block was found around them."""
        return tuple(r for r in self.roles if not r.found)

    def split_text(self) -> str:
        """``"weights split: 80% of the matrices' bytes (12.0 of 15.0 MiB)"``."""
        total = self.matrix_bytes
        share = self.split_bytes / total if total else 0.0
        return (f"weights split: {share:.0%} of the matrices' bytes ({self.split_bytes / 2**20:.1f} "
                f"of {total / 2**20:.1f} MiB)")

    def __str__(self) -> str:
        vocab = sum(r.lookup for r in self.roles)
        lines = [f"tensor-parallel plan for {self.ranks} ranks: {len(self.blocks)} blocks, "
                 f"ideal one all-reduce each"
                 + (f", and one for each of {vocab} vocabulary-parallel embedding(s)"
                    if vocab else ""), f"  {self.split_text()}"]
        for b in self.blocks:
            lines.append(f"  {b.name or '(block)'} [{b.kind}]: column {', '.join(b.column)}; "
                         f"row {b.row}")
        for r in self.roles:
            if r.role in ("lm_head", "replicated", "vocab") and not r.bias:
                lines.append(f"  {r.param}: {r.role} ({r.reason})")
        return "\n".join(lines)


def _common_prefix(names) -> str:
    prefix = os.path.commonprefix(list(names))
    return prefix.rstrip("_")


# ----------------------------------------------------------------------------- planning
def plan_tensor_parallel(mod: tvm.IRModule, ranks: int,
                         function: str = "main") -> TensorParallelPlan:
    """The tensor-parallel plan of ``function`` for ``ranks`` ranks (see the module doc).

    Parameters
    ----------
    mod : tvm.IRModule
        As imported (relax operators, before ``LegalizeOps``), fused projections
        already cut per segment if they should be.
    ranks : int
        The size of the model mesh axis.
    function : str
        The function whose parameters are planned.

    Returns
    -------
    TensorParallelPlan
    """
    mod = inlined(mod, function)
    graph = ModelGraph(mod[function])
    roles: dict[str, WeightRole] = {}
    blocks: list[ParallelBlock] = []
    linears = list(graph.linears.values())
    order = {name: i for i, name in enumerate(graph.params)}
    seen: dict[tuple, ParallelBlock] = {}  # a block's weights -> the block (one per call)

    for row in linears:
        residual = graph.residual_add(row.result) is not None
        if residual:
            columns = [c for c in graph.linears_behind(row.source) if c is not row]
        else:  # x @ A -> elementwise -> @ B with no residual add after it
            columns = graph.elementwise_columns(row) or []
            if row.weight in {c.weight for c in columns}:
                continue
        columns = sorted(columns, key=lambda c: order[c.weight])
        if not columns:
            continue
        key = (tuple(c.weight for c in columns), row.weight)
        block = _plan_block(graph, row, columns, ranks, roles, residual=residual)
        if block is None:  # the same weights again (a function called twice): same roles
            block = seen.get(key)
        if block is not None:
            blocks.append(block)
            seen[key] = block
    feeders = {f.matmul for block in blocks if block.kind != "replicated"
               for c in linears if c.weight in block.column
               for f in graph.linears_behind(c.source)}

    tables = embedding_roles(mod, ranks, function)
    for linear in linears:
        if linear.weight in roles:
            continue
        if graph.is_output_projection(linear):
            vocab = _ir.static_shape(graph.params[linear.weight].ty)[linear.out_axis]
            table = tables.get(linear.weight)
            if table is not None and table.role == "vocab":
                roles[linear.weight] = WeightRole(
                    linear.weight, "lm_head", linear.out_axis,
                    "the output projection, tied to the token embedding: both split on the "
                    "vocabulary (masked lookups, logits gathered at the end)", lookup=True)
                continue
            if not graph.only_used_by(linear.weight, linear):
                roles[linear.weight] = WeightRole(
                    linear.weight, "replicated", None, "the output projection is tied to "
                    "another use (the embedding): splitting it would gather it every run")
                continue
            if vocab % ranks == 0:
                roles[linear.weight] = WeightRole(
                    linear.weight, "lm_head", linear.out_axis,
                    "the output projection: vocabulary split, logits gathered at the end")
                continue
            roles[linear.weight] = WeightRole(
                linear.weight, "replicated", None,
                f"the output projection's {vocab} outputs do not divide by {ranks} ranks")
            continue
        width = _ir.static_shape(graph.params[linear.weight].ty)[linear.out_axis]
        if graph.reaches(linear.result, "relax.topk"):
            roles[linear.weight] = WeightRole(
                linear.weight, "replicated", None, "a router: its scores pick each token's "
                "experts, on every rank")
            continue
        if width == 1:
            roles[linear.weight] = WeightRole(
                linear.weight, "replicated", None, "one output feature (a per-token gate): "
                "nothing to split")
            continue
        if linear.matmul in feeders:
            roles[linear.weight] = WeightRole(
                linear.weight, "replicated", None, "feeds a split block's column projections "
                "(a low-rank projection, normalised whole): every rank needs all its output")
            continue
        roles[linear.weight] = WeightRole(linear.weight, "replicated", None,
                                          "not in a column -> row block", found=False)
    for name, role in tables.items():
        roles.setdefault(name, role)  # a tied table keeps its LM head's role
    sized = tuple(replace(r, nbytes=_ir.tensor_bytes(graph.params[r.param].ty))
                  if r.param in graph.params else r for r in roles.values())
    return TensorParallelPlan(ranks, sized, tuple(blocks))


def inlined(mod: tvm.IRModule, function: str = "main") -> tvm.IRModule:
    """``mod`` with the calls ``function`` makes to private functions written in place.

    Propagation carries a weight's placement into the functions it is passed to,
    so the plan reads each call's linears where they are; the weights keep the
    names of ``function``'s parameters. A module whose ``function`` calls no
    private function is returned as it is.
    """
    out, sites = inline_calls(mod, function)
    if sites:
        logger.info("tensor_parallel: %s's %d call(s) of private functions planned through "
                    "(inlined)", function, sites)
    return out


def _plan_block(graph: ModelGraph, row: LinearSite, columns: list[LinearSite], ranks: int,
                roles: dict[str, WeightRole], *, residual: bool = True) -> ParallelBlock | None:
    """The roles of one region's weights; None if a weight already has a role.

    ``residual``: the row linear writes a residual branch (else it ends a plain
    chain of linears and elementwise operators).
    """
    if any(c.weight in roles for c in columns) or row.weight in roles:
        return None
    heads = {c.weight: graph.heads_of(c) for c in columns}
    attention = any(h is not None for h in heads.values())
    shapes = {c.weight: _ir.static_shape(graph.params[c.weight].ty) for c in columns}
    split, kept = [], []
    for c in columns:
        width = shapes[c.weight][c.out_axis]
        head = heads[c.weight]
        if head is not None and head[0] % ranks != 0:
            kept.append((c, f"{head[0]} heads do not divide by {ranks} ranks: each rank "
                            "slices the heads it needs"))
        elif head is None and attention:
            # multi-head latent attention's rotary key (one per token, shared by every
            # head): a split would be gathered back before every head uses it
            kept.append((c, "not cut into heads: shared by every head, each rank computes "
                            "it whole"))
        elif head is None and width % ranks != 0:
            kept.append((c, f"{width} output features do not divide by {ranks} ranks"))
        else:
            split.append(c)
    row_shape = _ir.static_shape(graph.params[row.weight].ty)
    row_in = row_shape[1 - row.out_axis]
    if not split or row_in % ranks != 0 or (attention and not any(
            heads[c.weight] is not None for c in split)):
        reason = (f"no column of the block divides by {ranks} ranks" if not split else
                  f"the row projection's {row_in} inputs do not divide by {ranks} ranks"
                  if row_in % ranks else f"the query heads do not divide by {ranks} ranks")
        for linear in [*columns, row]:
            roles[linear.weight] = WeightRole(linear.weight, "replicated", None, reason)
            if linear.bias:
                roles[linear.bias] = WeightRole(linear.bias, "replicated", None, reason,
                                                bias=True)
        names = [c.weight for c in columns]
        return ParallelBlock(_common_prefix(names + [row.weight]), "replicated",
                             tuple(names), row.weight)
    kind = "attention" if attention else "mlp"
    for c in split:
        roles[c.weight] = WeightRole(c.weight, "column", c.out_axis,
                                     f"reads the {kind} block's input; output features split")
        if c.bias:
            roles[c.bias] = WeightRole(c.bias, "column", 0, "bias of a column-parallel linear",
                                       bias=True)
    for c, reason in kept:
        roles[c.weight] = WeightRole(c.weight, "replicated", None, reason)
        if c.bias:
            roles[c.bias] = WeightRole(c.bias, "replicated", None, reason, bias=True)
    ends = f"writes the {kind} block's residual branch" if residual else \
        f"ends the {kind} block, after its elementwise work"
    roles[row.weight] = WeightRole(row.weight, "row", 1 - row.out_axis,
                                   f"{ends}; input features split, one all-reduce")
    if row.bias:
        roles[row.bias] = WeightRole(row.bias, "replicated", None,
                                     "bias of a row-parallel linear: added once, after the sum",
                                     bias=True)
    names = [c.weight for c in columns]
    return ParallelBlock(_common_prefix(names + [row.weight]), kind, tuple(names), row.weight)


# ------------------------------------------------------------------------------- preset
@dataclass(frozen=True)
class TensorParallel:
    """The preset :func:`tensor_parallel` returns: a plan found in each module it is applied to.

    Behaves like :class:`tvm_distx.plans.presets.Preset`: :meth:`rules`, :meth:`apply`,
    :meth:`override`; :meth:`plan` gives the plan itself.
    """

    model_axis: int = 0
    mesh_ndim: int = 1
    overrides: tuple[tuple[str, str, str | None], ...] = ()
    split_fused: bool = True
    experts: bool = True
    vocab: bool = True
    strict: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.model_axis < self.mesh_ndim:
            raise RuleError(f"tensor_parallel(model_axis={self.model_axis}, "
                            f"mesh_ndim={self.mesh_ndim}): no such mesh axis",
                            hint="tensor_parallel(model_axis=0) for a 1-D mesh")

    def override(self, patterns: dict[str, str], mesh: str | None = None) -> "TensorParallel":
        """This preset with ``patterns`` (glob -> placement) added last (they win)."""
        return replace(self, overrides=self.overrides + pattern_entries(patterns, mesh))

    def ranks(self, mod: tvm.IRModule) -> int:
        """The size of the model mesh axis of ``mod``'s first mesh."""
        meshes = mod.global_infos.get("mesh") if mod.global_infos else None
        if not meshes:
            raise RuleError("the module has no device mesh",
                            hint="presets.set_device_meshes(mod, [(2,)]) first")
        shape = [int(s) for s in meshes[0].shape]
        if len(shape) != self.mesh_ndim:
            raise RuleError(f"tensor_parallel(mesh_ndim={self.mesh_ndim}) on a mesh of shape "
                            f"{tuple(shape)}",
                            hint=f"tensor_parallel(model_axis=..., mesh_ndim={len(shape)})")
        return shape[self.model_axis]

    def plan(self, mod: tvm.IRModule, function: str = "main") -> TensorParallelPlan:
        """The plan for ``mod`` (on its mesh's model axis).

        Raises
        ------
        RuleError
            If the plan splits no matrix at all, or (``strict=True``) splits less
            than half of the matrices' bytes; without ``strict`` the latter is a
            warning, once per apply.
        """
        _refuse_stored_formats(mod)
        plan = plan_tensor_parallel(mod, self.ranks(mod), function)
        problem = _too_little_split(plan, function)
        if problem is not None and (self.strict or not plan.split_bytes):
            raise problem
        return plan

    @staticmethod
    def _warn_if_little_split(plan: TensorParallelPlan, function: str) -> None:
        """Log a warning when ``plan`` splits less than half of its matrices."""
        problem = _too_little_split(plan, function)
        if problem is not None:
            logger.warning("%s", problem)

    def summary(self, mod: tvm.IRModule, function: str = "main") -> str:
        """The plan's blocks, then its collectives against the ideal.

        The ideal is one all-reduce per split block (Megatron's count: one per
        attention block and one per MLP) plus what the experts' plan adds; any
        other collective is listed with the value it moves, so a weight left
        whole or a gather between layers shows at once.
        """

        mod = inlined(mod, function)  # each call's collectives counted where it runs
        meshed = self.prepare(mod, function)
        plan = self.plan(meshed, function)
        report = comm_report(run_stages(self.apply(mod, function))["local_view"])
        moves = [r for r in report.rows if r.collective != "local_slice"]
        reduces = [r for r in moves if r.collective in ("all_reduce", "reduce_scatter")]
        split = [b for b in plan.blocks if b.kind != "replicated"]
        vocab = [r for r in plan.roles if r.lookup]
        lines = [str(plan), f"collectives: {len(reduces)} all-reduce for {len(split)} split "
                 f"blocks and {len(vocab)} vocabulary-parallel embedding(s) (ideal: one "
                 f"each), {report.total_text} bytes received per rank"]
        lines += [f"  extra: {r.collective} of {r.value} ({r.src} -> {r.dst}, "
                  f"{r.bytes_text} bytes)" for r in moves if r not in reduces]
        return "\n".join(lines)

    def layers(self, mod: tvm.IRModule, function: str = "main"):
        """The plan per decoder layer: weights split or whole, collectives against the ideal.

        Compiles ``mod`` up to the local view to count what the program really
        moves. Returns a :class:`tvm_distx.plans.summary.PlanSummary` (pure data;
        ``str()`` is the table that ``tvm-distx plan --preset tensor-parallel``
        prints).
        """

        mod = inlined(mod, function)  # each call's collectives counted where it runs
        meshed = self.prepare(mod, function)
        plan = self.plan(meshed, function)
        annotated = self.apply(mod, function)
        local_view = run_stages(annotated)["local_view"]
        return summarize_layers(meshed, annotated, local_view, plan, comm_report(local_view),
                                function)

    def rules(self, mod: tvm.IRModule, function: str = "main") -> list[ShardingRule]:
        """Sharding rules: the plan's placements, then the overrides."""
        return self._rules(mod, function, self.plan(mod, function))

    def _rules(self, mod: tvm.IRModule, function: str,
               plan: TensorParallelPlan) -> list[ShardingRule]:
        """:meth:`rules` of a plan already made for ``mod``."""
        chosen = {name: (placement, None) for name, placement in
                  plan.placements(self.model_axis, self.mesh_ndim).items()}
        names = [p.name for p in mod[function].params]
        chosen.update(Preset(self.overrides).placements(names))
        return rules_for(chosen, function)

    def prepare(self, mod: tvm.IRModule, function: str = "main") -> tvm.IRModule:
        """``mod`` as :meth:`apply` plans it: fused projections cut per segment.

        Not cut when ``split_fused`` is off, nor in a model with experts (whose
        fused expert weights the MoE plan cuts only when it splits them).
        """

        if self.split_fused and not (self.experts and moe.expert_weights(mod, function)):
            mod = SplitFusedProjections()(mod)
        return self.grouped_attention(self.vocab_parallel(mod, function), function)

    def grouped_attention(self, mod: tvm.IRModule, function: str = "main") -> tvm.IRModule:
        """``mod`` with attention reading each key-value head once where the heads stay split.

        See :class:`tvm_distx.passes.GroupedQueryAttention`: products over
        repeated key-value heads are rewritten when the model axis divides the
        key-value heads. A module without a mesh is returned as it is.
        """

        meshes = mod.global_infos.get("mesh") if mod.global_infos else None
        if not meshes:
            return mod
        return GroupedQueryAttention(function, heads_divisor=self.ranks(mod))(mod)

    def vocab_parallel(self, mod: tvm.IRModule, function: str = "main") -> tvm.IRModule:
        """``mod`` with the lookups of the tables the plan splits on their vocabulary rewritten.

        See :func:`tvm_distx.plans.vocab.embedding_roles` for which; a module without a
        mesh, or
        with ``vocab=False``, is returned as it is.
        """

        meshes = mod.global_infos.get("mesh") if mod.global_infos else None
        if not self.vocab or not meshes:
            return mod
        ranks = self.ranks(mod)
        split = {name: ranks for name, role in embedding_roles(mod, ranks, function).items()
                 if role.lookup}
        return VocabParallelEmbedding(split, function)(mod)

    def apply(self, mod: tvm.IRModule, function: str = "main") -> tvm.IRModule:
        """``mod`` with fused projections cut, annotated with :meth:`rules`.

        A model with experts gets :func:`tvm_distx.plans.moe.choose_expert_plan` for them,
        with this plan for every other weight.
        """

        _refuse_stored_formats(mod)
        if self.experts and moe.expert_weights(mod, function):
            # the experts' fused weights are cut, when needed, by the MoE tensor plan
            # (the embedding lookups are rewritten first; the base plan finds them so)
            mod = self.grouped_attention(self.vocab_parallel(mod, function), function)
            base = TensorParallel(self.model_axis, self.mesh_ndim, self.overrides,
                                  split_fused=False, experts=False, vocab=False)
            plan = moe.choose_expert_plan(mod, base, model_axis=self.model_axis,
                                          mesh_ndim=self.mesh_ndim, function=function)
            return plan.apply(mod, function)
        mod = self.prepare(mod, function)
        plan = self.plan(mod, function)  # once: the warning and the rules read the same plan
        self._warn_if_little_split(plan, function)
        return AnnotateSharding(self._rules(mod, function, plan))(mod)


def _too_little_split(plan: TensorParallelPlan, function: str) -> RuleError | None:
    """The error (or warning) for a plan that splits less than half of its matrices' bytes."""
    total = plan.matrix_bytes
    if total == 0 or plan.split_bytes * 2 >= total:
        return None
    whole = [r for r in plan.roles if not r.bias and r.axis is None]
    reasons: dict[str, list[str]] = {}
    for role in sorted(whole, key=lambda r: -r.nbytes):
        reasons.setdefault(role.reason, []).append(role.param)
    listed = "; ".join(f"{len(names)} x {reason} (e.g. {names[0]})"
                       for reason, names in list(reasons.items())[:3])
    what = "splits no matrix" if not plan.split_bytes else "splits less than half of the " \
        "matrices"
    error = RuleError(
        f"tensor_parallel() {what} of '{function}' on {plan.ranks} ranks "
        f"({plan.split_text()}); whole: {listed}",
        function=function,
        hint="presets.from_hf(model) follows the model's own transformers plan; or name the "
        "splits: tensor_parallel().override({'*_q_proj_weight': 'S[0]', "
        "'*_o_proj_weight': 'S[1]'})",
        cli_hint="name the splits in a rules file instead of --preset: --rules FILE with "
        "[{\"param\": \"W\", \"result\": \"S[1]\"}, ...], or let tvm-distx autoshard "
        "write one")
    error.cli_names = (("tensor_parallel()", "--preset tensor-parallel"),)
    return error


def _refuse_stored_formats(mod: tvm.IRModule) -> None:
    """Refuse a module whose weights :func:`tvm_distx.quantize` stored already.

    The plan reads linears as matmuls of weight parameters; a quantized
    module's linears read decodes of stored parts instead, which it would
    leave whole. Quantizing after planning moves each weight's annotation onto
    its parts, so that order gives the same plan.
    """
    stored = sorted(name for name, fmt in weight_formats(mod).items() if fmt != "f32")
    if stored:
        raise RuleError(
            f"tensor_parallel() plans float weights, but {len(stored)} weights of this module "
            f"are stored quantized already ({', '.join(stored[:3])}"
            f"{', ...' if len(stored) > 3 else ''})",
            hint="plan first, then quantize: annotated = preset.apply(mod); "
            "td.quantize(annotated, weights, fmt) moves each annotation onto the stored parts")


def tensor_parallel(model_axis: int = 0, mesh_ndim: int = 1, *,
                    strict: bool = False) -> TensorParallel:
    """Megatron tensor parallelism found from the graph's structure, not names.

    Parameters
    ----------
    model_axis : int
        The mesh axis of the tensor parallelism.
    mesh_ndim : int
        The number of mesh axes.
    strict : bool, default False
        Raise, rather than warn, when the plan splits less than half of the
        matrices' bytes. A plan that splits nothing always raises.

    Returns
    -------
    TensorParallel
        A preset: ``.apply(mod)``, ``.rules(mod)``, ``.override(...)``, ``.plan(mod)``.

    Examples
    --------
    >>> preset = tensor_parallel()
    >>> annotated = preset.apply(set_device_meshes(mod, [(2,)]))   # doctest: +SKIP
    >>> print(preset.plan(set_device_meshes(mod, [(2,)])))          # doctest: +SKIP
    """
    return TensorParallel(model_axis, mesh_ndim, strict=strict)
