"""``LowerGlobalViewToLocalView``: TVM's pass, steered around what it gets wrong.

TVM's pass rewrites each ``call_tir`` on DTensors into a kernel over the local
shard. When two mesh axes split the same tensor dimension (``"S[0]S[0]"``), one
split overwrites the other and the kernels get wrong shapes. So before TVM's
pass, such a kernel runs with each dimension split by its first mesh axis only:
a later mesh axis that splits a dimension an earlier one already splits becomes
``R`` in every operand and the result (``"S[0]S[0]"`` becomes ``"S[0]R"``).
Operands get there through a redistribute (an all-gather along that axis), and
the result goes back through one (a local slice), so the values around the
kernel keep the sharding propagation gave them. This costs that all-gather.

TVM's pass also types the all-reduce it adds after a kernel with a split
reduction as replicated on every mesh axis, which on a 2-D mesh it is not
(it keeps the kernel's layout, ``"S[1], R"`` say). Passed to a Relax function
whose parameter says ``"S[1], R"``, that wrong type fails TVM's call type check.
So before TVM's pass, every sharded kernel result passed to a Relax function
goes through a redistribute to its own sharding: TVM types a redistribute by
its destination, and :class:`~tvm_distx.legalize.LegalizeRedistribute` plans
it from the true layout (no step at all). What such an all-reduce completes is
read back in one place, :mod:`tvm_distx.legalize.partial_sums`.

Last, TVM's pass gives every loop variable of a kernel one sharding, read off
the index expressions as written. A kernel whose index mixes loop variables of
dimensions split along different mesh axes (a legalized ``reshape`` on a 2-D
mesh, say, whose unsimplified index of one dimension mentions the loops of
another) stops it with ``InternalError: A loop cannot have different
sharding``. On that error the kernels with sharded operands are simplified
(``s_tir.transform.StmtSimplify`` knows the block ranges, so
``x[((j * 2 + k) // 4 + i) % 4, (j * 2 + k) % 4]`` becomes ``x[i, j * 2 + k]``)
and TVM's pass runs again. Only a module that still fails becomes an
:class:`~tvm_distx.errors.UnsupportedProgramError` naming the function and the
kernel's result, found by lowering each sharded kernel alone. A module TVM
lowers at once keeps its kernels exactly as written.

After TVM's pass, partial sums that are only combined linearly (a shared
expert's row-parallel result added to the routed experts') share one all-reduce
(:class:`~tvm_distx.legalize.merge_allreduce.MergeAllReduces`).
"""

from __future__ import annotations

import logging

from tvm import relax
import tvm
from tvm.relax.distributed import DTensorType, transform as dist_transform
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.s_tir.transform import StmtSimplify

from tvm_distx.errors import UnsupportedProgramError
from tvm_distx.ir import helpers as _ir
from tvm_distx.ir.module_pass import module_pass
from tvm_distx.layout import Placement, Replicate, TensorSharding
from tvm_distx.legalize.merge_allreduce import MergeAllReduces
from tvm_distx.legalize.partial_sums import reduced_axes
from tvm_distx.legalize.split_extents import bind_split_extents

__all__ = ["LowerGlobalViewToLocalView", "split_once"]

logger = logging.getLogger(__name__)


@module_pass(name="tvm_distx.LowerGlobalViewToLocalView")
class LowerGlobalViewToLocalView:
    """TVM's local-view lowering, on kernels rewritten so that it can lower them."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        mod = bind_split_extents(_pin_call_arguments(split_once(mod)))
        mod = _replicated_kernels_as_local(mod)
        return MergeAllReduces()(_tvm_local_view(mod))


def _tvm_local_view(mod: tvm.IRModule) -> tvm.IRModule:
    """TVM's pass; once more on simplified kernels if it cannot shard their loops."""
    try:
        return dist_transform.LowerGlobalViewToLocalView()(mod)
    except tvm.error.InternalError as err:
        if _LOOP_CONFLICT not in str(err):
            raise _explain(mod, err) from None
    mod, kernels = _simplify_sharded_kernels(mod)
    logger.info("TVM's local view could not shard the loops as written; retrying with "
                "simplified indices in %s", ", ".join(sorted(kernels)))
    try:
        return dist_transform.LowerGlobalViewToLocalView()(mod)
    except tvm.error.InternalError as err:
        raise _explain(mod, err) from None


