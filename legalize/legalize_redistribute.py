"""``LegalizeRedistribute``: every ``R.dist.redistribute`` becomes its planned collectives.

TVM's pass of the same name handles a 1-D mesh and R->S only. This one asks
:func:`tvm_distx.legalize.planner.plan_redistribute` for the cheapest sequence of
steps and writes one destination-passing call of a runtime function per step
(the ABI is :mod:`tvm_distx.ccl`):

==============  =====================================  ==========================
step            runtime function                       extra arguments
==============  =====================================  ==========================
local slice     ``tvm_distx.ccl.local_slice``          group, split dim
all-gather      ``tvm_distx.ccl.allgather``            group, gather dim
all-to-all      ``tvm_distx.ccl.alltoall``             group, split dim, concat dim
send/recv       ``tvm_distx.ccl.send_recv``            a :class:`~tvm_distx.ccl.SendRecvSpec`
reduce-scatter  ``tvm_distx.ccl.reducescatter``        kind, group, split dim
==============  =====================================  ==========================

A redistribute of a partial sum (the ``R.ccl.allreduce`` TVM's local view puts
after a kernel whose summed dimension is split) that splits the sum on its own
mesh axis, when the all-reduce has no other use, is planned from the partial
sum itself (:func:`~tvm_distx.legalize.partial_sums.plan_completion`): the
all-reduce and the slice after it become one reduce-scatter, which receives
half the bytes of the all-reduce. Other all-reduces stay, and
:class:`~tvm_distx.legalize.LowerDistIR` lowers them.

With ``tvm_forms=True`` a local slice on a one-axis mesh of all the module's
devices is written as TVM's ``R.dist.redistribute_replica_to_shard`` instead,
the form TVM's ``LowerDistIR`` understands (it leaves our packed call typed as
a DTensor, which then fails to build). Use it when TVM's ``LowerDistIR``
follows; our :class:`~tvm_distx.legalize.LowerDistIR` lowers either form to
the same local slice.

The group is a :class:`~tvm_distx.ccl.CollectiveGroup` along the step's mesh
axis, so on an N-D mesh every collective runs among the ranks of one mesh axis
only. A move between two meshes (pipeline stages) is one send/recv whose spec
names both meshes. The calls keep ``R.DTensor`` types (each step's destination
sharding); :class:`~tvm_distx.legalize.LowerDistIR` makes them rank-local and,
for a move between meshes, gives each rank its side of it (send, receive or
both).
"""

from __future__ import annotations

import logging

from tvm import relax
import tvm
from tvm.relax.distributed import DTensorType
from tvm.relax.expr_functor import PyExprMutator, mutator

from tvm_distx import ccl
from tvm_distx.errors import UnsupportedProgramError
from tvm_distx.ir import helpers as _ir
from tvm_distx.ir.module_pass import module_pass
from tvm_distx.layout import TensorSharding
from tvm_distx.legalize.lower_distir import module_devices
from tvm_distx.legalize.partial_sums import (completed, fold_targets, partial_sum, plan_completion,
                                             true_sharding)
from tvm_distx.legalize.planner import Collective, plan_redistribute

__all__ = ["LegalizeRedistribute", "RUNTIME_FUNCTIONS"]

logger = logging.getLogger(__name__)

#: Whether plans may use a point-to-point SEND_RECV within one mesh (the
#: planner picks it where no sequence of collectives reaches the lower bound).
ALLOW_SEND_RECV = True

#: The runtime function each planned step calls.
RUNTIME_FUNCTIONS = {
    Collective.LOCAL_SLICE: ccl.LOCAL_SLICE,
    Collective.ALL_GATHER: ccl.ALLGATHER,
    Collective.ALL_TO_ALL: ccl.ALLTOALL,
    Collective.SEND_RECV: ccl.SEND_RECV,
    Collective.ALL_REDUCE: ccl.ALLREDUCE,
    Collective.REDUCE_SCATTER: ccl.REDUCE_SCATTER,
}



