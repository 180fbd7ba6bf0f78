"""Mixture-of-experts plans: expert parallelism, or tensor parallelism inside each expert.

A sparse MLP imported through :func:`tvm_distx.from_torch` (see
:mod:`tvm_distx.frontend.torch_moe`) holds its experts as 3-D weights, one matrix per
expert, used as the *batch* operand of a batched matmul::

    h = matmul(broadcast(tokens), permute_dims(W_up))        # (E, T, 2I)
    y = matmul(gate(h),           permute_dims(W_down))      # (E, T, H)
    out = sum_e combine[t, e] * y[e, t]                       # (T, H)

:func:`expert_weights` finds those weights by this structure, not by name: a
3-D parameter that reaches the batch dimension of a ``relax.matmul`` through
layout operators only. Its *expert dimension* is the parameter axis that
becomes the batch axis; its *intermediate dimension* is the output axis of the
first ("up") matmul and the contracted axis of the second ("down") one, which
is the matmul whose other operand depends on an expert matmul. A 2-D
parameter added to an expert matmul's result, one row per expert and the same
for every token, is that projection's bias, split with its experts.

Two plans split them on one mesh axis of ``p`` ranks:

* :func:`expert_parallel` splits every expert weight on its expert dimension:
  each rank holds ``E / p`` whole experts, the router and the tokens are
  replicated, and the dense dispatch becomes one experts kernel
  (:mod:`tvm_distx.plans.moe_dispatch`) that each rank runs as a *sparse dispatch*
  over the slice of the routing matrix of its own experts: it computes only
  the (token, expert) pairs routed to them. The sum over experts is a partial
  sum completed by **one all-reduce** of the ``(T, H)`` result per MoE layer.
  No expert weight is ever gathered.
* :func:`expert_tensor_parallel` splits every expert on its intermediate
  dimension (Megatron inside each expert, a fused gate|up weight per segment):
  each rank holds a slice of every expert, and the down projection leaves a
  partial sum of the ``(E, T, H)`` expert outputs, completed by one all-reduce
  before the routing weights combine them (``E`` times the bytes).

:func:`compare` runs both through propagation and the local view and returns
their comm reports side by side; :func:`choose_expert_plan` returns the cheaper plan
(fewer bytes per rank, then fewer collectives; a tie goes to expert
parallelism, whose kernels keep each expert's matrices whole).

Both plans take a ``base`` preset for the other weights (attention, embeddings,
LM head), for example :func:`tvm_distx.plans.presets.megatron` or
``presets.tensor_parallel()``; the expert weights' placements win over it.

:class:`MoeComparison` also gives each plan's expert-MLP flops per token and
rank: ``k / p`` expert MLPs for the sparse expert-parallel dispatch (balanced
routing), ``E / p`` for tensor parallelism inside the experts, which still runs
the masked dense dispatch of :mod:`tvm_distx.frontend.torch_moe` (every expert on every
token, the tokens an expert was not routed contributing exact zeros). A
dispatch that :mod:`tvm_distx.plans.moe_dispatch` does not read (biased experts, or a
gating other than ``silu(gate) * up``, such as GPT-OSS's) stays masked dense
under expert parallelism too.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
import logging
from typing import TYPE_CHECKING

import tvm

from tvm_distx.compiler.pipeline import run_stages
from tvm_distx.compiler.schedule.experts import EXPERTS_ATTR, ExpertsKernel, expert_mlp_flops
from tvm_distx.errors import DistxError, RuleError
from tvm_distx.layout.mesh import device_meshes
from tvm_distx.layout.rules import ShardingRule, pattern_entries, rules_for
from tvm_distx.passes import AnnotateSharding, SplitFusedProjections
from tvm_distx.plans.moe_dispatch import dense_dispatches, fuse_expert_dispatch
from tvm_distx.plans.patterns import Preset
from tvm_distx.reports.comm_report import comm_report

if TYPE_CHECKING:
    from tvm_distx.reports.comm_report import CommReport

__all__ = ["ExpertWeight", "MoePlan", "MoeComparison", "expert_weights", "expert_parallel",
           "expert_tensor_parallel", "compare", "choose_expert_plan", "expert_mlp_work"]

logger = logging.getLogger(__name__)

#: Operators an expert weight may pass through on its way to the matmul, with how
#: they map the output axes to input axes (None: same axes).
_LAYOUT_OPS = ("relax.permute_dims", "relax.broadcast_to", "relax.expand_dims", "relax.astype")


@dataclass(frozen=True)
class ExpertWeight:
    """A 3-D parameter holding one matrix per expert.

    Attributes
    ----------
    name : str
        The parameter of ``main``.
    experts : int
        The number of experts (the extent of ``expert_dim``).
    expert_dim : int
        The parameter axis indexing the experts.
    intermediate_dim : int or None
        The parameter axis of the experts' hidden (intermediate) features;
        None for the bias of a down projection (it has none).
    role : str
        ``"up"`` (tokens in, intermediate features out), ``"down"``, or the
        bias added to one of them, ``"up_bias"`` or ``"down_bias"``.
    """

    name: str
    experts: int
    expert_dim: int
    intermediate_dim: int | None
    role: str


def _op_name(value) -> str | None:
    op = getattr(value, "op", None)
    return getattr(op, "name", None) if isinstance(op, tvm.ir.Op) else None


def _axes_of_permute(call) -> list[int]:
    ndim = len(call.args[0].ty.shape)
    axes = call.attrs.axes
    return list(range(ndim))[::-1] if axes is None else [int(a) for a in axes]


def _trace_to_param(expr, producers, params):
    """Follow layout operators back to a parameter; returns (param, axis map) or None.

    The axis map gives, for each axis of ``expr``, the parameter axis it reads
    (None for an axis a broadcast added).
    """
    ndim = len(expr.ty.shape)
    axes: list[int | None] = list(range(ndim))
    while True:
        if isinstance(expr, tvm.relax.Var) and expr in params:
            return expr, axes
        call = producers.get(expr)
        name = _op_name(call)
        if name not in _LAYOUT_OPS:
            return None
        source = call.args[0]
        if name == "relax.permute_dims":
            perm = _axes_of_permute(call)
            axes = [perm[a] if a is not None else None for a in axes]
        elif name == "relax.broadcast_to":
            lead = len(call.ty.shape) - len(source.ty.shape)
            axes = [a - lead if a is not None and a >= lead else None for a in axes]
        elif name == "relax.expand_dims":
            out_ndim = len(call.ty.shape)
            inserted = {int(a) % out_ndim for a in call.attrs.axis}
            kept = [a for a in range(out_ndim) if a not in inserted]
            axes = [kept.index(a) if a is not None and a in kept else None for a in axes]
        expr = source


def _expert_bias(add, roles, producers, params) -> ExpertWeight | None:
    """The per-expert bias that ``add`` adds to an expert matmul's ``(E, T, N)`` result."""
    for out, other in (add.args, add.args[::-1]):
        role = roles.get(out) if isinstance(out, tvm.relax.Var) else None
        if role is None or len(other.ty.shape) != 3:
            continue
        traced = _trace_to_param(other, producers, params)
        if traced is None:
            return None
        param, axes = traced
        # one row per expert, the same for every token
        if len(param.ty.shape) != 2 or axes[0] is None or axes[1] is not None or axes[2] is None:
            return None
        return ExpertWeight(name=param.name, experts=int(param.ty.shape[axes[0]]),
                            expert_dim=axes[0],
                            intermediate_dim=axes[2] if role == "up" else None,
                            role=f"{role}_bias")
    return None


