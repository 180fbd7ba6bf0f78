"""Small helpers over Relax IR shared by the passes (internal)."""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Iterator

import tvm
from tvm import relax
from tvm.relax.distributed import DTensorType

from tvm_distx.layout import Placement
from tvm_distx.layout.mesh import DeviceMesh


#: The attribute of a ``PrimFunc`` whose sharding rule a user declared
#: (:func:`tvm_distx.register_sharding_rule`): the rule string. Propagation writes
#: it; the local view then runs the kernel on each rank's shards as written.
KERNEL_RULE_ATTR = "tvm_distx.sharding_rule"


@lru_cache(maxsize=None)
def op(name: str) -> tvm.ir.Op:
    """Look a Relax operator up once."""
    return tvm.ir.Op.get(name)


def is_call_to(expr, op_name: str) -> bool:
    """True when ``expr`` is a call of the operator ``op_name``."""
    return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and (
        expr.op.name == op_name
    )


def operator_name(value) -> str | None:
    """The name of the operator ``value`` calls (``"relax.matmul"``), None for anything else."""
    op = getattr(value, "op", None)
    return op.name if isinstance(op, tvm.ir.Op) else None


def static_ints(values) -> list[int] | None:
    """The extents ``values`` as ints, None when one of them is not a constant."""
    try:
        return [int(v) for v in values]
    except (TypeError, ValueError):
        return None


def callee_name(call: relax.Call) -> str | None:
    """The name of the Relax function a call targets (None for operator calls)."""
    if isinstance(call.op, tvm.ir.GlobalVar):
        return call.op.name_hint
    return None


def static_shape(ty) -> tuple[int | None, ...] | None:
    """The shape of a tensor type, ``None`` per dynamic dimension; ``None`` if unknown rank."""
    if isinstance(ty, DTensorType):
        ty = ty.tensor_ty
    if not isinstance(ty, relax.TensorType) or ty.ndim < 0:
        return None
    shape = ty.shape
    if not isinstance(shape, relax.ShapeExpr):
        return (None,) * ty.ndim
    return tuple(int(v.value) if isinstance(v, tvm.tirx.IntImm) else None for v in shape.values)


