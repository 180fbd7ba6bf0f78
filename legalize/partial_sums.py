"""Partial sums after the local view: what TVM's all-reduce really is, and how to complete it.

A kernel whose summed (contraction) dimension is split along mesh axis ``a``
leaves on every rank of ``a`` a full-shape addend of its result: the result is
a *partial sum*, ``"P"`` on ``a``. TVM's DTensor types cannot say ``P``, so
``LowerGlobalViewToLocalView`` keeps TVM's convention: it binds the kernel's
result, then an ``R.ccl.allreduce`` of it typed replicated on *every* mesh
axis. This module is the one place that reads that convention back:

* :func:`partial_sum` says, for such an all-reduce, what is summed: the
  kernel's result and its true layout, the kernel's type (which on a 2-D mesh
  is not all-replicated) with :class:`~tvm_distx.layout.Partial` on the mesh
  axes the sum runs over;
* :func:`true_sharding` gives the layout a value really has (an all-reduce
  keeps its input's layout);
* :func:`plan_completion` asks the planner how the partial sum reaches a
  destination layout: ``P -> R`` is an all-reduce, ``P -> S[i]`` one
  reduce-scatter (each rank of the group keeps its block of the sum: half the
  bytes of an all-reduce), and the planner's other steps for whatever else
  differs;
* :func:`fold_targets` finds the all-reduces whose only use is a redistribute
  that splits the sum on its own mesh axis, which
  :class:`~tvm_distx.legalize.LegalizeRedistribute` emits as one reduce-scatter
  and :func:`tvm_distx.reports.comm_report` reports as one.

``LegalizeRedistribute``, ``LowerDistIR`` and the comm report all ask these
functions; none of them reverse-engineers the all-reduce itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping

from tvm import relax

from tvm_distx.ir import helpers as _ir
from tvm_distx.layout import Partial, Placement, Replicate, TensorSharding

from tvm_distx.legalize.planner import Collective, RedistPlan, plan_redistribute

__all__ = ["PartialSum", "completed", "partial_sum", "true_sharding", "reduced_axes", "plan_completion",
           "fold_targets", "ALLREDUCE_OP"]

logger = logging.getLogger(__name__)

#: The operator TVM's local view inserts after a kernel with a split reduction.
ALLREDUCE_OP = "relax.ccl.allreduce"


@dataclass(frozen=True)
class PartialSum:
    """The partial sum an ``R.ccl.allreduce`` of TVM's local view completes.

    Parameters
    ----------
    addends : relax.Expr
        The all-reduce's input: on every rank, its addend of the sum.
    layout : TensorSharding
        The true layout of the addends: the kernel's layout with
        :class:`~tvm_distx.layout.Partial` on the summed mesh axes (``"P"``,
        ``"S[0]P"``).
    kind : str
        The all-reduce's reduction, a key of :data:`tvm_distx.ccl.REDUCE_KINDS`
        (``"sum"`` for every sharded reduction propagation allows).
    """

    addends: relax.Expr
    layout: TensorSharding
    kind: str = "sum"

    @property
    def axes(self) -> tuple[int, ...]:
        """The mesh axes the sum runs over."""
        return self.layout.placement.partial_axes()

    @property
    def completed(self) -> TensorSharding:
        """The layout of the completed sum (the summed axes replicated), as TVM types it."""
        return TensorSharding(self.layout.mesh, completed(self.layout.placement))


def completed(placement: Placement) -> Placement:
    """``placement`` with its partial sums replicated: how TVM's DTensor types write it."""
    return Placement(tuple(Replicate() if e.is_partial() else e for e in placement.entries))


def true_sharding(value: relax.Expr,
                  bound: Mapping[relax.Var, relax.Expr]) -> TensorSharding | None:
    """The sharding ``value`` really has after TVM's local view; its type may not say it.

    An all-reduce completes partial sums and keeps its input's layout (``"R,
    S[0]"`` on a 2x4 mesh, say), whatever TVM's type says, so that input's type
    is the truth.

    Parameters
    ----------
    value : relax.Expr
        The value; a variable is followed through ``bound`` (and its aliases).
    bound : mapping of relax.Var to relax.Expr
        The value each variable of the function is bound to.

    Returns
    -------
    TensorSharding or None
        None when the value is not a DTensor.
    """
    seen = set()
    while isinstance(value, relax.Var) and value in bound and value not in seen:
        seen.add(value)
        bound_value = bound[value]
        if _ir.is_call_to(bound_value, ALLREDUCE_OP):
            return TensorSharding.from_type(bound_value.args[0].ty)
        if not isinstance(bound_value, relax.Var):
            break
        value = bound_value
    return TensorSharding.from_type(value.ty)


def reduced_axes(producer: relax.Call, out: TensorSharding,
                 bound: Mapping[relax.Var, relax.Expr] | None = None) -> tuple[int, ...]:
    """Mesh axes that shard an input of ``producer`` but replicate its result ``out``.

    ``bound`` (variable to bound value) lets an input that is itself an
    all-reduce result count with its true layout (a reduction of a matmul's
    result on a 2-D mesh).
    """
    inputs = []
    for arg in producer.args:
        items = arg.fields if isinstance(arg, relax.Tuple) else [arg]
        for item in items:
            sharding = true_sharding(item, bound or {})
            if sharding is not None:
                inputs.append(sharding)
    return tuple(axis for axis, entry in enumerate(out.placement.entries)
                 if not entry.is_shard()
                 and any(s.placement.entries[axis].is_shard() for s in inputs))


