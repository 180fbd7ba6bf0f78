"""Weight decodes: values a function computes from its parameters alone (internal).

:func:`tvm_distx.quantize` stores a weight as parts (int8 data and float16
scales, say) and decodes it with Relax operators before each read. A kernel
that reads such a weight must decode it where it reads it, in registers, and
never write a float copy of it: the point of a smaller format is that a decode
step reads only the stored bytes. Two compiler steps act on that, and both ask
this module what a decode is:

* :class:`tvm_distx.legalize.linear.LegalizeLinear` folds the transpose of a
  decoded ``(out, in)`` weight into its matmul (:func:`decodes_parameters`),
  as it does for a weight parameter;
* :func:`tvm_distx.compiler.schedule.fuse_kernels` fuses each decode kernel into
  the kernel that reads it (:func:`is_decode_kernel`), so that the schedules
  see one kernel whose prologue is the decode. Before that it marks every
  block of the decode (:func:`mark_decode`, the block annotation
  :data:`DECODE_ATTR`), and the schedules ask :func:`is_decode_block` which
  blocks of a fused kernel decode a weight: they compute those where the
  weight is read, never into a buffer of their own.

**The definition.** A weight decode is a value computed from function
parameters and constants alone, by operations that move or convert elements
one by one and sum nothing: in Relax, the operators of :data:`DECODE_OPS`
(and sharding annotations); after legalization, a ``call_tir`` of a kernel
whose blocks are all spatial, on parameters and constants. Nothing in it
depends on a format: a 16-bit ``astype``, the groups of ``q8`` and the nibbles
of ``q4`` are all such chains, and so is a reshape of a float32 table.
"""

from __future__ import annotations

from typing import Callable

import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.s_tir import SBlock, Schedule

from tvm_distx.ir.helpers import is_call_to, static_shape

__all__ = ["DECODE_ATTR", "DECODE_OPS", "decodes_parameters", "is_decode_block",
           "is_decode_kernel", "is_spatial_kernel", "mark_decode", "weight_params"]

#: The block annotation that marks a block of a fused kernel as part of a weight decode.
DECODE_ATTR = "tvm_distx.weight_decode"

#: The Relax operators a weight decode is made of (:func:`tvm_distx.quantize` emits them).
DECODE_OPS = frozenset({
    "relax.astype", "relax.reshape", "relax.multiply", "relax.subtract", "relax.add",
    "relax.bitwise_and", "relax.right_shift", "relax.left_shift", "relax.bitwise_or",
    "relax.concat", "relax.dist.annotate_sharding",
})


def decodes_parameters(expr: relax.Expr, binding_of: Callable[[relax.Var], relax.Expr | None],
                       params) -> bool:
    """Whether ``expr`` is a parameter, or a decode of parameters and constants.

    Parameters
    ----------
    expr : relax.Expr
        The value (a variable, usually).
    binding_of : callable
        The value a variable is bound to, or None (a mutator's ``lookup_binding``).
    params : collection of relax.Var
        The function's parameters.
    """
    seen: set = set()

    def decoded(value) -> bool:
        if isinstance(value, (tvm.ir.Constant, relax.ShapeExpr)):
            return True  # a constant, a reshape's target shape
        if isinstance(value, relax.Tuple):
            return all(decoded(field) for field in value.fields)
        if not isinstance(value, relax.Var):
            return False
        if value in params or value in seen:
            return True
        seen.add(value)
        bound = binding_of(value)
        if not isinstance(bound, relax.Call) or not any(is_call_to(bound, name)
                                                        for name in DECODE_OPS):
            return False
        return all(decoded(arg) for arg in bound.args)

    return decoded(expr)


def weight_params(func: relax.Function) -> set:
    """The parameters of ``func`` that may be weights.

    Those from its ``num_input`` attribute on (TVM's convention: the inputs come
    first, the weights after them; the exported decoders and the rank programs
    have it), or every parameter when it has none.
    """
    params = list(func.params)
    attrs = func.attrs
    if attrs is not None and "num_input" in attrs:
        return set(params[int(attrs["num_input"]):])
    return set(params)


def is_spatial_kernel(func: tirx.PrimFunc) -> bool:
    """Whether every block of a TIR kernel is spatial (elementwise, broadcast, layout)."""
    inner = [b for b in _blocks(func) if b.name_hint != "root"]
    return bool(inner) and all(iv.iter_type == tirx.IterVar.DataPar
                               for b in inner for iv in b.iter_vars)


def _blocks(func: tirx.PrimFunc) -> list[SBlock]:
    blocks: list[SBlock] = []
    tvm_ffi.structural_walk(func.body, [(SBlock, blocks.append)])
    return blocks


def is_decode_kernel(call: relax.Expr, mod: tvm.IRModule, params) -> bool:
    """Whether ``call`` is a ``call_tir`` that decodes parameters (see the module doc).

    Its kernel's blocks are all spatial, its tensor operands are parameters of
    the enclosing function (``params``, one at least) or constants, of static
    shapes, and it has no run-time scalar arguments.
    """
    if not is_call_to(call, "relax.call_tir") or len(call.args) != 2:
        return False
    callee, args = call.args
    if not isinstance(callee, tvm.ir.GlobalVar) or not isinstance(args, relax.Tuple):
        return False
    func = mod[callee] if callee in mod else None
    if not isinstance(func, tirx.PrimFunc) or not args.fields:
        return False
    if not all(isinstance(a, tvm.ir.Constant) or a in params for a in args.fields):
        return False
    if all(isinstance(a, tvm.ir.Constant) for a in args.fields):
        return False  # a broadcast constant (a scatter's fill value) decodes no weight
    # a weight has a static shape; a parameter of a run-time extent (the token ids of a
    # batch, cast for a lookup) is an input, whatever its position
    if any(not isinstance(a, tvm.ir.Constant) and None in (static_shape(a.ty) or (None,))
           for a in args.fields):
        return False
    return is_spatial_kernel(func)


def mark_decode(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with every block marked as a weight decode (:data:`DECODE_ATTR`)."""
    sch = Schedule(func)
    for block in _blocks(func):
        if block.name_hint != "root":
            sch.annotate(sch.get_sblock(block.name_hint), DECODE_ATTR, 1)
    return sch.mod["main"]


def is_decode_block(block: SBlock) -> bool:
    """Whether a block of a fused kernel is part of a weight decode (:func:`mark_decode`)."""
    return DECODE_ATTR in block.annotations
