"""Attention written as operators becomes one attention kernel: :class:`FuseAttention`.

Imported models compute scaled dot-product attention as a chain of Relax
operators (our ``scaled_dot_product_attention`` converter, and models that
write it out, both give it)::

    [k = repeat(k0, g, axis=1)                          grouped-query attention,
     | reshape(broadcast_to(expand_dims(k0, 2), ..))]   transformers' repeat_kv
    z = matmul(q, permute_dims(k, [0, 1, 3, 2]))
    z = multiply(z, scale) | divide(z, 1 / scale)        (optional)
    z = where(mask, z, lowest) | add(z, mask)            (optional)
    out = matmul(softmax(z, axis=-1), v)

Legalized one by one, that chain writes the ``(b, h, s, L)`` scores several
times, copies every key and value ``g`` times for grouped-query attention, and
attends to the whole static cache of a decoder. :class:`FuseAttention`
replaces the last ``matmul`` by one ``call_tir`` of the attention kernel's
definition (:func:`tvm_distx.compiler.schedule.attention.attention_definition`)
over ``q``, ``k0``, ``v0`` and the mask; the operators that only fed it are
removed. Sharding propagation reads that definition like any legalized
operator, and each rank runs it as the online-softmax implementation
(:class:`~tvm_distx.compiler.schedule.attention.FlashAttention`).

Folding the repeat of grouped-query attention into the kernel keeps the
key-value heads unrepeated, so a split of the heads must divide them: when the
module's meshes hold a number of devices that does not divide the key-value
heads, the kernel reads the repeated keys and values instead (as the chain
did), and each rank still holds whole heads.

A chain that differs in any way (another axis, a mask that is neither boolean
nor a float of the scores' dtype, an intermediate value used elsewhere, a
dynamic head count) is left as it is, and computes the same numbers as before.
It runs in :func:`tvm_distx.compiler.pipeline.legalize_ops`, before ``LegalizeOps``.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import tvm
from tvm import relax
import tvm_ffi

from tvm_distx.compiler.schedule.attention import AttentionKernel, attention_definition
from tvm_distx.ir import helpers as _ir
from tvm_distx.ir.module_pass import module_pass

__all__ = ["FuseAttention", "attention_chains"]

logger = logging.getLogger(__name__)

_FLOATS = ("float32", "float16", "bfloat16")


def _scalar(expr) -> float | None:
    """The value of a scalar constant, else None."""
    value = getattr(expr, "value", None) if isinstance(expr, tvm.ir.expr.Constant) else None
    if hasattr(value, "numpy") and value.numpy().size == 1:
        return float(value.numpy().reshape(()))
    return None


def _same(a, b) -> bool:
    """Whether two extents (or lists of them) are equal: equal ints, or provably equal."""
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        a, b = list(a), list(b)
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    ia, ib = _ir.static_ints([a]), _ir.static_ints([b])
    if ia is not None and ib is not None:
        return ia == ib
    if bool(tvm_ffi.structural_equal(a, b)):
        return True
    return bool(tvm.sym.Analyzer().can_prove_equal(a, b))


def _merged(shape, heads: int, group: int) -> list:
    """``(b, h, s, x)`` with its heads in groups: ``(b, h / group, group * s, x)``."""
    b, _, s, x = list(shape)
    return [b, heads // group, s * group, x]


class _Chains:
    """The bindings of one function, read backwards from an attention's last ``matmul``.

    ``devices``: the repeat of key-value heads is folded into the kernel only
    when this divides their count.
    """

    def __init__(self, func: relax.Function, devices: int = 1) -> None:
        self.devices = devices
        self.bound, self.uses = _ir.bindings_and_uses(func)

    def value(self, expr, op: str, private: bool = True):
        """The call to ``op`` bound to ``expr``; with ``private``, only if used once."""
        value = self.bound.get(expr) if isinstance(expr, relax.Var) else None
        if _ir.operator_name(value) != op or (private and self.uses.get(expr, 0) != 1):
            return None
        return value

    def grouped(self, expr) -> tuple[relax.Expr, int]:
        """``(k0, g)`` when ``expr`` repeats each head of ``k0`` ``g`` times, else ``(expr, 1)``."""
        repeat = self.value(expr, "relax.repeat")
        if repeat is not None and repeat.attrs.axis is not None and \
                int(repeat.attrs.axis) in (1, -3) and len(repeat.args[0].ty.shape) == 4:
            return repeat.args[0], int(repeat.attrs.repeats)
        reshape = self.value(expr, "relax.reshape")
        broadcast = None if reshape is None else self.value(reshape.args[0],
                                                            "relax.broadcast_to")
        expand = None if broadcast is None else self.value(broadcast.args[0],
                                                           "relax.expand_dims")
        if expand is None or [int(a) for a in expand.attrs.axis] not in ([2], [-3]):
            return expr, 1
        source = expand.args[0]
        shape, wide = _ir.static_ints(list(source.ty.shape)[:2]), _ir.static_ints(broadcast.ty.shape)
        if shape is None or wide is None or len(wide) != 5 or wide[:2] != shape or \
                not _same(list(broadcast.ty.shape)[3:], list(source.ty.shape)[2:]):
            return expr, 1
        return source, wide[2]

    def scores(self, z) -> tuple:
        """``(q, k0, g)`` when ``z`` is ``q @ k^T`` over (possibly repeated) keys ``k0``.

        Either ``matmul(q, permute_dims(k))`` or the grouped form
        ``reshape(matmul(reshape(q), permute_dims(k0)))``; ``(None, None, 0)`` else.
        """
        unmerged = self.value(z, "relax.reshape")
        if unmerged is not None:
            product = self.value(unmerged.args[0], "relax.matmul")
            merged = None if product is None else self.value(product.args[0], "relax.reshape")
            if merged is None:
                return None, None, 0
            q, keys = merged.args[0], product.args[1]
        else:
            product = self.value(z, "relax.matmul")
            if product is None:
                return None, None, 0
            q, keys = product.args
        permute = self.value(keys, "relax.permute_dims")
        if permute is None or permute.attrs.axes is None or \
                [int(a) for a in permute.attrs.axes] != [0, 1, 3, 2]:
            return None, None, 0
        if unmerged is not None:
            heads, kv_heads = _ir.static_ints([q.ty.shape[1]]), _ir.static_ints([permute.args[0].ty.shape[1]])
            if heads is None or kv_heads is None or heads[0] % kv_heads[0] or \
                    len(q.ty.shape) != 4 or len(unmerged.ty.shape) != 4:
                return None, None, 0
            group = heads[0] // kv_heads[0]
            scores = list(unmerged.ty.shape)
            # query head i * g + j is row block j of key-value head i (GroupedQueryAttention)
            if not (_same(merged.ty.shape, _merged(q.ty.shape, heads[0], group)) and
                    _same(product.ty.shape, _merged(scores, heads[0], group)) and
                    _same(scores[:3], list(q.ty.shape)[:3])):
                return None, None, 0
            return q, permute.args[0], group
        k, group = self.grouped(permute.args[0])
        if group > 1 and (_ir.static_ints([k.ty.shape[1]]) or [1])[0] % self.devices:
            return q, permute.args[0], 1  # the repeated keys (see the module doc)
        return q, k, group

    def attention(self, call) -> tuple[AttentionKernel, list] | None:
        """The kernel and operands of the attention whose last ``matmul`` is ``call``.

        Also the form :class:`tvm_distx.passes.GroupedQueryAttention` writes, where
        ``call`` is a ``reshape`` of the product by the unrepeated values.
        """
        if len(call.ty.shape) != 4:
            return None
        outer = call
        if _ir.operator_name(call) == "relax.reshape":
            product = self.value(call.args[0], "relax.matmul")
            merged = None if product is None else self.value(product.args[0], "relax.reshape")
            if merged is None:
                return None
            softmax, v, group_v = self.value(merged.args[0], "relax.nn.softmax"), \
                product.args[1], 0
        elif _ir.operator_name(call) == "relax.matmul":
            softmax = self.value(call.args[0], "relax.nn.softmax")
            v, group_v = self.grouped(call.args[1]) if softmax is not None else (None, 0)
            if group_v > 1 and (_ir.static_ints([v.ty.shape[1]]) or [1])[0] % self.devices:
                v, group_v = call.args[1], 1
        else:
            return None
        if softmax is None or int(softmax.attrs.axis) not in (-1, 3):
            return None
        z, mask, kind = softmax.args[0], None, "none"
        dtype = str(softmax.ty.dtype)
        where, add = self.value(z, "relax.where"), self.value(z, "relax.add")
        if where is not None:
            lowest = _scalar(where.args[2])
            if str(where.args[0].ty.dtype) != "bool" or lowest is None or \
                    lowest > float(np.finfo(np.float16).min):
                return None
            mask, kind, z = where.args[0], "bool", where.args[1]
        elif add is not None and isinstance(add.args[1], relax.Var) and \
                str(add.args[1].ty.dtype) == dtype:
            mask, kind, z = add.args[1], "add", add.args[0]
        scale = 1.0
        multiply, divide = self.value(z, "relax.multiply"), self.value(z, "relax.divide")
        if multiply is not None and _scalar(multiply.args[1]) is not None:
            scale, z = _scalar(multiply.args[1]), multiply.args[0]
        elif divide is not None and _scalar(divide.args[1]):
            scale, z = 1.0 / _scalar(divide.args[1]), divide.args[0]
        q, k, group_k = self.scores(z)
        if q is None:
            return None
        if group_v == 0:  # the grouped form: the group is the ratio of the heads
            heads, kv_heads = _ir.static_ints([q.ty.shape[1]]), _ir.static_ints([v.ty.shape[1]])
            if heads is None or kv_heads is None or heads[0] % kv_heads[0] or \
                    len(softmax.ty.shape) != 4:
                return None
            group_v = heads[0] // kv_heads[0]
            if not (_same(merged.ty.shape, _merged(softmax.ty.shape, heads[0], group_v)) and
                    _same(product.ty.shape, _merged(outer.ty.shape, heads[0], group_v))):
                return None
        if any(len(x.ty.shape) != 4 for x in (q, k, v)) or \
                len({str(x.ty.dtype) for x in (q, k, v)} | {dtype}) != 1 or dtype not in _FLOATS:
            return None
        heads, kv_heads = _ir.static_ints([q.ty.shape[1]]), _ir.static_ints([k.ty.shape[1]])
        dims = _ir.static_ints([q.ty.shape[3], k.ty.shape[3], v.ty.shape[3], v.ty.shape[1]])
        if heads is None or kv_heads is None or dims is None or group_k != group_v:
            return None
        (heads,), (kv_heads,) = heads, kv_heads
        if dims[0] != dims[1] or dims[3] != kv_heads or heads != kv_heads * group_k:
            return None
        eq = _same
        b, s, n = q.ty.shape[0], q.ty.shape[2], k.ty.shape[2]
        if not (eq(k.ty.shape[0], b) and eq(v.ty.shape[0], b) and eq(v.ty.shape[2], n)):
            return None
        axes = (False, False, True)
        if mask is not None:
            mshape = list(mask.ty.shape)
            if len(mshape) > 4 or not mshape or not eq(mshape[-1], n):
                return None
            mshape = [1] * (4 - len(mshape)) + mshape
            axes = []
            for got, full in zip(mshape[:3], (b, q.ty.shape[1], s)):
                if _ir.static_ints([got]) == [1]:  # broadcast (also when the axis has extent 1)
                    axes.append(False)
                elif eq(got, full):
                    axes.append(True)
                else:
                    return None
            axes = tuple(axes)
        kernel = AttentionKernel(heads, kv_heads, dims[0], dims[2], scale, kind, axes, dtype,
                                 str(mask.ty.dtype) if mask is not None else "bool")
        return kernel, [q, k, v] + ([mask] if mask is not None else [])


def attention_chains(func: relax.Function, devices: int = 1) -> dict:
    """``{var: (kernel, operands)}`` for every attention chain of ``func`` (module doc).

    ``devices``: the most devices that may split the heads (the module doc).
    """
    chains = _Chains(func, devices)
    found = {}
    for var, value in chains.bound.items():
        got = chains.attention(value) if _ir.operator_name(value) in ("relax.matmul", "relax.reshape") \
            else None
        if got is not None:
            found[var] = got
    return found


@relax.expr_functor.mutator
class _Replace(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, calls: dict, kernels: dict) -> None:
        super().__init__(mod)
        self.calls = calls  # binding var -> (kernel, operands)
        self.kernels = kernels  # (kernel, b, s, L) -> GlobalVar, shared across functions

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var not in self.calls:
            super().visit_var_binding_(binding)
            return
        kernel, args = self.calls[binding.var]
        args = [self.visit_expr(a) for a in args]
        if len(args) == 4 and len(args[3].ty.shape) < 4:
            rank = len(args[3].ty.shape)
            args[3] = self.builder_.emit(relax.op.reshape(
                args[3], [1] * (4 - rank) + list(args[3].ty.shape)))
        q, k = args[0].ty.shape, args[1].ty.shape
        extents = tuple(_ir.static_ints([e])[0] if _ir.static_ints([e]) else None for e in (q[0], q[2], k[2]))
        gv = self.kernels.get((kernel, extents))
        if gv is None:
            name = f"attention_h{kernel.heads}_kv{kernel.kv_heads}_d{kernel.head_dim}"
            gv = self.builder_.add_func(attention_definition(kernel, *extents), name)
            self.kernels[(kernel, extents)] = gv
        call = relax.call_tir(gv, args, relax.TensorType(binding.var.ty.shape,
                                                         binding.var.ty.dtype))
        self.builder_.emit_normalized(relax.VarBinding(binding.var,
                                                       self.builder_.normalize(call)))


@module_pass("tvm_distx.FuseAttention")
class FuseAttention:
    """Every attention chain of every Relax function as one attention kernel (module doc)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        out, kernels = mod, {}
        meshes = mod.global_infos.get("mesh") if mod.global_infos else None
        devices = max((math.prod(int(d) for d in m.shape) for m in meshes or ()), default=1)
        for gv, func in _ir.relax_functions(mod):
            calls = attention_chains(func, devices)
            if not calls:
                continue
            replace = _Replace(out, calls, kernels)
            new = relax.analysis.remove_all_unused(replace.visit_expr(func))
            out = replace.builder_.get()
            out[gv] = new
            logger.info("%s: %d attention chain(s) as one attention kernel each",
                        gv.name_hint, len(calls))
        return out