def partial_sum(call: relax.Call, bound: Mapping[relax.Var, relax.Expr]) -> PartialSum | None:
    """What the all-reduce ``call`` (of TVM's local view) completes; None if it cannot tell.

    The summed mesh axes are those that split an operand of the kernel that
    produced the all-reduce's input but not its result.

    Parameters
    ----------
    call : relax.Call
        An ``R.ccl.allreduce``.
    bound : mapping of relax.Var to relax.Expr
        The value each variable of the function is bound to.
    """
    source = call.args[0]
    sharding = TensorSharding.from_type(source.ty)
    producer = bound.get(source) if isinstance(source, relax.Var) else None
    if sharding is None or not isinstance(producer, relax.Call):
        return None
    axes = reduced_axes(producer, sharding, bound) or _axes_upstream(producer, bound)
    if not axes:
        return None
    entries = tuple(Partial() if a in axes else e
                    for a, e in enumerate(sharding.placement.entries))
    return PartialSum(source, TensorSharding(sharding.mesh, Placement(entries)),
                      str(call.attrs.op_type))


def _axes_upstream(producer: relax.Call, bound: Mapping[relax.Var, relax.Expr]) -> tuple[int, ...]:
    """The summed axes of addends combined by linear kernels before their all-reduce.

    :class:`~tvm_distx.legalize.merge_allreduce.MergeAllReduces` runs kernels
    that are linear in partial sums on the addends (``add(a, b)`` of two
    row-parallel results) and completes the result with one all-reduce. An
    addend is only ever consumed that way or by its all-reduce, so the first
    kernel reached through the local kernels' operands that reduces a split
    axis is one of the sharded reductions summed. All-reduce results,
    redistributes and parameters end the search.
    """
    seen: set[relax.Var] = set()
    stack = [producer]
    while stack:
        call = stack.pop()
        if not _ir.is_call_to(call, _LOCAL_KERNEL) or not isinstance(call.args[1], relax.Tuple):
            continue
        for arg in reversed(call.args[1].fields):
            source = bound.get(arg) if isinstance(arg, relax.Var) and arg not in seen else None
            if not _ir.is_call_to(source, _LOCAL_KERNEL):
                continue  # an all-reduce's or a redistribute's result is complete
            seen.add(arg)
            out = TensorSharding.from_type(arg.ty)
            axes = reduced_axes(source, out, bound) if out is not None else ()
            if axes:
                return axes
            stack.append(source)
    return ()


_LOCAL_KERNEL = "relax.dist.call_tir_local_view"


# ---------------------------------------------------------------------- planning
def plan_completion(partial: PartialSum, dst: TensorSharding | None, shape, dtype, *,
                    allow_send_recv: bool = True) -> RedistPlan:
    """The planner's plan from the partial sum to ``dst`` (to its completed layout if None).

    ``P -> R`` on a summed axis is an all-reduce, ``P -> S[i]`` a
    reduce-scatter; see :func:`~tvm_distx.legalize.planner.plan_redistribute`.

    Parameters
    ----------
    partial : PartialSum
    dst : TensorSharding or None
    shape : sequence of int
        The static global shape.
    dtype : str
    allow_send_recv : bool
        Passed to the planner.
    """
    return plan_redistribute(partial.layout, partial.completed if dst is None else dst, shape,
                             dtype, allow_send_recv=allow_send_recv)


def fold_targets(func: relax.Function) -> dict[relax.Var, relax.Var]:
    """All-reduces that one redistribute completes as a reduce-scatter instead.

    Returns
    -------
    dict of relax.Var to relax.Var
        For every redistribute of ``func`` whose source is bound to an
        ``R.ccl.allreduce`` used nowhere else, and whose destination splits a
        summed mesh axis (so that :func:`plan_completion` reduce-scatters),
        the all-reduce's variable mapped to the redistribute's.
    """
    bound: dict[relax.Var, relax.Expr] = {}
    uses: dict[relax.Var, int] = {}
    redistributes = []
    for block in func.body.blocks:
        for binding in block.bindings:
            bound[binding.var] = binding.value
            for var in _vars_used(binding.value):
                uses[var] = uses.get(var, 0) + 1
            if _ir.is_call_to(binding.value, "relax.dist.redistribute"):
                redistributes.append(binding)
    for var in _vars_used(func.body.body):
        uses[var] = uses.get(var, 0) + 1
    out = {}
    for binding in redistributes:
        source = binding.value.args[0]
        if not isinstance(source, relax.Var) or uses.get(source) != 1:
            continue
        if not _ir.is_call_to(bound.get(source), ALLREDUCE_OP):
            continue
        partial = partial_sum(bound[source], bound)
        shape = _ir.static_shape(binding.var.ty)
        dst = TensorSharding.from_type(binding.var.ty)
        if (partial is None or partial.kind != "sum" or dst is None or shape is None
                or None in shape or dst.mesh != partial.layout.mesh):
            continue
        plan = plan_completion(partial, dst, shape, binding.var.ty.tensor_ty.dtype)
        if any(step.collective is Collective.REDUCE_SCATTER for step in plan.steps):
            out[source] = binding.var
    return out


def _vars_used(expr) -> list[relax.Var]:
    found: list[relax.Var] = []
    relax.analysis.post_order_visit(
        expr, lambda e: found.append(e) if isinstance(e, relax.Var) else None)
    return found