#: What TVM's pass says of a kernel whose loops would need two shardings.
_LOOP_CONFLICT = "A loop cannot have different sharding"


def _explain(mod: tvm.IRModule, err: Exception) -> Exception:
    """A :class:`UnsupportedProgramError` for TVM's ``err``, naming the kernel that fails.

    The kernel is found by lowering each sharded kernel alone.
    """
    message = _ir.tvm_error_reason(err)
    conflict = _LOOP_CONFLICT in message
    for name, binding in _sharded_kernels(mod):
        try:
            dist_transform.LowerGlobalViewToLocalView()(_alone(mod, binding))
        except tvm.error.InternalError:
            pass
        else:
            continue
        operands = [a for a in binding.value.args[1].fields if isinstance(a, relax.Var)]
        placements = ", ".join(f"{a.name} {TensorSharding.from_type(a.ty).placement}"
                               for a in operands if TensorSharding.from_type(a.ty))
        kernel = binding.value.args[0].name_hint
        where = dict(function=name, var=binding.var.name,
                     placement=str(TensorSharding.from_type(binding.var.ty).placement))
        if conflict:
            return UnsupportedProgramError(
                f"TVM's local-view lowering cannot give the loops of kernel '{kernel}' one "
                f"sharding each: an index mixes loop variables of dimensions split along "
                f"different mesh axes ({placements})", **where,
                hint="split the operands of this kernel (often a reshape) along one mesh "
                "axis only, or redistribute one of those dimensions to replicated before it")
        return UnsupportedProgramError(
            f"TVM's LowerGlobalViewToLocalView cannot lower kernel '{kernel}' with its "
            f"operands {placements or 'replicated'}: {message}", **where,
            hint="replicate the operands of this kernel (annotate them \"R\"), and report "
            "the module")
    if conflict:
        return UnsupportedProgramError(
            f"TVM's local-view lowering cannot give every loop of a kernel one sharding "
            f"({message})", hint="split the operands of reshapes along one mesh axis only")
    return UnsupportedProgramError(
        f"TVM's LowerGlobalViewToLocalView failed: {message}",
        hint="report the module; as a workaround, replicate the operands of the kernel "
        "that fails")


def _sharded_kernels(mod: tvm.IRModule):
    """(function name, binding) of every ``call_tir`` with a sharded operand or result."""
    for gv, func in _ir.relax_functions(mod):
        for block in func.body.blocks:
            for binding in block.bindings:
                value = binding.value
                if _ir.is_call_to(value, "relax.call_tir") and any(
                        _sharded(v.ty) for v in [*value.args[1].fields, binding.var]
                        if hasattr(v, "ty")):
                    yield gv.name_hint, binding


def _simplify_sharded_kernels(mod: tvm.IRModule) -> tuple[tvm.IRModule, set[str]]:
    """``mod`` with the index expressions of every sharded kernel simplified.

    Each ``call_tir`` callee with a sharded operand or result goes through
    ``s_tir.transform.StmtSimplify``, which uses the block iteration ranges to
    fold the ``//`` and ``%`` a legalized reshape writes. The kernels compute
    the same values.
    """

    out = mod.clone()
    done: set[str] = set()
    for _, binding in _sharded_kernels(mod):
        callee = binding.value.args[0]
        if callee.name_hint in done or not isinstance(mod[callee], tvm.tirx.PrimFunc):
            continue
        simplified = StmtSimplify()(tvm.IRModule({callee: mod[callee]}))[callee]
        out.update_func(callee, simplified)
        done.add(callee.name_hint)
    return out, done


def _alone(mod: tvm.IRModule, binding: relax.VarBinding) -> tvm.IRModule:
    """A module of one function that runs just the kernel of ``binding``."""
    value = binding.value
    params = [relax.Var(f"a{i}", a.ty) for i, a in enumerate(value.args[1].fields)]
    call = relax.Call(value.op, [value.args[0], relax.Tuple(params), *value.args[2:]],
                      value.attrs, value.ty_args)
    out = relax.Var("out", binding.var.ty)
    body = relax.SeqExpr([relax.BindingBlock([relax.VarBinding(out, call)])], out)
    callee = value.args[0]
    alone = tvm.IRModule({tvm.ir.GlobalVar("main"): relax.Function(params, body, binding.var.ty),
                          callee: mod[callee]})
    for key, infos in mod.global_infos.items():
        alone.update_global_info(key, infos)
    return alone


