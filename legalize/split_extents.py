"""Split symbolic extents, written so that TVM's local-view lowering can divide them.

TVM's ``LowerGlobalViewToLocalView`` divides every split loop extent by the
number of shards and first proves that it divides evenly
(``floormod(extent, shard) == 0``). For a symbolic extent ``n`` (a batch size
known only at run time) that cannot be proven, and the pass stops.

So before TVM's pass, every symbolic variable ``n`` that some mesh axes split
is written as ``p * n_local``: ``p`` is the least common multiple of the
number of parts it is split into, anywhere in the function, and ``n_local`` a
fresh variable. The Relax function binds ``n`` to ``p * n_local``
(``Function.bind_symbolic_vars``) and each kernel it calls is specialized to
its operands' shapes (``PrimFunc.specialize``), so its loops run to
``p * n_local`` and TVM's pass proves the division and writes local extents
``n_local`` (or ``(p / parts) * n_local`` where fewer axes split it). The
rank programs then take ``n_local`` from the shapes of their inputs, and one
compile serves every size. That the run-time ``n`` is divisible is checked
from the actual inputs before any rank starts
(:meth:`tvm_distx.bundle.manifest.signature.FunctionSignature.bind_sizes`).
"""

from __future__ import annotations

import logging
import math

import tvm
from tvm import relax, s_tir, tirx
from tvm.relax.distributed import DTensorType
from tvm.relax.expr_functor import PyExprMutator, mutator

from tvm_distx.ir import helpers as _ir
from tvm_distx.layout import TensorSharding

__all__ = ["bind_split_extents", "drop_extents_param", "split_factors"]

logger = logging.getLogger(__name__)


def split_factors(func: relax.Function) -> dict[tirx.Var, int]:
    """Each symbolic variable that ``func`` splits, and how many parts it must divide into.

    A variable split into ``a`` parts in one value and ``b`` in another must
    divide into ``lcm(a, b)``.
    """
    factors: dict[tirx.Var, int] = {}
    for var in _typed_vars(func):
        ty = var.ty
        if not isinstance(ty, DTensorType) or not isinstance(ty.tensor_ty.shape,
                                                             relax.ShapeExpr):
            continue
        sharding = TensorSharding.from_type(ty)
        shape = ty.tensor_ty.shape.values
        parts: dict[int, int] = {}
        for axis, entry in enumerate(sharding.placement.entries):
            if entry.is_shard():
                parts[entry.dim] = parts.get(entry.dim, 1) * sharding.mesh.shape[axis]
        for dim, count in parts.items():
            extent = shape[dim]
            if isinstance(extent, tirx.Var):
                factors[extent] = math.lcm(factors.get(extent, 1), count)
    return factors