def _kernel_experts(mod: tvm.IRModule, call, params) -> list[ExpertWeight]:
    """The expert weights an experts kernel (:mod:`tvm_distx.plans.moe_dispatch`) reads, if ``call``
    is one; its description says which axes they have."""

    callee = call.args[0]
    func = mod[callee] if isinstance(callee, tvm.ir.GlobalVar) else None
    if not isinstance(func, tvm.tirx.PrimFunc) or func.attrs is None or \
            EXPERTS_ATTR not in func.attrs:
        return []
    kernel = ExpertsKernel.of(func)
    up, down = call.args[1].fields[2:4]
    out = []
    if up in params:
        out.append(ExpertWeight(up.name, kernel.experts, 0, 2 if kernel.up_transposed else 1,
                                "up"))
    if down in params:
        out.append(ExpertWeight(down.name, kernel.experts, 0,
                                1 if kernel.down_transposed else 2, "down"))
    return out


def expert_weights(mod: tvm.IRModule, function: str = "main") -> list[ExpertWeight]:
    """The expert weights of ``function``, found by the structure of the module docstring.

    Parameters
    ----------
    mod : tvm.IRModule
        An imported module before ``LegalizeOps`` (high-level ``relax.matmul``).
    function : str
        The function whose parameters are searched.

    Returns
    -------
    list of ExpertWeight
        In parameter order; empty for a model without experts.
    """
    func = mod[function]
    params = set(func.params)
    producers: dict = {}
    expert_outputs: set = set()   # values computed from an expert matmul
    found: dict[str, ExpertWeight] = {}

    def depends_on_experts(expr) -> bool:
        return any(v in expert_outputs for v in tvm.relax.analysis.free_vars(expr)) \
            if not isinstance(expr, tvm.relax.Var) else expr in expert_outputs

    roles: dict = {}  # a value computed by an expert matmul -> "up" or "down"
    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            producers[binding.var] = value
            if depends_on_experts(value):
                expert_outputs.add(binding.var)
            if _op_name(value) == "relax.call_tir":
                for weight in _kernel_experts(mod, value, params):
                    found.setdefault(weight.name, weight)
                continue
            if _op_name(value) == "relax.add":
                bias = _expert_bias(value, roles, producers, params)
                if bias is not None:
                    found.setdefault(bias.name, bias)
                continue
            if _op_name(value) != "relax.matmul":
                continue
            lhs, rhs = value.args
            if len(rhs.ty.shape) != 3:
                continue
            traced = _trace_to_param(rhs, producers, params)
            if traced is None:
                continue
            param, axes = traced
            if len(param.ty.shape) != 3 or axes[0] is None or None in axes[1:]:
                continue
            down = depends_on_experts(lhs)
            weight = ExpertWeight(
                name=param.name, experts=int(param.ty.shape[axes[0]]),
                expert_dim=axes[0], intermediate_dim=axes[1] if down else axes[2],
                role="down" if down else "up")
            found.setdefault(weight.name, weight)
            expert_outputs.add(binding.var)
            roles[binding.var] = weight.role
    order = [p.name for p in func.params]
    return sorted(found.values(), key=lambda w: order.index(w.name))


