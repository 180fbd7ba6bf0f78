"""Partial sums after the local view: what TVM's all-reduce really is, and how to complete it.

A kernel whose summed (contraction) dimension is split along mesh axis ``a``
leaves on every rank of ``a`` a full-shape addend of its result: the result is
a *partial sum*, ``"P"`` on ``a``. TVM's DTensor types cannot say ``P``, so
``LowerGlobalViewToLocalView`` keeps TVM's convention: it binds the kernel's
result, then an ``R.ccl.allreduce`` of it typed replicated on *every* mesh
axis. This module is the one place that reads that convention back:

* :func:`partial_sum` says, for such an all-reduce, what is summed: the
  kernel's result, its true layout (the kernel's type, which on a 2-D mesh is
  not all-replicated) and the mesh axes the sum runs over;
* :func:`true_sharding` gives the layout a value really has (an all-reduce
  keeps its input's layout);
* :func:`plan_completion` plans how a partial sum reaches a destination
  layout: ``P -> R`` is an all-reduce, ``P -> S[i]`` one reduce-scatter
  (each rank of the group keeps its block of the sum: half the bytes of an
  all-reduce), then the planner's steps for whatever else differs;
* :func:`fold_targets` finds the all-reduces whose only use is a redistribute
  that splits the sum on its own mesh axis, which
  :class:`~tvm_distx.legalize.LegalizeRedistribute` emits as one reduce-scatter
  and :func:`tvm_distx.comm_report` reports as one.

``LegalizeRedistribute``, ``LowerDistIR`` and the comm report all ask these
functions; none of them reverse-engineers the all-reduce itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping

import numpy as np
from tvm import relax

from tvm_distx import _ir
from tvm_distx.placement import Placement, Shard
from tvm_distx.spec import TensorSharding

from .planner import RedistStep, dtype_itemsize, plan_redistribute

__all__ = ["PartialSum", "CompletionStep", "CompletionPlan", "partial_sum", "true_sharding",
           "reduced_axes", "plan_completion", "fold_targets", "ALLREDUCE_OP"]

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
    sharding : TensorSharding
        The true layout of the addends and of the completed sum: the kernel's
        type, replicated on ``axes``.
    axes : tuple of int
        The mesh axes the sum runs over (``"P"`` on each).
    kind : str
        The reduction, a key of :data:`tvm_distx.ccl.REDUCE_KINDS` (``"sum"``).
    """

    addends: relax.Expr
    sharding: TensorSharding
    axes: tuple[int, ...]
    kind: str

    def placement_text(self) -> str:
        """The layout before completion, ``"P"`` on the summed axes (``"S[0]P"``)."""
        return "".join("P" if a in self.axes else str(e)
                       for a, e in enumerate(self.sharding.placement.entries))


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
    axes = reduced_axes(producer, sharding, bound)
    if not axes:
        return None
    return PartialSum(source, sharding, axes, str(call.attrs.op_type))


# ---------------------------------------------------------------------- planning
@dataclass(frozen=True)
class CompletionStep:
    """The collective that completes a partial sum along one mesh axis.

    Parameters
    ----------
    mesh_axis : int
        The mesh axis whose sub-groups run it.
    collective : str
        ``"allreduce"`` (``P -> R``) or ``"reducescatter"`` (``P -> S[dim]``).
    dim : int or None
        The split dimension of a reduce-scatter.
    dst : TensorSharding
        The layout after it.
    bytes_received : int
        Per rank, ring algorithms: ``2 s (p-1)/p`` for an all-reduce and
        ``s (p-1)/p`` for a reduce-scatter (``s`` the addend's local bytes).
    """

    mesh_axis: int
    collective: str
    dim: int | None
    dst: TensorSharding
    bytes_received: int


@dataclass(frozen=True)
class CompletionPlan:
    """How a partial sum reaches ``dst``: completion steps, then the planner's steps."""

    partial: PartialSum
    dst: TensorSharding
    completion: tuple[CompletionStep, ...]
    steps: tuple[RedistStep, ...]

    @property
    def bytes_received(self) -> int:
        """Per rank, the sum over all steps."""
        return (sum(s.bytes_received for s in self.completion)
                + sum(s.bytes_received for s in self.steps))

    @property
    def reduce_scatters(self) -> bool:
        """True when some step is a reduce-scatter (the sum is never all-reduced there)."""
        return any(s.collective == "reducescatter" for s in self.completion)


def plan_completion(partial: PartialSum, dst: TensorSharding | None, shape, dtype, *,
                    allow_send_recv: bool = True) -> CompletionPlan:
    """Plan ``P -> dst`` for a partial sum: reduce-scatter where ``dst`` splits a summed axis.

    On a summed axis ``a`` where ``dst`` is ``S[i]`` and ``a`` may be the
    innermost split of ``i`` (no later mesh axis splits ``i`` in the sum's
    layout), the sum is reduce-scattered along ``i``; every other summed axis
    is all-reduced. The planner then moves the result to ``dst``
    (:func:`~tvm_distx.legalize.planner.plan_redistribute`). With ``dst`` None,
    the sum is completed in place (all-reduces only: ``P -> R``).

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
    shape = tuple(int(n) for n in shape)
    itemsize = dtype_itemsize(dtype)
    mesh = partial.sharding.mesh
    entries = list(partial.sharding.placement.entries)
    local = int(np.prod(partial.sharding.local_shape(shape))) * itemsize
    completion = []
    # reduce-scatters first (each shrinks what later steps move), then all-reduces
    scatter = {}
    for axis in partial.axes:
        want = dst.placement.entries[axis] if dst is not None and dst.mesh == mesh else None
        if (isinstance(want, Shard) and not any(e.is_shard(want.dim)
                                                for e in entries[axis + 1:])
                and shape[want.dim] % _parts(entries, want.dim, mesh, axis) == 0):
            scatter[axis] = want.dim
    for axis in partial.axes:
        if axis not in scatter:
            continue
        p = mesh.shape[axis]
        entries[axis] = Shard(scatter[axis])
        after = TensorSharding(mesh, Placement(tuple(entries)))
        completion.append(CompletionStep(axis, "reducescatter", scatter[axis], after,
                                         local * (p - 1) // p))
        local //= p
    for axis in partial.axes:
        if axis in scatter:
            continue
        p = mesh.shape[axis]
        after = TensorSharding(mesh, Placement(tuple(entries)))
        completion.append(CompletionStep(axis, "allreduce", None, after,
                                         2 * local * (p - 1) // p))
    done = TensorSharding(mesh, Placement(tuple(entries)))
    steps: tuple[RedistStep, ...] = ()
    if dst is not None and dst != done:
        steps = plan_redistribute(done, dst, shape, dtype, allow_send_recv=allow_send_recv).steps
    return CompletionPlan(partial, dst if dst is not None else done, tuple(completion), steps)


def _parts(entries, dim: int, mesh, axis: int) -> int:
    """How many blocks ``dim`` has once ``axis`` splits it too."""
    parts = mesh.shape[axis]
    for a, e in enumerate(entries):
        if a != axis and e.is_shard(dim):
            parts *= mesh.shape[a]
    return parts


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
        if partial is None or dst is None or shape is None or None in shape:
            continue
        if plan_completion(partial, dst, shape, binding.var.ty.tensor_ty.dtype).reduce_scatters:
            out[source] = binding.var
    return out


def _vars_used(expr) -> list[relax.Var]:
    found: list[relax.Var] = []
    relax.analysis.post_order_visit(
        expr, lambda e: found.append(e) if isinstance(e, relax.Var) else None)
    return found