def _replicated_kernels_as_local(mod: tvm.IRModule) -> tvm.IRModule:
    """Kernels that run on each rank's shards as written, marked as local already.

    A kernel whose operands and results are all replicated computes on whole
    tensors on every rank: its global view is its local view, and there is
    nothing to rewrite. TVM's pass rewrites it anyway, and breaks the kernels
    ``DispatchSortScan`` writes for ``cumsum`` and ``sort`` (their output buffer
    gets a layout over a fresh copy of the symbolic extent, and the kernel no
    longer builds). Calling them through ``call_tir_local_view`` leaves them as
    written.

    A kernel with a user's sharding rule (:data:`~tvm_distx.ir.helpers.KERNEL_RULE_ATTR`,
    from :func:`tvm_distx.register_sharding_rule`) is one TVM's pass may not read
    (its loops are its own); the rule says it computes each shard of its result
    from the shards of its operands. When every split dimension of its buffers
    is a symbolic extent, it is called the same way, on the shards; a split
    summed axis leaves a partial sum, completed as TVM's pass completes one
    (an ``R.ccl.allreduce``, see :mod:`tvm_distx.legalize.partial_sums`).
    """
    out = mod.clone()
    for gv, func in _ir.relax_functions(mod):
        if any(_all_replicated(binding) or _runs_as_written(mod, binding)
               for binding in _kernels(func)):
            out[gv] = _AsLocal(mod, gv.name_hint).visit_expr(func)
    return out


def _all_replicated(binding: relax.VarBinding) -> bool:
    types = _kernel_types(binding)
    return all(isinstance(ty, DTensorType) for ty in types) and not any(
        _sharded(ty) for ty in types)


def _runs_as_written(mod: tvm.IRModule, binding: relax.VarBinding) -> bool:
    """A kernel with a user's rule whose split buffer dimensions are all symbolic."""
    func = mod[binding.value.args[0]]
    if func.attrs is None or _ir.KERNEL_RULE_ATTR not in func.attrs \
            or not isinstance(binding.var.ty, DTensorType):  # one result, whose sum is known
        return False
    types = _kernel_types(binding)
    buffers = [p for p in func.params if tvm.tirx.is_buffer_var(p)]
    if len(buffers) != len(types) or not all(isinstance(ty, DTensorType) for ty in types):
        return False
    for ty, buf in zip(types, buffers):
        for entry in TensorSharding.from_type(ty).placement.entries:
            if entry.is_shard() and isinstance(buf.ty.shape[entry.dim], tvm.tirx.IntImm):
                logger.info("kernel %s has a user's rule but a static extent %s of buffer %s "
                            "is split: TVM's local view rewrites it", binding.value.args[0].name_hint,
                            buf.ty.shape[entry.dim], buf)
                return False
    return True


@mutator
class _AsLocal(PyExprMutator):
    _LOCAL = tvm.ir.Op.get("relax.dist.call_tir_local_view")

    def __init__(self, mod: tvm.IRModule, function: str) -> None:
        super().__init__(mod)
        self.mod = mod
        self.function = function

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = binding.value
        if not (_ir.is_call_to(value, "relax.call_tir")
                and (_all_replicated(binding) or _runs_as_written(self.mod, binding))):
            super().visit_var_binding_(binding)
            return
        args = [value.args[0], self.visit_expr(value.args[1]), *value.args[2:]]
        call = self.builder_.normalize(
            relax.Call(self._LOCAL, args, value.attrs, value.ty_args, value.span))
        result = TensorSharding.from_type(binding.var.ty)  # one tensor (_runs_as_written)
        if _all_replicated(binding) or not reduced_axes(value, result):
            self.builder_.emit_normalized(relax.VarBinding(binding.var, call))
            return
        if not result.placement.is_replicated():  # TVM's convention types the sum all-R
            raise UnsupportedProgramError(
                f"kernel {value.args[0].name_hint} with a user's sharding rule sums over a "
                f"split axis into a result split as {result.placement}",
                function=self.function, var=binding.var.name,
                hint="keep the summed axis whole (pass unshardable= to register_sharding_rule) "
                "or annotate the result \"R\"")
        addends = self.builder_.emit(call, name_hint=f"{binding.var.name}_addend")
        total = self.builder_.normalize(relax.op.ccl.allreduce(addends, "sum", in_group=False))
        self.builder_.emit_normalized(relax.VarBinding(binding.var, total))