@dataclass(frozen=True)
class MoePlan:
    """A preset for a model with experts: ``base`` for the other weights, then the experts.

    Behaves like :class:`tvm_distx.plans.presets.Preset` (``rules``, ``apply``,
    ``override``); the expert weights are found in the module it is applied to.

    Parameters
    ----------
    strategy : str
        ``"expert"`` (split the expert dimension) or ``"tensor"`` (split each
        expert's intermediate dimension).
    base : Preset, optional
        Placements of the other weights: any object with
        ``rules(mod, function)`` (a :class:`tvm_distx.plans.presets.Preset`, or
        ``presets.tensor_parallel()``). Its rules for the expert weights are
        replaced by this plan's.
    model_axis, mesh_ndim : int
        The mesh axis that splits the experts, and the number of mesh axes.
    overrides : tuple of (str, str, str or None)
        ``(glob, placement, mesh)`` patterns added by :meth:`override`; they
        win over everything.
    """

    strategy: str = "expert"
    base: Preset | None = None
    model_axis: int = 0
    mesh_ndim: int = 1
    overrides: tuple[tuple[str, str, str | None], ...] = ()

    def __post_init__(self) -> None:
        if self.strategy not in ("expert", "tensor"):
            raise RuleError(f"MoePlan(strategy={self.strategy!r}): unknown strategy",
                            hint='strategy="expert" or strategy="tensor"')
        if not 0 <= self.model_axis < self.mesh_ndim:
            raise RuleError(f"MoePlan(model_axis={self.model_axis}): a mesh of "
                            f"{self.mesh_ndim} axes has no such axis",
                            hint="model_axis=0 for a 1-D mesh")

    def override(self, patterns: dict[str, str], mesh: str | None = None) -> "MoePlan":
        """This plan with ``patterns`` (glob -> placement) added last (they win)."""
        return replace(self, overrides=self.overrides + pattern_entries(patterns, mesh))

    def expert_placements(self, mod: tvm.IRModule, function: str = "main") -> dict[str, str]:
        """The placement of each expert weight of ``mod`` under this plan."""
        out = {}
        for weight in expert_weights(mod, function):
            dim = weight.expert_dim if self.strategy == "expert" else weight.intermediate_dim
            entries = ["R"] * self.mesh_ndim
            if dim is not None:  # a down projection's bias is whole in every expert slice
                entries[self.model_axis] = f"S[{dim}]"
            out[weight.name] = "".join(entries)
        return out

    def rules(self, mod: tvm.IRModule, function: str = "main") -> list[ShardingRule]:
        """The sharding rules for ``mod``'s parameters.

        Raises
        ------
        RuleError
            If ``mod`` has no expert weights (see :func:`expert_weights`).
        """
        experts = self.expert_placements(mod, function)
        if not experts:
            raise RuleError(f"'{function}' has no expert weights (3-D parameters used as the "
                            "batch operand of a matmul)", function=function,
                            hint="import the model with tvm_distx.from_torch under "
                            "tvm_distx.frontend.torch_moe.static_experts(model), before LegalizeOps; "
                            "for a dense model use presets.tensor_parallel()")
        names = [p.name for p in mod[function].params]
        overrides = Preset(self.overrides).placements(names)
        ours = {name: (placement, None) for name, placement in experts.items()}
        ours.update(overrides)
        base = [] if self.base is None else self.base.rules(mod, function)
        kept = [rule for rule in base if rule.param is None or rule.param not in ours]
        return kept + rules_for(ours, function)

    def apply(self, mod: tvm.IRModule, function: str = "main") -> tvm.IRModule:
        """``mod`` annotated with :meth:`rules`.

        For tensor parallelism inside the experts, fused projections are first
        split per segment (:class:`tvm_distx.passes.SplitFusedProjections`), so
        that a fused gate|up expert weight is cut within gate and within up, never
        between them; ``compile`` and ``run`` then take the fused weights as imported.

        For expert parallelism, each dense expert dispatch becomes one experts
        kernel (:func:`tvm_distx.plans.moe_dispatch.fuse_expert_dispatch`), which runs
        as a sparse dispatch: each rank computes only the (token, expert) pairs
        routed to its experts.
        """

        if self.strategy == "tensor":
            mod = SplitFusedProjections()(mod)
            return AnnotateSharding(self.rules(mod, function))(mod)
        rules = self.rules(mod, function)
        return AnnotateSharding(rules)(fuse_expert_dispatch(mod, function))