def bind_split_extents(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with every split symbolic extent written as ``parts * local`` (module doc)."""
    out = mod.clone()
    changed = False
    for gv, func in _ir.relax_functions(mod):
        factors = {v: p for v, p in split_factors(func).items() if p > 1}
        if not factors:
            continue
        binding = {v: tirx.const(p, "int64") * tirx.Var(f"{v.name}_local", "int64")
                   for v, p in factors.items()}
        logger.info("%s: split symbolic extents %s", gv.name_hint,
                    ", ".join(f"{v.name} = {e}" for v, e in binding.items()))
        out[gv] = _with_symbolic_vars(func, binding)
        changed = True
    if not changed:
        return mod
    specializer = _KernelSpecializer(out)
    for gv, func in list(_ir.relax_functions(out)):
        specializer.builder_.update_func(gv, specializer.visit_expr(func))
    return specializer.builder_.get()


@mutator
class _KernelSpecializer(PyExprMutator):
    """Specialize each kernel to its operands' split extents, passing the local extents.

    A kernel whose buffer ``(n, 8)`` receives an operand ``(2 * n_local, 8)`` is
    specialized to ``(2 * n_local, 8)`` (a copy: other calls may pass it
    unsplit extents), and ``n_local`` becomes a scalar parameter of the kernel
    after its inputs, passed by the call as an ``R.prim_value``: after TVM's
    pass the buffer is ``(2 * n_local // 2, 8)``, which does not define
    ``n_local`` by itself.
    """

    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.mod = mod

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        call = binding.value
        if not _ir.is_call_to(call, "relax.call_tir") or len(call.args) > 2:
            super().visit_var_binding_(binding)
            return
        callee = call.args[0]
        kernel = self.mod[callee]
        inputs = list(call.args[1].fields)
        specialized = _specialize(kernel, [*inputs, binding.var], len(inputs))
        if specialized is None:
            super().visit_var_binding_(binding)
            return
        kernel, extents = specialized
        callee = self.builder_.add_func(kernel, f"{callee.name_hint}_split")  # equal ones: one
        new_call = self.builder_.normalize(
            relax.Call(call.op, [callee, relax.Tuple([*(self.visit_expr(a) for a in inputs),
                                                      *(relax.prim_value(v) for v in extents)])],
                       call.attrs, call.ty_args, call.span))
        self.builder_.emit_normalized(relax.VarBinding(binding.var, new_call))


#: The name of the parameter that defines the local extents until TVM's pass has run.
EXTENTS_PARAM = "tvm_distx_local_extents"


def _with_symbolic_vars(func: relax.Function, binding) -> relax.Function:
    """``func`` with its symbolic variables replaced by expressions of fresh ones.

    ``bind_symbolic_vars`` refuses a result whose new variables no parameter
    defines (a parameter of shape ``(2 * n_local, 8)`` does not define
    ``n_local``). So a last parameter of shape ``(n_local, ...)`` defines them;
    :func:`drop_extents_param` removes it once TVM's pass has given the
    parameters their local shapes, which define them.
    """
    fresh = [v for e in binding.values() for v in tirx.analysis.undefined_vars(e)]
    extents = relax.Var(EXTENTS_PARAM, relax.ShapeType(fresh))
    widened = relax.Function([*func.params, extents], func.body, func.ret_ty, func.is_pure,
                             func.attrs)
    return widened.bind_symbolic_vars(binding)


def drop_extents_param(mod: tvm.IRModule) -> tvm.IRModule:
    """Remove the parameter :func:`bind_split_extents` added, after TVM's pass."""
    out = mod
    for gv, func in _ir.relax_functions(mod):
        if func.params and func.params[-1].name == EXTENTS_PARAM:
            if out is mod:
                out = mod.clone()
            out[gv] = relax.Function(func.params[:-1], func.body, func.ret_ty, func.is_pure,
                                     func.attrs)
    return out


def _specialize(kernel: tirx.PrimFunc, operands,
                num_inputs: int) -> tuple[tirx.PrimFunc, list] | None:
    """``kernel`` with each buffer shape variable bound to its operand's expression.

    Returns the kernel, with the variables of those expressions as scalar
    parameters after its ``num_inputs`` inputs, and those variables; None if
    nothing is split.
    """
    bindings = {}
    for param, operand in zip(kernel.params, operands):
        buffer = param.ty if tirx.is_buffer_var(param) else None
        shape = _shape_of(operand)
        if buffer is None or shape is None or len(shape) != len(buffer.shape):
            continue
        if not any(isinstance(b, tirx.Var) and not isinstance(s, (tirx.Var, tirx.IntImm))
                   for b, s in zip(buffer.shape, shape)):
            continue
        new_shape = [s if isinstance(b, tirx.Var) else b for b, s in zip(buffer.shape, shape)]
        bindings[param] = tirx.decl_buffer(new_shape, buffer.dtype, param.name)
    if not bindings:
        return None
    kernel = kernel.specialize(bindings)
    extents = []
    for buffer in bindings.values():
        for dim in buffer.ty.shape:
            extents += [v for v in tirx.analysis.undefined_vars(dim) if v not in extents]
    params = list(kernel.params)
    extended = tirx.PrimFunc([*params[:num_inputs], *extents, *params[num_inputs:]],
                             kernel.body, kernel.ret_type,
                             attrs=kernel.attrs)
    # ``specialize`` keeps the loop and block variables of ``kernel``, which stays in
    # the module: the copy gets its own, as TIR allows one definition of a variable
    return s_tir.renew_defs(extended), extents


def _shape_of(operand) -> list | None:
    ty = getattr(operand, "ty", None)
    if isinstance(ty, DTensorType):
        ty = ty.tensor_ty
    if isinstance(ty, relax.TensorType) and isinstance(ty.shape, relax.ShapeExpr):
        return list(ty.shape.values)
    return None


def _typed_vars(func: relax.Function):
    yield from func.params
    for call, result in _bindings(func):
        yield result


def _bindings(func: relax.Function):
    body = func.body
    if not isinstance(body, relax.SeqExpr):
        return
    for block in body.blocks:
        for binding in block.bindings:
            yield binding.value, binding.var


def _kernel_calls(func: relax.Function):
    for value, var in _bindings(func):
        if _ir.is_call_to(value, "relax.call_tir"):
            yield value, var
