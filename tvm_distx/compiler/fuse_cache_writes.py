"""Key-value cache writes written as operators become one cache-write kernel.

:mod:`tvm_distx.frontend.torch_ops` translates ``index_copy(x, 2, index, source)``
(how :mod:`tvm_distx.frontend.decoder` writes a token's keys and values into
the static cache) as a one-hot selection, so that sharding sees nothing but
elementwise operators and a batched product::

    hit = equal(expand_dims(index, 1), expand_dims(arange(0, L), 0))      (n, L)
    out = where(astype(expand_dims(max(astype(hit, int32), [0]), 1), bool),
                matmul(astype(permute_dims(hit), dtype), source), x)       n tokens
    out = where(permute_dims(hit), source, x)                              one token

Run as written, that is ``L x n`` products per head feature and a pass over the
whole cache at every step. :class:`FuseCacheWrites` replaces each such ``where``
by one ``call_tir`` of the cache-write kernel's definition
(:func:`tvm_distx.compiler.schedule.cache_write.cache_write_definition`) over ``x``,
``index`` and ``source``; each rank then runs it as a copy of ``n`` rows, in
place (:class:`~tvm_distx.compiler.schedule.cache_write.InPlaceCacheWrites`).
It runs in :func:`tvm_distx.compiler.pipeline.legalize_ops`, before ``LegalizeOps``.
"""

from __future__ import annotations

import logging

import tvm
from tvm import relax

from tvm_distx.compiler.schedule.cache_write import CacheWrite, cache_write_definition
from tvm_distx.ir import helpers as _ir
from tvm_distx.ir.module_pass import module_pass

__all__ = ["FuseCacheWrites", "cache_writes"]

logger = logging.getLogger(__name__)


def _axes(call) -> list[int] | None:
    axes = getattr(call.attrs, "axes", None) if _ir.operator_name(call) == "relax.permute_dims" else \
        getattr(call.attrs, "axis", None)
    return None if axes is None else [int(a) for a in axes]


class _Bindings:
    def __init__(self, func: relax.Function) -> None:
        self.bound = {b.var: b.value for block in func.body.blocks for b in block.bindings}

    def value(self, expr, op: str):
        value = self.bound.get(expr) if isinstance(expr, relax.Var) else None
        return value if _ir.operator_name(value) == op else None

    def hit(self, expr):
        """``index`` when ``expr`` is ``equal(expand_dims(index, 1), expand_dims(arange, 0))``."""
        equal = self.value(expr, "relax.equal")
        if equal is None:
            return None
        rows, slots = (self.value(a, "relax.expand_dims") for a in equal.args)
        if rows is None or slots is None or _axes(rows) != [1] or _axes(slots) != [0] or \
                self.value(slots.args[0], "relax.arange") is None:
            return None
        index = rows.args[0]
        return index if len(index.ty.shape) == 1 else None

    def write(self, where) -> tuple | None:
        """``(x, index, source)`` when ``where`` is one of the module doc's forms."""
        cond, written, x = where.args
        index = source = None
        single = self.value(cond, "relax.permute_dims")
        if single is not None and _axes(single) == [1, 0]:
            index, source = self.hit(single.args[0]), written
        else:
            cast = self.value(cond, "relax.astype")
            mask = None if cast is None else self.value(cast.args[0], "relax.expand_dims")
            top = None if mask is None else self.value(mask.args[0], "relax.max")
            counted = None if top is None else self.value(top.args[0], "relax.astype")
            product = self.value(written, "relax.matmul")
            weights = None if product is None else self.value(product.args[0], "relax.astype")
            moved = None if weights is None else self.value(weights.args[0],
                                                            "relax.permute_dims")
            if counted is None or moved is None or _axes(moved) != [1, 0] or \
                    not moved.args[0].same_as(counted.args[0]):
                return None
            index, source = self.hit(counted.args[0]), product.args[1]
        if index is None or any(len(t.ty.shape) != 4 for t in (x, source)) or \
                str(x.ty.dtype) != str(source.ty.dtype):
            return None
        if _ir.static_ints([x.ty.shape[3]]) is None:
            return None
        return x, index, source


def cache_writes(func: relax.Function) -> dict:
    """``{var: (x, index, source)}`` for every cache write of ``func`` (module doc)."""
    bindings = _Bindings(func)
    found = {}
    for var, value in bindings.bound.items():
        got = bindings.write(value) if _ir.operator_name(value) == "relax.where" else None
        if got is not None:
            found[var] = got
    return found


@relax.expr_functor.mutator
class _Replace(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, writes: dict, kernels: dict) -> None:
        super().__init__(mod)
        self.writes, self.kernels = writes, kernels

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var not in self.writes:
            super().visit_var_binding_(binding)
            return
        x, index, source = (self.visit_expr(a) for a in self.writes[binding.var])
        kernel = CacheWrite(int(x.ty.shape[3]), str(x.ty.dtype), str(index.ty.dtype))
        extents = tuple(_ir.static_ints([e])[0] if _ir.static_ints([e]) else None
                        for e in (x.ty.shape[0], x.ty.shape[1], x.ty.shape[2],
                                  index.ty.shape[0]))
        gv = self.kernels.get((kernel, extents))
        if gv is None:
            gv = self.builder_.add_func(cache_write_definition(kernel, *extents),
                                        "cache_write")
            self.kernels[(kernel, extents)] = gv
        call = relax.call_tir(gv, [x, index, source],
                              relax.TensorType(binding.var.ty.shape, binding.var.ty.dtype))
        self.builder_.emit_normalized(relax.VarBinding(binding.var,
                                                       self.builder_.normalize(call)))


@module_pass("tvm_distx.FuseCacheWrites")
class FuseCacheWrites:
    """Every cache write of every Relax function as one cache-write kernel (module doc)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        out, kernels = mod, {}
        for gv, func in _ir.relax_functions(mod):
            writes = cache_writes(func)
            if not writes:
                continue
            replace = _Replace(out, writes, kernels)
            new = relax.analysis.remove_all_unused(replace.visit_expr(func))
            out = replace.builder_.get()
            out[gv] = new
            logger.info("%s: %d cache write(s) as one kernel each", gv.name_hint, len(writes))
        return out
