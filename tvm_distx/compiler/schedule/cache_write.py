"""The key-value cache write: a dense definition, implemented by writing the rows in place.

A decoder step writes the keys (or values) of its ``n`` new tokens into the
cache ``x`` of ``L`` positions at the positions ``index``::

    out[b, h, j, :] = source[b, h, i, :]   where index[i] == j
                    = x[b, h, j, :]        where no index is j

This module owns that kernel in two forms, as :mod:`.experts` and
:mod:`.attention` do:

* :func:`cache_write_definition` writes the formula as plain ``SBlock`` TIR
  (a one-hot selection: ``hit[j]`` and the selected source rows), which
  sharding propagation reads: batch, heads and features are spatial axes of
  every block, so a cache split by heads is written where it lies.
  :class:`tvm_distx.compiler.fuse_attention.FuseCacheWrites` puts it in place of
  the operators that :mod:`tvm_distx.frontend.torch_ops` writes for
  ``index_copy``, before legalization.
* :func:`cache_write` is how it runs (:class:`InPlaceCacheWrites` replaces the
  definition in the rank-local module): ``n`` rows copied, nothing else. When
  the old cache is not read again by the function (a decoder's cache input is
  read only by its write), the call becomes ``call_tir_inplace``: the rows are
  written into ``x`` itself, and ``out`` is ``x``. So a step costs its ``n``
  rows, not a copy of the whole static cache; the caller's cache tensor holds
  the new rows after the call. Otherwise the kernel copies ``x`` into a new
  ``out`` first.

Out-of-range positions write nothing, as in the definition. This module
imports TVM only; it is a compiler-side module (no rank process imports it).
"""

from __future__ import annotations

from dataclasses import dataclass
import logging

import tvm
from tvm import relax, te, tirx
from tvm.script import tirx as T

from tvm_distx.compiler.schedule.base import RULE_ATTR, SCHEDULED_ATTR, quick_macros
from tvm_distx.ir import helpers as _ir
from tvm_distx.ir.module_pass import module_pass

__all__ = ["CACHE_WRITE_ATTR", "CacheWrite", "InPlaceCacheWrites", "cache_write",
           "cache_write_definition"]

logger = logging.getLogger(__name__)

#: Function attribute of both forms of the kernel (its value: ``"definition"``,
#: ``"in place"`` or ``"copy"``).
CACHE_WRITE_ATTR = "tvm_distx.cache_write"

_OP_PATTERN_OPAQUE = 8  # FuseOps leaves the kernel alone


@dataclass(frozen=True)
class CacheWrite:
    """What a cache write moves: rows of ``width`` elements of ``dtype``.

    Parameters
    ----------
    width : int
        The last axis of the cache (a head's features).
    dtype : str
        The cache's dtype.
    index_dtype : str
        The dtype of the positions.
    """

    width: int
    dtype: str = "float32"
    index_dtype: str = "int64"


def _extent(value, name: str):
    if value is None:
        return tirx.Var(name, "int64")
    return tirx.IntImm("int64", int(value)) if isinstance(value, int) else value


def cache_write_definition(kernel: CacheWrite, batch=None, heads=None, length=None,
                           count=None) -> tirx.PrimFunc:
    """The write as the one-hot formula of the module docstring, in ``SBlock`` TIR.

    Parameters
    ----------
    kernel : CacheWrite
    batch, heads, length, count : int or tirx.Var, optional
        ``b``, ``h``, ``L`` and ``n``; fresh symbolic ``int64`` variables by default.

    Returns
    -------
    tvm.tirx.PrimFunc
        ``(x, index, source, out)`` in destination-passing style, marked with
        :data:`CACHE_WRITE_ATTR` and as opaque for ``FuseOps``.
    """
    b, h = _extent(batch, "batch"), _extent(heads, "heads")
    n_pos, n = _extent(length, "length"), _extent(count, "count")
    d, dtype = tirx.IntImm("int64", kernel.width), kernel.dtype
    x = te.placeholder((b, h, n_pos, d), dtype, name="x")
    index = te.placeholder((n,), kernel.index_dtype, name="index")
    source = te.placeholder((b, h, n, d), dtype, name="source")
    zero = tirx.IntImm("int64", 0)
    i = te.reduce_axis((zero, n), name="i")
    hit = te.compute((n_pos,), lambda j: te.max(tirx.Select(
        index[i].astype("int64") == j, tirx.const(1, "int32"), tirx.const(0, "int32")), axis=i),
        name="hit")
    r = te.reduce_axis((zero, n), name="r")
    written = te.compute((b, h, n_pos, d), lambda bi, hi, j, c: te.sum(tirx.Select(
        index[r].astype("int64") == j, source[bi, hi, r, c], tirx.const(0, dtype)), axis=r),
        name="written")
    out = te.compute((b, h, n_pos, d), lambda bi, hi, j, c: tirx.Select(
        hit[j] > 0, written[bi, hi, j, c], x[bi, hi, j, c]), name="out")
    func = te.create_prim_func([x, index, source, out])
    return func.with_attrs({CACHE_WRITE_ATTR: "definition", "op_pattern": _OP_PATTERN_OPAQUE}) \
        .without_attr("global_symbol")