@mutator
class _Legalizer(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, function: str,
                 folds: dict[relax.Var, relax.Var], tvm_world: int | None = None) -> None:
        super().__init__(mod)
        self.function = function
        self.tvm_world = tvm_world  # device count when local slices take TVM's form
        self.bound: dict[relax.Var, relax.Expr] = {}
        self.folds = folds  # all-reduce var -> the redistribute that completes it

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        self.bound[binding.var] = binding.value
        if binding.var in self.folds:
            return  # completed by its redistribute, as a reduce-scatter
        if not _ir.is_call_to(binding.value, "relax.dist.redistribute"):
            super().visit_var_binding_(binding)
            return
        if binding.value.args[0] in self.folds:
            self._complete_partial_sum(binding)
            return
        source = self.visit_expr(binding.value.args[0])
        src = true_sharding(binding.value.args[0], self.bound)
        dst = TensorSharding.from_type(binding.var.ty)
        shape = _ir.static_shape(binding.var.ty)
        if src is None or dst is None or shape is None:
            raise UnsupportedProgramError(
                "a redistribute needs DTensor operands with a known shape",
                function=self.function,
                var=binding.var.name,
                hint="run PropagateSharding first",
            )
        plan = _plan_with_symbolic_extents(src, dst, shape, binding.var.ty.tensor_ty.dtype,
                                           _ir_dims(binding.var.ty))
        if plan is None:
            raise UnsupportedProgramError(
                f"redistributing a tensor with a symbolic (run-time) dimension from "
                f"\"{src.placement}\" to \"{dst.placement}\" is not supported yet: a symbolic "
                "extent may ride along a collective or a move between meshes, but not be cut, "
                "gathered or exchanged along (a local slice may cut it where its parts always "
                "divide it)",
                function=self.function,
                var=binding.var.name,
                placement=str(dst.placement),
                hint="keep the layout of tensors with symbolic dimensions through the function "
                "(annotate them once), or give this dimension a static size",
            )
        value = source
        for step in plan.steps:
            value = self._emit_step(value, step, binding.var)
        mistyped = not plan.steps and TensorSharding.from_type(value.ty) != dst
        if mistyped or (isinstance(value, relax.DataflowVar)
                        and not isinstance(binding.var, relax.DataflowVar)):
            # the redistributed value leaves its dataflow block: keep it an output;
            # or nothing moves but the source's type is TVM's wrong one (see
            # true_sharding): keep the binding, whose type is the true layout
            self.builder_.emit_normalized(relax.VarBinding(binding.var, value))
        else:
            self.set_var_remap(binding.var, value)

    def _complete_partial_sum(self, binding: relax.VarBinding) -> None:
        """A redistribute of a partial sum: the planner's plan from ``P``, a reduce-scatter first."""
        partial = partial_sum(self.bound[binding.value.args[0]], self.bound)
        dst = TensorSharding.from_type(binding.var.ty)
        plan = plan_completion(partial, dst, _ir.static_shape(binding.var.ty),
                               binding.var.ty.tensor_ty.dtype, allow_send_recv=ALLOW_SEND_RECV)
        logger.info("%s: '%s' completes the partial sum %s as %s: %s", self.function,
                    binding.var.name, partial.layout.placement, dst.placement,
                    ", ".join(step.collective.name for step in plan.steps))
        value = self.visit_expr(partial.addends)
        for step in plan.steps:
            value = self._emit_step(value, step, binding.var, partial.kind)
        if isinstance(value, relax.DataflowVar) and not isinstance(binding.var, relax.DataflowVar):
            self.builder_.emit_normalized(relax.VarBinding(binding.var, value))
        else:
            self.set_var_remap(binding.var, value)

    def _emit_step(self, value, step, var: relax.Var, kind: str = "sum"):
        mesh = step.src.mesh
        # every step stays on the destination mesh (a move between meshes is one step);
        # a partial sum left on another axis is typed completed, as TVM types it
        out_ty = DTensorType(var.ty.tensor_ty, var.ty.device_mesh,
                             completed(step.dst.placement).to_tvm())
        if step.collective is Collective.LOCAL_SLICE and self._tvm_can_slice(mesh):
            call = relax.op.distributed.redistribute_replica_to_shard(
                value, num_workers=mesh.size, axis=step.tensor_axes[0])
            return self.builder_.emit(call, name_hint=f"{var.name}_local_slice")
        if step.collective is Collective.SEND_RECV:
            spec = ccl.SendRecvSpec(tuple(ccl.RUN_TIME if extent is None else extent
                                          for extent in _ir.static_shape(var.ty)),
                                    step.src, step.dst)
            args = [value, relax.ShapeExpr(spec.encode())]
        else:
            group = relax.ShapeExpr(ccl.CollectiveGroup.along(mesh, (step.mesh_axis,)).encode())
            axes = [relax.ShapeExpr(list(step.tensor_axes))] if step.tensor_axes else []
            if step.collective in (Collective.ALL_REDUCE, Collective.REDUCE_SCATTER):
                args = [value, relax.prim_value(ccl.REDUCE_KINDS[kind]), group, *axes]
            else:
                args = [value, group, *axes]
        # relax.call_dps_packed() accepts only Tensor result types; build the call
        # itself so that it carries the step's DTensor type until LowerDistIR.
        call = relax.Call(_ir.op("relax.call_dps_packed"),
                          [relax.ExternFunc(RUNTIME_FUNCTIONS[step.collective]),
                           relax.Tuple(args)],
                          ty_args=[out_ty])
        return self.builder_.emit(call, name_hint=f"{var.name}_{step.collective.name.lower()}")

    def _tvm_can_slice(self, mesh) -> bool:
        """Whether TVM's replica-to-shard (which slices over every worker) says this slice."""
        return (self.tvm_world is not None and len(mesh.shape) == 1
                and mesh.device_range == range(self.tvm_world))


