"""``LowerGlobalViewToLocalView``: TVM's pass, refusing what it gets wrong.

TVM's pass rewrites each ``call_tir`` on DTensors into a kernel over the local
shard. When two mesh axes split the same tensor dimension (``"S[0]S[0]"``), one
split overwrites the other and the kernels get wrong shapes (see
``../shared/NOTES-tvm.md``). This wrapper refuses such a module with a
:class:`tvm_distx.UnsupportedProgramError` before TVM's pass runs, and
otherwise delegates to it.

TVM's pass also types the all-reduce it adds after a kernel with a split
reduction as replicated on every mesh axis, which on a 2-D mesh it is not
(it keeps the kernel's layout, ``"S[1], R"`` say). Passed to a Relax function
whose parameter says ``"S[1], R"``, that wrong type fails TVM's call type check.
So before TVM's pass, every sharded kernel result passed to a Relax function
goes through a redistribute to its own sharding: TVM types a redistribute by
its destination, and :class:`~tvm_distx.legalize.LegalizeRedistribute` plans
it from the true layout (no step at all).

Last, TVM's pass gives every loop variable of a kernel one sharding, read off
the index expressions as written. A kernel whose index mixes loop variables of
dimensions split along different mesh axes (a legalized ``reshape`` on a 2-D
mesh, say, whose unsimplified index of one dimension mentions the loops of
another) stops it with ``InternalError: A loop cannot have different
sharding``. That becomes an :class:`~tvm_distx.UnsupportedProgramError`
naming the function and the kernel's result, found by lowering each sharded
kernel alone.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.distributed import transform as dist_transform
from tvm.relax.expr_functor import PyExprMutator, mutator

from tvm_distx import _ir
from tvm_distx._pass import module_pass
from tvm_distx.errors import UnsupportedProgramError
from tvm_distx.spec import TensorSharding

__all__ = ["LowerGlobalViewToLocalView"]


@module_pass(name="tvm_distx.LowerGlobalViewToLocalView")
class LowerGlobalViewToLocalView:
    """Check for dimensions split by several mesh axes, then run TVM's pass."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        for gv, func in _ir.relax_functions(mod):
            _check(gv.name_hint, func)
        try:
            return dist_transform.LowerGlobalViewToLocalView()(_pin_call_arguments(mod))
        except tvm.error.InternalError as err:
            raise _explain(mod, err) from None


#: What TVM's pass says of a kernel whose loops would need two shardings.
_LOOP_CONFLICT = "A loop cannot have different sharding"


def _explain(mod: tvm.IRModule, err: Exception) -> Exception:
    """A :class:`UnsupportedProgramError` for TVM's ``err``, naming the kernel if it can."""
    message = str(err).strip().splitlines()[-1] if str(err).strip() else repr(err)
    if _LOOP_CONFLICT not in message:
        return UnsupportedProgramError(
            f"TVM's LowerGlobalViewToLocalView failed: {message}",
            hint="report the module; as a workaround, replicate the operands of the kernel "
            "that fails")
    for name, binding in _sharded_kernels(mod):
        try:
            dist_transform.LowerGlobalViewToLocalView()(_alone(mod, binding))
        except tvm.error.InternalError:
            operands = [a for a in binding.value.args[1].fields if isinstance(a, relax.Var)]
            placements = ", ".join(f"{a.name} {TensorSharding.from_type(a.ty).placement}"
                                   for a in operands if TensorSharding.from_type(a.ty))
            return UnsupportedProgramError(
                f"TVM's local-view lowering cannot give the loops of kernel "
                f"'{binding.value.args[0].name_hint}' one sharding each: an index mixes loop "
                f"variables of dimensions split along different mesh axes ({placements})",
                function=name, var=binding.var.name,
                placement=str(TensorSharding.from_type(binding.var.ty).placement),
                hint="split the operands of this kernel (often a reshape) along one mesh "
                "axis only, or redistribute one of those dimensions to replicated before it")
    return UnsupportedProgramError(
        f"TVM's local-view lowering cannot give every loop of a kernel one sharding "
        f"({message})",
        hint="split the operands of reshapes along one mesh axis only")


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


def _check(name: str, func: relax.Function) -> None:
    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if not _ir.is_call_to(value, "relax.call_tir"):
                continue
            operands = list(value.args[1].fields) + [binding.var]
            for operand in operands:
                sharding = TensorSharding.from_type(operand.ty)
                if sharding is None:
                    continue
                dims = [e.dim for e in sharding.placement.entries if e.is_shard()]
                if len(dims) != len(set(dims)):
                    raise UnsupportedProgramError(
                        f"a kernel reads or writes '{_label(operand)}' with one dimension split "
                        f"by several mesh axes; TVM's local-view lowering computes wrong shard "
                        "shapes for that",
                        function=name,
                        var=binding.var.name,
                        placement=str(sharding.placement),
                        hint="shard that dimension along one mesh axis only, or redistribute "
                        "the value before the kernel",
                    )


def _label(expr) -> str:
    return expr.name if isinstance(expr, relax.Var) else "an operand"