@quick_macros()
def cache_write(kernel: CacheWrite, in_place: bool) -> tirx.PrimFunc:
    """The write's implementation: the ``n`` rows copied (module doc).

    Parameters
    ----------
    kernel : CacheWrite
    in_place : bool
        ``(x, index, source)``, writing into ``x`` (for ``call_tir_inplace``);
        else ``(x, index, source, out)``, ``out`` a copy of ``x`` with the rows.

    Returns
    -------
    tvm.tirx.PrimFunc
        Loop TIR over symbolic ``b``, ``h``, ``L`` and ``n``, marked scheduled.
    """
    d, dtype, index_dtype = kernel.width, kernel.dtype, kernel.index_dtype

    @T.macro
    def rows(index, source, out, nb, nh, nl, nn):
        for i in range(nn):
            if index[i] >= T.Cast(index_dtype, 0) and index[i] < T.Cast(index_dtype, nl):
                for bi, hi in T.grid(nb, nh):
                    for c in T.vectorized(d):
                        out[bi, hi, T.Cast("int64", index[i]), c] = source[bi, hi, i, c]

    if in_place:
        @T.prim_func(private=True, check_well_formed=False)
        def func(x_handle: T.handle, index_handle: T.handle, source_handle: T.handle):
            T.func_attr({"tirx.noalias": True})
            nb, nh, nl, nn = T.int64(), T.int64(), T.int64(), T.int64()
            x = T.match_buffer(x_handle, (nb, nh, nl, d), dtype)
            index = T.match_buffer(index_handle, (nn,), index_dtype)
            source = T.match_buffer(source_handle, (nb, nh, nn, d), dtype)
            rows(index, source, x, nb, nh, nl, nn)
    else:
        @T.prim_func(private=True, check_well_formed=False)
        def func(x_handle: T.handle, index_handle: T.handle, source_handle: T.handle,
                 out_handle: T.handle):
            T.func_attr({"tirx.noalias": True})
            nb, nh, nl, nn = T.int64(), T.int64(), T.int64(), T.int64()
            x = T.match_buffer(x_handle, (nb, nh, nl, d), dtype)
            index = T.match_buffer(index_handle, (nn,), index_dtype)
            source = T.match_buffer(source_handle, (nb, nh, nn, d), dtype)
            out = T.match_buffer(out_handle, (nb, nh, nl, d), dtype)
            for bi, hi, j in T.grid(nb, nh, nl):
                for c in T.vectorized(d):
                    out[bi, hi, j, c] = x[bi, hi, j, c]
            rows(index, source, out, nb, nh, nl, nn)

    return func.with_attrs({CACHE_WRITE_ATTR: "in place" if in_place else "copy",
                            "op_pattern": _OP_PATTERN_OPAQUE, SCHEDULED_ATTR: True,
                            RULE_ATTR: "cache-write"})


@relax.expr_functor.mutator
class _InPlace(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, writes: dict, uses: dict, kernels: dict) -> None:
        super().__init__(mod)
        self.writes, self.uses, self.kernels = writes, uses, kernels
        self.in_place = 0

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        kernel = self.writes.get(binding.var)
        if kernel is None:
            super().visit_var_binding_(binding)
            return
        call = binding.value
        args = [self.visit_expr(a) for a in call.args[1].fields]
        old = call.args[1].fields[0]
        in_place = isinstance(old, relax.Var) and self.uses.get(old, 0) == 1
        gv = self.kernels.get((kernel, in_place))
        if gv is None:
            name = f"cache_write_{'inplace' if in_place else 'copy'}_{kernel.dtype}"
            gv = self.builder_.add_func(cache_write(kernel, in_place), name)
            self.kernels[(kernel, in_place)] = gv
        out_ty = relax.TensorType(binding.var.ty.shape, binding.var.ty.dtype)
        new = relax.call_tir_inplace(gv, args, [0], out_ty) if in_place else \
            relax.call_tir(gv, args, out_ty)
        self.in_place += in_place
        self.builder_.emit_normalized(relax.VarBinding(binding.var,
                                                       self.builder_.normalize(new)))


@module_pass("tvm_distx.InPlaceCacheWrites")
class InPlaceCacheWrites:
    """Every cache write (:func:`cache_write_definition`) replaced by :func:`cache_write`.

    Run on a rank-local module (after the local view). A write whose old cache
    is read by nothing else becomes a ``call_tir_inplace`` (module doc).
    """

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        definitions = {gv: func for gv, func in mod.functions.items()
                       if isinstance(func, tirx.PrimFunc) and func.attrs is not None
                       and str(func.attrs.get(CACHE_WRITE_ATTR, "")) == "definition"}
        if not definitions:
            return mod
        out, kernels = mod, {}
        for gv, func in _ir.relax_functions(mod):
            writes = {}
            for block in func.body.blocks:
                for binding in block.bindings:
                    value = binding.value
                    if _ir.is_call_to(value, "relax.call_tir") and value.args[0] in definitions:
                        x, index = (p.ty for p in definitions[value.args[0]].params[:2])
                        writes[binding.var] = CacheWrite(int(x.shape[3]), str(x.dtype),
                                                         str(index.dtype))
            if not writes:
                continue
            replace = _InPlace(out, writes, _ir.bindings_and_uses(func)[1], kernels)
            new = replace.visit_expr(func)
            out = replace.builder_.get()
            out[gv] = new
            logger.info("%s: %d cache write(s), %d in place", gv.name_hint, len(writes),
                        replace.in_place)
        if out is mod:
            out = mod.clone()
        for gv in definitions:  # no call is left (the global-view ones were never called)
            del out[gv]
        return out