def expert_parallel(base: Preset | None = None, *, model_axis: int = 0,
                    mesh_ndim: int = 1) -> MoePlan:
    """Expert parallelism: each rank holds ``E / p`` whole experts; one all-reduce per layer.

    Parameters
    ----------
    base : Preset, optional
        Placements of the other weights (attention, embeddings, LM head).
    model_axis, mesh_ndim : int
        The mesh axis splitting the experts, and the number of mesh axes.

    Examples
    --------
    >>> plan = expert_parallel(base=megatron(column=["*q_proj_weight"], row=["*o_proj_weight"]))
    ...                                                      # doctest: +SKIP
    >>> annotated = plan.apply(set_device_meshes(mod, [(2,)]))    # doctest: +SKIP
    """
    return MoePlan("expert", base, model_axis, mesh_ndim)


def expert_tensor_parallel(base: Preset | None = None, *, model_axis: int = 0,
                           mesh_ndim: int = 1) -> MoePlan:
    """Expert tensor parallelism: every expert's intermediate dimension split (Megatron inside it).

    Each rank holds a slice of every expert; one all-reduce of the ``(E, T, H)``
    expert outputs per MoE layer. Parameters as :func:`expert_parallel`.
    """
    return MoePlan("tensor", base, model_axis, mesh_ndim)