def tensor_bytes(ty) -> int:
    """The bytes of a tensor type with a static shape; 0 when a dimension is not static."""
    shape = static_shape(ty)
    if shape is None or any(d is None for d in shape):
        return 0
    dtype = (ty.tensor_ty if isinstance(ty, DTensorType) else ty).dtype
    count = 1
    for d in shape:
        count *= d
    return count * ((tvm.runtime.DataType(str(dtype)).bits + 7) // 8)


def is_tensor_type(ty) -> bool:
    """True for ``R.Tensor`` and ``R.DTensor`` types."""
    return isinstance(ty, (relax.TensorType, DTensorType))


def dtensor_sharding(ty) -> tuple[DeviceMesh, Placement] | None:
    """The (mesh, placement) a ``R.DTensor`` type carries, None for other types."""
    if not isinstance(ty, DTensorType):
        return None
    return DeviceMesh.from_tvm(ty.device_mesh), Placement.from_tvm(ty.placement)


def operand_vars(expr) -> list:
    """The variables an expression reads directly: a call's arguments (tuples opened),
    a tuple's fields, a tuple item's tuple, or the variable itself."""
    if isinstance(expr, relax.Call):
        out = []
        for arg in expr.args:
            out.extend(operand_vars(arg) if isinstance(arg, relax.Tuple) else
                       [arg] if isinstance(arg, relax.Var) else [])
        return out
    if isinstance(expr, relax.Tuple):
        return [f for f in expr.fields if isinstance(f, relax.Var)]
    if isinstance(expr, relax.TupleGetItem):
        return operand_vars(expr.tuple_value)
    return [expr] if isinstance(expr, relax.Var) else []


def with_functions(mod: tvm.IRModule, updated: dict) -> tvm.IRModule:
    """``mod`` with the functions of ``updated`` (by global variable) replaced.

    ``mod`` itself when there is nothing to replace; otherwise a copy, so the
    caller's module is never changed in place.
    """
    if not updated:
        return mod
    mod = mod.clone()
    for gvar, func in updated.items():
        mod.update_func(gvar, func)
    return mod


def relax_functions(mod: tvm.IRModule) -> Iterator[tuple[tvm.ir.GlobalVar, relax.Function]]:
    """The module's Relax functions in program order.

    Program order is: public functions (those with a ``global_symbol``) first,
    then private ones, each group sorted by name. It is deterministic and does
    not depend on how the module was built.
    """
    funcs = [(gv, f) for gv, f in mod.functions.items() if isinstance(f, relax.Function)]

    def key(item):
        gv, func = item
        public = func.attrs is not None and "global_symbol" in func.attrs
        return (0 if public else 1, gv.name_hint)

    return iter(sorted(funcs, key=key))


def bindings_and_uses(func: relax.Function) -> tuple[dict, dict]:
    """``func``'s variables with the values bound to them, and how many times each
    variable is read (by the bindings and by the function's result)."""
    bound: dict = {}
    uses: dict = {}
    for block in func.body.blocks:
        for binding in block.bindings:
            bound[binding.var] = binding.value
            for var in operand_vars(binding.value):
                uses[var] = uses.get(var, 0) + 1
    for var in operand_vars(func.body.body):
        uses[var] = uses.get(var, 0) + 1
    return bound, uses


def called_kernels(mod: tvm.IRModule) -> set[str]:
    """The names of the functions that the Relax functions of ``mod`` call with
    ``call_tir`` or ``call_tir_inplace``."""
    called = set()
    for _, func in relax_functions(mod):
        for block in func.body.blocks:
            for binding in block.bindings:
                value = binding.value
                if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and \
                        value.op.name in ("relax.call_tir", "relax.call_tir_inplace") and \
                        isinstance(value.args[0], tvm.ir.GlobalVar):
                    called.add(value.args[0].name_hint)
    return called


def tvm_error_reason(err: Exception) -> str:
    """The last line of a TVM error, with printed operators shortened to their names.

    TVM prints an operator in a message as its whole ``ir.Op(...)`` object
    (description, arguments, attributes); the name is what a user needs.
    """
    text = str(err).strip()
    if not text:
        return type(err).__name__
    line = text.splitlines()[-1]
    out, start = [], 0
    while (begin := line.find("ir.Op(", start)) >= 0:
        depth, end = 0, begin + len("ir.Op")
        for end in range(begin + len("ir.Op"), len(line)):
            depth += {"(": 1, ")": -1}.get(line[end], 0)
            if depth == 0:
                break
        name = re.search(r'name="([^"]+)"', line[begin:end])
        out.append(line[start:begin] + (name.group(1) if name else "an operator"))
        start = end + 1
    return "".join(out) + line[start:]


# --------------------------------------------------------------------------- KV-cache builtins
#: TVM's attention KV-cache builtins, by role: the plain name (global view before
#: propagation, and each rank's program after lowering) and the distributed name
#: that TVM's ``PropagateSharding`` gives a call on sharded values. The cache
#: object holds what was written into it; each rank's cache holds its own shard.
#: ``create`` (initial data, reserved shape, fill count) has no distributed name
#: in TVM; it keeps its name, and lowering gives it the local reserved shape.
KV_BUILTINS = {
    "create": ("vm.builtin.attention_kv_cache_create", "vm.builtin.attention_kv_cache_create"),
    "append": ("vm.builtin.attention_kv_cache_append",
               "vm.builtin.distributed.attention_kv_cache_append"),
    "view": ("vm.builtin.attention_kv_cache_view",
             "vm.builtin.distributed.attention_kv_cache_view"),
}


def kv_builtin(expr) -> tuple[str, bool] | None:
    """``(role, distributed)`` for a call of a KV-cache builtin (plain or distributed), else None.

    ``role`` is ``"create"`` (arguments: initial data, reserved shape, fill
    count), ``"append"`` (arguments: cache, value) or ``"view"`` (arguments:
    cache, shape; the result type is the call's ``ty_args``).
    """
    if not (isinstance(expr, relax.Call) and isinstance(expr.op, relax.ExternFunc)):
        return None
    symbol = str(expr.op.global_symbol)
    for role, names in KV_BUILTINS.items():
        if symbol in names:
            return role, symbol == names[1]
    return None


def kv_renamed(call: relax.Call, distributed: bool, args=None, ty_args=None) -> relax.Call:
    """The same KV-cache builtin call under its plain or distributed name."""
    role, _ = kv_builtin(call)
    name = KV_BUILTINS[role][1 if distributed else 0]
    return relax.Call(relax.ExternFunc(name), list(call.args if args is None else args),
                      call.attrs, list(call.ty_args if ty_args is None else ty_args), call.span)