def _pin_call_arguments(mod: tvm.IRModule) -> tvm.IRModule:
    """Route sharded kernel results passed to Relax functions through a redistribute."""
    out = mod.clone()
    for gv, func in _ir.relax_functions(mod):
        out[gv] = _Pinner(mod).visit_expr(func)
    return out


@mutator
class _Pinner(PyExprMutator):
    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.mod = mod
        self.kernels: set = set()  # vars bound to a kernel with a sharded result

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = binding.value
        if _ir.is_call_to(value, "relax.call_tir") and _sharded(binding.var.ty):
            self.kernels.add(binding.var)
        if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.GlobalVar) and \
                isinstance(self.mod[value.op], relax.Function) and \
                any(a in self.kernels for a in value.args):
            args = [self._pinned(a) if a in self.kernels else self.visit_expr(a)
                    for a in value.args]
            call = self.builder_.normalize(
                relax.Call(value.op, args, value.attrs, value.ty_args, value.span))
            self.builder_.emit_normalized(relax.VarBinding(binding.var, call))
            return
        super().visit_var_binding_(binding)

    def _pinned(self, var: relax.Var) -> relax.Var:
        new = self.visit_expr(var)
        ty = var.ty
        move = relax.op.distributed.redistribute(new, ty.device_mesh, ty.placement)
        return self.builder_.emit(move, name_hint=f"{var.name}_pin")


def _sharded(ty) -> bool:
    sharding = TensorSharding.from_type(ty)
    return sharding is not None and not sharding.placement.is_replicated()


def split_once(mod: tvm.IRModule) -> tvm.IRModule:
    """Run every kernel with each tensor dimension split by one mesh axis at most.

    A mesh axis that splits a dimension an earlier mesh axis of the same tensor
    already splits is replicated instead, in every operand and in the result of
    that kernel (the per-axis choice keeps the kernel's shardings consistent).
    Operands that change get an ``R.dist.redistribute`` before the kernel, and a
    result that changes gets one after it back to its own sharding, so nothing
    outside the kernel changes. Kernels without such a split are untouched.

    Parameters
    ----------
    mod : tvm.IRModule
        A module after sharding propagation (global view).

    Returns
    -------
    tvm.IRModule
        The module, with the kernels TVM's local view would get wrong rewritten.
    """
    out = mod.clone()
    for gv, func in _ir.relax_functions(mod):
        if not any(_later_splits(_kernel_types(binding)) for binding in _kernels(func)):
            continue
        rewriter = _SplitOnce(mod, gv.name_hint)
        new = rewriter.visit_expr(func)
        if rewriter.single:  # drop moves back that only fed the next such kernel
            new = relax.analysis.remove_all_unused(new)
        out[gv] = new
    return out