def _plan_with_symbolic_extents(src: TensorSharding, dst: TensorSharding, shape, dtype,
                                dims=None):
    """The plan of a redistribute; with symbolic dimensions, only steps that keep them whole.

    The plan is made on a stand-in extent for each symbolic dimension that every
    mesh axis divides. Every step of it must then work on the extents the arrays
    have at run time:

    * a collective within one mesh (an all-gather, a reduce-scatter, an all-to-all
      or a local slice) reads the extents of the blocks it is given, so it may
      carry a symbolic dimension that it does not cut or concatenate along;
    * a local slice may cut one too when the dimension's extent is a multiple of
      its parts for every value of its variables (``4 * n`` in 2 parts: ``dims``,
      the extents as expressions, say so);
    * a send/recv between two meshes (pipeline stages) moves whole what neither
      side splits: the ranks that only receive learn the run-time extents from
      the senders first (:meth:`tvm_distx.ccl.SendRecvSpec.header`).

    Any other plan (a symbolic dimension cut or gathered, or a send/recv within a
    mesh along it) returns None.
    """
    if None not in shape:
        return plan_redistribute(src, dst, shape, dtype, allow_send_recv=ALLOW_SEND_RECV)
    stand_in = max(src.mesh.size, dst.mesh.size)
    symbolic = {d for d, extent in enumerate(shape) if extent is None}
    cuttable = {d for d in symbolic if _divides_always(dims, d, _parts(dst, d))}
    plan = plan_redistribute(src, dst, tuple(stand_in if e is None else e for e in shape),
                             dtype, allow_send_recv=ALLOW_SEND_RECV)
    return plan if all(_keeps_whole(step, symbolic, cuttable) for step in plan.steps) else None


def _keeps_whole(step, symbolic: set[int], cuttable: set[int]) -> bool:
    """Whether one planned step works on run-time extents (see the caller)."""
    if step.collective is Collective.LOCAL_SLICE:
        return not (symbolic - cuttable) & set(step.tensor_axes)
    if step.collective is Collective.SEND_RECV:
        return step.src.mesh != step.dst.mesh and not any(
            _parts(sharding, d) > 1 for sharding in (step.src, step.dst) for d in symbolic)
    if step.collective in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER,
                           Collective.ALL_TO_ALL, Collective.ALL_REDUCE):
        return not symbolic & set(step.tensor_axes)
    return False


def _ir_dims(ty) -> list | None:
    """The extents of a (D)tensor type as expressions, None if its shape is not known."""
    tensor = ty.tensor_ty if isinstance(ty, DTensorType) else ty
    shape = getattr(tensor, "shape", None)
    return list(shape.values) if isinstance(shape, relax.ShapeExpr) else None


def _parts(sharding: TensorSharding, dim: int) -> int:
    """How many parts ``sharding`` cuts tensor dimension ``dim`` into."""
    parts = 1
    for axis, entry in enumerate(sharding.placement.entries):
        if entry.is_shard(dim):
            parts *= sharding.mesh.shape[axis]
    return parts


def _divides_always(dims, dim: int, parts: int) -> bool:
    """Whether ``parts`` divides the extent ``dims[dim]`` whatever its variables' values."""
    if dims is None or dim >= len(dims):
        return False
    extent = dims[dim]
    return bool(tvm.sym.Analyzer().can_prove(
        tvm.tirx.floormod(extent, tvm.tirx.const(parts, extent.ty.dtype)) == 0))


@module_pass(name="tvm_distx.LegalizeRedistribute")
class LegalizeRedistribute:
    """Replace every ``R.dist.redistribute`` by the planned collective calls.

    Parameters
    ----------
    tvm_forms : bool
        Write a local slice on a one-axis mesh of all the module's devices as
        TVM's ``R.dist.redistribute_replica_to_shard``, for TVM's
        ``LowerDistIR`` to follow (see the module documentation).
    """

    def __init__(self, *, tvm_forms: bool = False) -> None:
        self.tvm_forms = tvm_forms

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:

        world = len(module_devices(mod)) if self.tvm_forms else None
        out = mod.clone()
        for gv, func in mod.functions.items():
            if isinstance(func, relax.Function) and _has_redistribute(func):
                legalizer = _Legalizer(mod, gv.name_hint, fold_targets(func), world)
                out[gv] = legalizer.visit_expr(func)
        return out


def _has_redistribute(func: relax.Function) -> bool:
    found = []
    relax.analysis.post_order_visit(
        func, lambda e: found.append(e) if _ir.is_call_to(e, "relax.dist.redistribute") else None
    )
    return bool(found)