@dataclass(frozen=True)
class MoeComparison:
    """Both plans' communication and work; ``chosen`` is the cheaper.

    See :func:`choose_expert_plan`.

    Attributes
    ----------
    expert, tensor : CommReport or None
        The comm reports of :func:`expert_parallel` and :func:`expert_tensor_parallel`;
        None for a plan the module cannot be lowered with (its reason in ``refused``).
    chosen : str
        ``"expert"`` or ``"tensor"``.
    expert_flops, tensor_flops : float or None
        Expert-MLP floating-point operations per token on each rank, summed over
        the MoE layers. Expert parallelism runs the sparse dispatch: ``k / p``
        expert MLPs per token when the routing is balanced (the exact figure
        is the routed pairs on the rank's experts). Tensor parallelism inside
        the experts runs every expert, masked, on every token: ``E / p``
        (as expert parallelism did before the sparse dispatch). None when the
        dispatch is not the one :mod:`tvm_distx.plans.moe_dispatch` reads.
    """

    expert: CommReport | None
    tensor: CommReport | None
    chosen: str
    expert_flops: float | None = None
    tensor_flops: float | None = None
    refused: dict[str, str] = field(default_factory=dict)

    @staticmethod
    def collectives(report) -> list:
        """The rows of ``report`` that communicate (a local slice does not)."""
        return [r for r in report.rows if r.collective != "local_slice"]

    @staticmethod
    def _cost(report) -> tuple[int, int]:
        return report.total_bytes_per_rank, len(MoeComparison.collectives(report))

    def __str__(self) -> str:
        lines = ["plan                     collectives  bytes/rank  expert-MLP flops/token/rank"]
        for label, key, report, flops in (
                ("expert parallel", "expert", self.expert, self.expert_flops),
                ("tensor parallel experts", "tensor", self.tensor, self.tensor_flops)):
            mark = "  <- chosen" if key == self.chosen else ""
            if report is None:
                lines.append(f"{label:<24} cannot be lowered: {self.refused.get(key, '')}")
                continue
            rows = self.collectives(report)
            kinds = ", ".join(sorted({r.collective for r in rows})) or "-"
            work = "-" if flops is None else f"{round(flops):,}"
            lines.append(f"{label:<24} {len(rows):>11}  {report.total_bytes_per_rank:>10,}"
                         f"  {work:>27}  ({kinds}){mark}")
        return "\n".join(lines)


def expert_mlp_work(mod: tvm.IRModule, ranks: int,
                    function: str = "main") -> tuple[float | None, float | None]:
    """Expert-MLP flops per token and rank: (expert parallel, sparse; tensor parallel, dense).

    Parameters
    ----------
    mod : tvm.IRModule
        An imported module (its dense dispatches are read, see
        :func:`tvm_distx.plans.moe_dispatch.dense_dispatches`).
    ranks : int
        The ranks sharing the experts.

    Returns
    -------
    tuple of (float or None, float or None)
        See :class:`MoeComparison`; ``(None, None)`` without a dispatch read.
    """

    found = dense_dispatches(mod, function)
    if not found:
        return None, None
    per_token = [expert_mlp_flops(d.kernel.hidden, d.kernel.intermediate) for d in found]
    tensor = sum(d.kernel.experts * f for d, f in zip(found, per_token)) / ranks
    if any(d.top_k is None for d in found):
        return None, tensor
    return sum(d.top_k * f for d, f in zip(found, per_token)) / ranks, tensor


def compare(mod: tvm.IRModule, base: Preset | None = None, *, model_axis: int = 0,
            mesh_ndim: int = 1, function: str = "main") -> MoeComparison:
    """Plan ``mod`` both ways and compare the collectives each needs.

    Parameters
    ----------
    mod : tvm.IRModule
        An imported module with its meshes (:func:`tvm_distx.set_device_meshes`).
    base : Preset, optional
        Placements of the other weights, shared by both plans.

    Returns
    -------
    MoeComparison
    """

    reports, refused, errors = {}, {}, {}
    for strategy in ("expert", "tensor"):
        plan = MoePlan(strategy, base, model_axis, mesh_ndim)
        try:
            reports[strategy] = comm_report(run_stages(plan.apply(mod, function))["local_view"])
        except DistxError as err:  # this plan cannot be lowered (say, over run-time extents)
            reports[strategy], errors[strategy] = None, err
            refused[strategy] = str(err).splitlines()[0]
    if len(errors) == 2:
        raise errors["expert"]
    cheaper = min((s for s in ("expert", "tensor") if reports[s] is not None),
                  key=lambda s: (MoeComparison._cost(reports[s]), s != "expert"))

    meshes = list(device_meshes(mod).values())
    ranks = meshes[0].shape[model_axis] if meshes else 1
    result = MoeComparison(reports["expert"], reports["tensor"], cheaper,
                           *expert_mlp_work(mod, ranks, function), refused=refused)
    logger.info("MoE plans compared:\n%s", result)
    return result


def choose_expert_plan(mod: tvm.IRModule, base: Preset | None = None, *, model_axis: int = 0,
                       mesh_ndim: int = 1, function: str = "main") -> MoePlan:
    """The cheaper of :func:`expert_parallel` and :func:`expert_tensor_parallel` for ``mod``.

    Cheaper means fewer bytes received per rank, then fewer collectives; a tie
    goes to expert parallelism. See :func:`compare` for both reports.
    """
    chosen = compare(mod, base, model_axis=model_axis, mesh_ndim=mesh_ndim,
                     function=function).chosen
    return MoePlan(chosen, base, model_axis, mesh_ndim)