@mutator
class _SplitOnce(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, function: str) -> None:
        super().__init__(mod)
        self.function = function
        # result var of a rewritten kernel -> (its value before the move back, that placement)
        self.single: dict[relax.Var, tuple[relax.Var, Placement]] = {}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = binding.value
        if not _ir.is_call_to(value, "relax.call_tir"):
            super().visit_var_binding_(binding)
            return
        operands = list(value.args[1].fields)
        dropped = _later_splits(_kernel_types(binding))
        if not dropped:
            super().visit_var_binding_(binding)
            return
        kernel = value.args[0].name_hint
        args = []
        for operand in operands:
            new = self.visit_expr(operand)
            single = _without(operand.ty, dropped)
            if single is not None and self.single.get(operand, (None, None))[1] == single:
                new = self.single[operand][0]  # the previous kernel's result, before its move
            elif single is not None:
                new = self._source_of_move(new)
                logger.info("%s: kernel '%s' reads '%s' (\"%s\") as \"%s\": TVM's local view "
                            "cannot split one dimension by several mesh axes", self.function,
                            kernel, _label(operand), Placement.from_tvm(operand.ty.placement),
                            single)
                new = self.builder_.emit(relax.op.distributed.redistribute(
                    new, operand.ty.device_mesh, single.to_tvm()),
                    name_hint=f"{_label(operand)}_split_once")
            args.append(new)
        result = binding.var.ty
        results = list(result.fields) if isinstance(result, relax.TupleType) else [result]
        singles = [_without(ty, dropped) for ty in results]
        types = [ty if single is None else DTensorType(ty.tensor_ty, ty.device_mesh,
                                                        single.to_tvm())
                 for ty, single in zip(results, singles)]
        call = self.builder_.normalize(relax.Call(
            value.op, [value.args[0], relax.Tuple(args), *value.args[2:]], value.attrs,
            [relax.TupleType(types) if isinstance(result, relax.TupleType) else types[0]],
            value.span))
        if all(single is None for single in singles):
            self.builder_.emit_normalized(relax.VarBinding(binding.var, call))
            return
        name = binding.var.name
        inner = self.builder_.emit(call, name_hint=f"{name}_split_once")
        if not isinstance(result, relax.TupleType):
            self.single[binding.var] = (inner, singles[0])
            self.builder_.emit_normalized(relax.VarBinding(
                binding.var, self.builder_.normalize(_move(inner, result))))
            return
        fields = []
        for i, (ty, single) in enumerate(zip(results, singles)):
            field = self.builder_.emit(relax.TupleGetItem(inner, i),
                                       name_hint=f"{name}_split_once_{i}")
            fields.append(field if single is None else
                          self.builder_.emit(_move(field, ty), name_hint=f"{name}_{i}"))
        self.builder_.emit_normalized(relax.VarBinding(
            binding.var, self.builder_.normalize(relax.Tuple(fields))))

    def _source_of_move(self, var: relax.Expr) -> relax.Expr:
        """The source of ``var`` if it is bound to a redistribute, so one move does both."""
        bound = self.lookup_binding(var) if isinstance(var, relax.Var) else None
        if bound is not None and _ir.is_call_to(bound, "relax.dist.redistribute"):
            return bound.args[0]
        return var


def _move(value: relax.Expr, ty: DTensorType) -> relax.Call:
    """A redistribute of ``value`` to the mesh and placement of ``ty``."""
    return relax.op.distributed.redistribute(value, ty.device_mesh, ty.placement)


def _kernels(func: relax.Function):
    """The bindings of ``func`` to a ``call_tir``."""
    for block in func.body.blocks:
        for binding in block.bindings:
            if _ir.is_call_to(binding.value, "relax.call_tir"):
                yield binding


def _kernel_types(binding: relax.VarBinding) -> list:
    """The types of a kernel's operands, then of its result (or results)."""
    result = binding.var.ty
    results = list(result.fields) if isinstance(result, relax.TupleType) else [result]
    return [operand.ty for operand in binding.value.args[1].fields] + results


def _later_splits(types) -> set[int]:
    """Mesh axes that split a dimension an earlier mesh axis splits, in any of ``types``."""
    dropped = set()
    for ty in types:
        if not isinstance(ty, DTensorType):
            continue
        seen = set()
        for axis, entry in enumerate(Placement.from_tvm(ty.placement).entries):
            if entry.is_shard():
                if entry.dim in seen:
                    dropped.add(axis)
                seen.add(entry.dim)
    return dropped


def _without(ty, axes: set[int]) -> Placement | None:
    """``ty``'s placement with ``axes`` replicated; None if that changes nothing."""
    if not isinstance(ty, DTensorType):
        return None
    entries = Placement.from_tvm(ty.placement).entries
    if not any(entries[a].is_shard() for a in axes):
        return None
    return Placement(tuple(Replicate() if a in axes else e for a, e in enumerate(entries)))


def _label(expr) -> str:
    return expr.name if isinstance(expr, relax.Var) else "an operand"
