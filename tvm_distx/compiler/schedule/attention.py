"""The attention kernel: a dense definition, implemented by a tiled online softmax.

Scaled dot-product attention over ``b`` sequences, ``h`` query heads sharing
``h_kv`` key-value heads in groups of ``g = h / h_kv``, ``s`` queries and ``L``
keys::

    z[b, h, i, j] = scale * sum_c q[b, h, i, c] * k[b, h // g, j, c]
    z[b, h, i, j] = where(mask[.., i, j], z, lowest)      (a boolean mask)
                  | z + mask[.., i, j]                     (an additive mask)
    out[b, h, i, :] = sum_j softmax_j(z[b, h, i, :]) * v[b, h // g, j, :]

``lowest`` is the dtype's lowest finite value, as transformers' masks have it.
The mask broadcasts over any of its first three axes.

This module owns that kernel in two forms with one signature
``(q, k, v[, mask]) -> out``, as :mod:`.experts` does for the experts MLP:

* :func:`attention_definition` writes the formula as plain ``SBlock`` TIR. It
  is what sharding propagation reads (the heads are a spatial axis of every
  block, so splitting them splits ``q``, ``k``, ``v`` and ``out`` alike) and
  what the local-view lowering cuts to each rank's heads.
  :class:`tvm_distx.compiler.fuse_attention.FuseAttention` puts it in place of the
  operators that compute attention, before legalization.
* :func:`flash_attention` is how the kernel runs (:class:`FlashAttention`
  replaces the definition in the rank-local module, before scheduling). It
  never holds the ``(s, L)`` scores: for each block of :data:`QUERY_BLOCK`
  queries of one head (the blocks in parallel) it walks the keys in tiles of
  :data:`KEY_TILE`, computes the tile's scores, and folds them into a running
  maximum, a running sum and an output accumulator (an online softmax). Its
  memory is about ten kilobytes per task, whatever ``s`` and ``L``.

  With a boolean mask, a tile whose mask is false for every query of the block
  is skipped: a prompt attends to the keys the mask gives it, not to the whole
  static cache, so the work of a prefill grows with the prompt and its context,
  not with ``max_length``. A query whose keys are all masked gets what the
  formula gives it (every score ``lowest``: the mean of all ``L`` values); a
  skipped tile adds exactly nothing for any other query (``exp(lowest - m)``
  is 0 for any score ``m`` a real key gives). Telling a tile apart costs one
  pass over its mask bytes, row by row.

Scores and sums are accumulated in float32 for every input dtype. This module
imports TVM only; it is a compiler-side module (no rank process imports it).
"""

from __future__ import annotations

from dataclasses import dataclass
import functools
import logging

import numpy as np
import tvm
from tvm import te, tirx
from tvm.script import tirx as T

from tvm_distx.compiler.schedule.base import (RULE_ATTR, SCHEDULED_ATTR, implement_definitions,
                                              quick_macros)
from tvm_distx.errors import ArgumentError
from tvm_distx.ir.module_pass import module_pass

__all__ = ["ATTENTION_ATTR", "AttentionKernel", "FlashAttention", "KEY_TILE", "MASK_KINDS",
           "QUERY_BLOCK", "attention_definition", "flash_attention"]

logger = logging.getLogger(__name__)

#: Function attribute of both forms of the kernel: the dict of :meth:`AttentionKernel.attrs`.
ATTENTION_ATTR = "tvm_distx.attention"
#: ``"none"``, ``"bool"`` (``where(mask, z, lowest)``) or ``"add"`` (``z + mask``).
MASK_KINDS = ("none", "bool", "add")
#: Queries of one head per task of :func:`flash_attention`.
QUERY_BLOCK = 16
#: Keys per tile of :func:`flash_attention`.
KEY_TILE = 16
#: The least query count that :func:`flash_attention` runs in blocks of queries.
BLOCK_MIN = 8

_OP_PATTERN_OPAQUE = 8  # FuseOps leaves the kernel alone
_F32 = "float32"  # scores, sums and accumulators, for every input dtype


@dataclass(frozen=True)
class AttentionKernel:
    """What an attention kernel computes, apart from its batch, query and key counts.

    Parameters
    ----------
    heads : int
        ``h``, the query heads (on a rank: its own).
    kv_heads : int
        ``h_kv``, the key and value heads; divides ``heads``.
    head_dim : int
        The width of queries and keys.
    value_dim : int
        The width of values (and of the output).
    scale : float
        The factor of the scores.
    mask : str
        One of :data:`MASK_KINDS`.
    mask_axes : tuple of bool
        For the mask's first three axes (batch, heads, queries): whether it
        has their full extent (True) or broadcasts over them (extent 1).
    dtype : str
        The dtype of ``q``, ``k``, ``v`` and the output.
    mask_dtype : str
        The dtype of the mask (``"bool"`` for a boolean one).
    """

    heads: int
    kv_heads: int
    head_dim: int
    value_dim: int
    scale: float
    mask: str = "none"
    mask_axes: tuple[bool, bool, bool] = (False, False, True)
    dtype: str = "float32"
    mask_dtype: str = "bool"

    def __post_init__(self) -> None:
        if self.mask not in MASK_KINDS:
            raise ArgumentError(f"AttentionKernel(mask={self.mask!r}): not a mask kind",
                                hint=f"one of {', '.join(MASK_KINDS)}")
        if self.kv_heads < 1 or self.heads % self.kv_heads:
            raise ArgumentError(f"AttentionKernel(heads={self.heads}, kv_heads={self.kv_heads}):"
                                " the query heads must form whole groups over the key-value "
                                "heads", hint="kv_heads divides heads")

    @property
    def group(self) -> int:
        """Query heads per key-value head."""
        return self.heads // self.kv_heads

    def attrs(self) -> dict:
        """The kernel's description, stored as :data:`ATTENTION_ATTR` on both forms.

        The head counts are not in it: they are read from the buffers, which the
        local-view lowering cuts to each rank's heads.
        """
        return {"scale": float(self.scale), "mask": self.mask,
                "mask_axes": [bool(a) for a in self.mask_axes]}

    @classmethod
    def of(cls, func: tirx.PrimFunc) -> "AttentionKernel | None":
        """The kernel ``func`` is (its attribute and buffer shapes), or None."""
        attrs = func.attrs.get(ATTENTION_ATTR) if func.attrs is not None else None
        if attrs is None:
            return None
        q, k, v = (p.ty for p in func.params[:3])
        mask = str(attrs["mask"])
        mask_dtype = str(func.params[3].ty.dtype) if mask != "none" else "bool"
        return cls(int(q.shape[1]), int(k.shape[1]), int(q.shape[3]), int(v.shape[3]),
                   float(attrs["scale"]), mask, tuple(bool(a) for a in attrs["mask_axes"]),
                   str(q.dtype), mask_dtype)


def _extent(value, name: str):
    """An int64 extent: a given int or variable, or a fresh variable named ``name``."""
    if value is None:
        return tirx.Var(name, "int64")
    return tirx.IntImm("int64", int(value)) if isinstance(value, (int, np.integer)) else value


def _lowest(dtype: str) -> float:
    return float(np.finfo(np.dtype(dtype)).min) if dtype != "bfloat16" else -3.3895e38


def attention_definition(kernel: AttentionKernel, batch=None, queries=None,
                         keys=None) -> tirx.PrimFunc:
    """The kernel as the formula of the module docstring, in ``SBlock`` TIR.

    Parameters
    ----------
    kernel : AttentionKernel
    batch, queries, keys : int or tirx.Var, optional
        ``b``, ``s`` and ``L``; fresh symbolic ``int64`` variables by default.

    Returns
    -------
    tvm.tirx.PrimFunc
        ``(q, k, v[, mask], out)`` in destination-passing style, marked with
        :data:`ATTENTION_ATTR` and as opaque for ``FuseOps``.
    """
    b, s, n = _extent(batch, "batch"), _extent(queries, "queries"), _extent(keys, "keys")
    h, hk, d, dv = (tirx.IntImm("int64", x) for x in
                    (kernel.heads, kernel.kv_heads, kernel.head_dim, kernel.value_dim))
    dtype, group = kernel.dtype, kernel.group
    one = tirx.IntImm("int64", 1)
    q = te.placeholder((b, h, s, d), dtype, name="q")
    k = te.placeholder((b, hk, n, d), dtype, name="k")
    v = te.placeholder((b, hk, n, dv), dtype, name="v")

    def kv_head(hi):
        return hi if group == 1 else hi // group

    c = te.reduce_axis((tirx.IntImm("int64", 0), d), name="c")
    dot = te.compute((b, h, s, n), lambda bi, hi, i, j: te.sum(
        q[bi, hi, i, c] * k[bi, kv_head(hi), j, c], axis=c), name="dot")
    scaled = te.compute((b, h, s, n), lambda *idx: dot(*idx) * tirx.const(kernel.scale, dtype),
                        name="scaled")
    inputs = [q, k, v]
    if kernel.mask != "none":
        full = kernel.mask_axes
        mask = te.placeholder(tuple(e if f else one for e, f in zip((b, h, s), full)) + (n,),
                              kernel.mask_dtype, name="mask")
        inputs.append(mask)

        def at(bi, hi, i, j):
            zero = tirx.IntImm("int64", 0)
            return mask[bi if full[0] else zero, hi if full[1] else zero,
                        i if full[2] else zero, j]

        if kernel.mask == "bool":
            lowest = tirx.const(_lowest(dtype), dtype)
            scored = te.compute((b, h, s, n), lambda bi, hi, i, j: tirx.Select(
                at(bi, hi, i, j).astype("bool"), scaled[bi, hi, i, j], lowest), name="masked")
        else:
            scored = te.compute((b, h, s, n), lambda bi, hi, i, j: scaled[bi, hi, i, j]
                                + at(bi, hi, i, j).astype(dtype), name="masked")
    else:
        scored = scaled
    j1 = te.reduce_axis((tirx.IntImm("int64", 0), n), name="j1")
    top = te.compute((b, h, s), lambda bi, hi, i: te.max(scored[bi, hi, i, j1], axis=j1),
                     name="top")
    e = te.compute((b, h, s, n), lambda bi, hi, i, j: tirx.exp(scored[bi, hi, i, j]
                                                               - top[bi, hi, i]), name="e")
    j2 = te.reduce_axis((tirx.IntImm("int64", 0), n), name="j2")
    total = te.compute((b, h, s), lambda bi, hi, i: te.sum(e[bi, hi, i, j2], axis=j2),
                       name="total")
    j3 = te.reduce_axis((tirx.IntImm("int64", 0), n), name="j3")
    out = te.compute((b, h, s, dv), lambda bi, hi, i, cv: te.sum(
        e[bi, hi, i, j3] / total[bi, hi, i] * v[bi, kv_head(hi), j3, cv], axis=j3), name="out")
    func = te.create_prim_func([*inputs, out])
    # private: the module that calls it names it
    return func.with_attrs({ATTENTION_ATTR: kernel.attrs(), "op_pattern": _OP_PATTERN_OPAQUE}) \
        .without_attr("global_symbol")


@functools.lru_cache(maxsize=None)
@quick_macros()
def flash_attention(kernel: AttentionKernel) -> tirx.PrimFunc:
    """The kernel's implementation: an online softmax over tiles of keys (module doc).

    Made once per kernel in a process (its TVMScript is parsed, about a second): a
    second compile of the same model (``CausalLM.export(target=...)`` after the
    compile that serves it, say) reuses it. A PrimFunc is immutable, so the modules
    that hold it share it.

    Two layouts, chosen per call by the query count ``s``:

    * **Blocks of queries** (``s >= BLOCK_MIN``, a prompt): a task holds
      :data:`QUERY_BLOCK` queries of one head transposed, ``(features,
      queries)``, so every step is a vector over the block's queries: a tile's
      scores are ``KEY_TILE`` accumulators, each key feature broadcast against
      a row of the transposed queries; the running maximum, the exponentials,
      the sums and the output accumulator (also transposed) are vector
      operations too. Nothing is reduced across vector lanes.
    * **One query at a time** (a decoded token, or a few): each score is a dot
      product along the head features, and the softmax runs along the tile.

    Full tiles run without bounds checks; the last, partial one checks each key.

    Parameters
    ----------
    kernel : AttentionKernel

    Returns
    -------
    tvm.tirx.PrimFunc
        Loop TIR over symbolic ``b``, ``s`` and ``L``, marked scheduled and
        opaque.
    """
    p = _Flash(kernel)
    uniform_row = _uniform_row(p)
    block_tile = _block_tile(p, _tile_liveness(p))
    body = _tasks(p, _block_task(p, block_tile, uniform_row), _row_task(p, uniform_row))
    func = _flash_func(p, body)
    return func.with_attrs({ATTENTION_ATTR: kernel.attrs(), "op_pattern": _OP_PATTERN_OPAQUE,
                            SCHEDULED_ATTR: True, RULE_ATTR: "attention"})


class _Flash:
    """What every piece of one :func:`flash_attention` build reads: the kernel's sizes, the
    tile sizes, the float32 constants, and the element reads of ``q``/``k``/``v`` and the mask.

    Each piece is a TVMScript macro made by a function of this module (``_block_tile``,
    ``_row_task``, ...) from these values; the macros see them as plain names.
    """

    def __init__(self, kernel: AttentionKernel) -> None:
        self.heads, self.kv_heads = kernel.heads, kernel.kv_heads
        self.d, self.dv = kernel.head_dim, kernel.value_dim
        self.group, self.dtype, self.kind, self.full = (kernel.group, kernel.dtype, kernel.mask,
                                                        kernel.mask_axes)
        self.mask_dtype = kernel.mask_dtype
        self.bq, self.bk = QUERY_BLOCK, KEY_TILE
        #: the vector width of a row's dot products along ``d``, and the output features
        #: accumulated together along ``dv``
        self.lanes = next(n for n in (16, 8, 4, 2, 1) if self.d % n == 0)
        self.strip = next(n for n in (8, 4, 2, 1) if self.dv % n == 0)
        self.scale = tirx.const(kernel.scale, _F32)
        self.lowest = tirx.const(_lowest(self.dtype), _F32)
        self.zero = tirx.const(0, _F32)
        self.minus_inf = tirx.const(float("-inf"), _F32)

    def f(self, value):
        """``value`` as float32, the accumulators' dtype."""
        return value if self.dtype == _F32 else T.Cast(_F32, value)

    def mask_at(self, mask, bi, hi, i, j):
        """The mask's element for score ``(bi, hi, i, j)``, broadcast over its size-1 axes."""
        full = self.full
        return mask[bi if full[0] else 0, hi if full[1] else 0, i if full[2] else 0, j]

    def kept(self, mask, bi, hi, i, j):
        """1 where the boolean mask keeps the score, else 0 (int32)."""
        value = self.mask_at(mask, bi, hi, i, j)
        if self.mask_dtype != "bool":
            value = value != T.Cast(self.mask_dtype, 0)
        return T.Select(value, 1, 0)

    def kept8(self, mask, bi, hi, i, j):
        """:meth:`kept` as an int8 (16 of them in one 128-bit register)."""
        value = self.mask_at(mask, bi, hi, i, j)
        if self.mask_dtype != "bool":
            return T.Cast("int8", value != T.Cast(self.mask_dtype, 0))
        return T.Cast("int8", value)


def _uniform_row(p: _Flash):
    """The macro writing a query's output when its mask keeps no key: the mean of the values."""
    dv, dtype, zero, f = p.dv, p.dtype, p.zero, p.f
    f32 = _F32

    @T.macro
    def uniform_row(v, out, bi, hi, kh, i, nl):
        # every key masked: every score is ``lowest``, so the weights are uniform
        mean = T.decl_buffer((dv,), f32, scope="local")
        for c in T.vectorized(dv):
            mean[c] = zero
        for j in range(nl):
            for c in T.vectorized(dv):
                mean[c] = mean[c] + f(v[bi, kh, j, c])
        for c in range(dv):
            out[bi, hi, i, c] = T.Cast(dtype, mean[c] / T.Cast(f32, nl))

    return uniform_row


# ---------------------------------------------------------------- blocks of queries
def _tile_liveness(p: _Flash):
    """The macro telling whether a tile of keys counts for a block of queries (``live``) and,
    when a boolean mask keeps only some of the tile's keys, that mask transposed (``mt``)."""
    bq, bk, kind, kept, kept8 = p.bq, p.bk, p.kind, p.kept, p.kept8

    @T.macro
    def tile_liveness(mask, mt, scan, live, bi, hi, i0, j0, rows, cols, whole):
        # live[0]: a key of the tile is kept for some query; live[1]: every key for every
        # query (a tile below a causal mask's diagonal: no select needed). The mask is
        # read along its rows here (contiguous); transposed, mt[jj, r], only when mixed.
        if kind == "bool":
            for jj in T.vectorized(bk):
                scan[0, jj] = T.int8(0)
                scan[1, jj] = T.int8(1)
            for r in range(rows):
                if whole:
                    for jj in T.vectorized(bk):
                        scan[0, jj] = T.max(scan[0, jj], kept8(mask, bi, hi, i0 + r, j0 + jj))
                        scan[1, jj] = T.min(scan[1, jj], kept8(mask, bi, hi, i0 + r, j0 + jj))
                else:
                    for jj in range(cols):
                        scan[0, jj] = T.max(scan[0, jj], kept8(mask, bi, hi, i0 + r, j0 + jj))
                        scan[1, jj] = T.min(scan[1, jj], kept8(mask, bi, hi, i0 + r, j0 + jj))
            live[0] = T.Cast("int32", scan[0, 0])
            live[1] = T.Cast("int32", scan[1, 0])
            for jj in range(1, cols):
                live[0] = T.max(live[0], T.Cast("int32", scan[0, jj]))
                live[1] = T.min(live[1], T.Cast("int32", scan[1, jj]))
            if live[0] != 0 and live[1] == 0:
                for jj in range(bk):
                    if whole:
                        for r in T.vectorized(bq):
                            mt[jj, r] = kept(mask, bi, hi, i0 + r, j0 + jj)
                    else:
                        for r in range(bq):
                            mt[jj, r] = T.if_then_else(r < rows and jj < cols,
                                                       kept(mask, bi, hi, i0 + r, j0 + jj), 0)
        else:
            live[0] = 1
            live[1] = 1

    return tile_liveness


def _block_tile(p: _Flash, tile_liveness):
    """The macro folding one tile of keys into a block of queries' running softmax."""
    d, dv, bq, bk, strip, kind = p.d, p.dv, p.bq, p.bk, p.strip, p.kind
    zero, lowest, minus_inf, f, mask_at = p.zero, p.lowest, p.minus_inf, p.f, p.mask_at

    @T.macro
    def block_tile(k, v, mask, qt, st, mt, scan, at, top, total, live, bi, hi, kh, i0, j0,
                   rows, cols, whole):
        tile_liveness(mask, mt, scan, live, bi, hi, i0, j0, rows, cols, whole)
        if live[0] != 0:
            for jj in T.unroll(bk):
                for r in T.vectorized(bq):
                    st[jj, r] = zero
            for c in range(d):
                for jj in T.unroll(bk):
                    for r in T.vectorized(bq):
                        if whole:
                            st[jj, r] = st[jj, r] + f(k[bi, kh, j0 + jj, c]) * qt[c, r]
                        else:
                            st[jj, r] = st[jj, r] + T.if_then_else(
                                jj < cols, f(k[bi, kh, j0 + jj, c]), zero) * qt[c, r]
            for jj in range(bk):
                if kind == "bool" and live[1] == 0:
                    for r in T.vectorized(bq):
                        st[jj, r] = T.Select(jj < cols, T.Select(mt[jj, r] > 0, st[jj, r],
                                                                 lowest), minus_inf)
                elif kind == "add":
                    for r in range(bq):
                        st[jj, r] = T.if_then_else(
                            jj < cols and r < rows,
                            st[jj, r] + f(mask_at(mask, bi, hi, i0 + r, j0 + jj)), minus_inf)
                elif not whole:
                    for r in T.vectorized(bq):
                        st[jj, r] = T.Select(jj < cols, st[jj, r], minus_inf)
            # at[0]: the new running maximum, at[1]: the old terms' factor; st: the weights
            for r in T.vectorized(bq):
                at[0, r] = top[r]
            for jj in range(bk):
                for r in T.vectorized(bq):
                    at[0, r] = T.max(at[0, r], st[jj, r])
            for r in T.vectorized(bq):
                at[1, r] = T.exp(top[r] - at[0, r])
                top[r] = at[0, r]
                total[r] = total[r] * at[1, r]
            for jj in range(bk):
                for r in T.vectorized(bq):
                    st[jj, r] = T.exp(st[jj, r] - at[0, r])
                    total[r] = total[r] + st[jj, r]
            # the output features in groups of ``strip``: independent accumulators
            # (vector registers) across the tile's keys
            for cb in range(dv // strip):
                for u in T.unroll(strip):
                    for r in T.vectorized(bq):
                        at[2 + cb * strip + u, r] = at[2 + cb * strip + u, r] * at[1, r]
                for jj in range(cols):
                    for u in T.unroll(strip):
                        for r in T.vectorized(bq):
                            at[2 + cb * strip + u, r] = at[2 + cb * strip + u, r] + \
                                st[jj, r] * f(v[bi, kh, j0 + jj, cb * strip + u])

    return block_tile


def _block_task(p: _Flash, block_tile, uniform_row):
    """The macro of one task over a block of queries of one head: every tile, then the output."""
    d, dv, bq, bk, group, dtype, kind = p.d, p.dv, p.bq, p.bk, p.group, p.dtype, p.kind
    scale, zero, lowest, minus_inf, f = p.scale, p.zero, p.lowest, p.minus_inf, p.f
    f32 = _F32

    @T.macro
    def block_task(q, k, v, mask, out, bi, hi, i0, rows, nl, tiles):
        qt = T.decl_buffer((d, bq), f32, scope="local")
        st = T.decl_buffer((bk, bq), f32, scope="local")
        mt = T.decl_buffer((bk, bq), "int32", scope="local")
        scan = T.decl_buffer((2, bk), "int8", scope="local")
        # at[0]: the tile's maximum, at[1]: the old terms' factor, at[2:]: the output
        at = T.decl_buffer((2 + dv, bq), f32, scope="local")
        top = T.decl_buffer((bq,), f32, scope="local")
        total = T.decl_buffer((bq,), f32, scope="local")
        live = T.decl_buffer((2,), "int32", scope="local")
        kh = hi // group
        for c, r in T.grid(d, bq):
            qt[c, r] = T.if_then_else(r < rows, f(q[bi, hi, i0 + r, c]) * scale, zero)
        for r in T.vectorized(bq):
            top[r] = minus_inf
            total[r] = zero
        for c in range(dv):
            for r in T.vectorized(bq):
                at[2 + c, r] = zero
        for tile in range(tiles):
            j0 = tile * bk
            cols = T.Cast("int32", T.min(T.int64(bk), nl - j0))
            if cols == bk and rows == bq:
                block_tile(k, v, mask, qt, st, mt, scan, at, top, total, live, bi, hi, kh, i0,
                           j0, rows, cols, True)
            else:
                block_tile(k, v, mask, qt, st, mt, scan, at, top, total, live, bi, hi, kh, i0,
                           j0, rows, cols, False)
        for r in range(rows):
            if kind == "bool" and top[r] <= lowest:  # no key kept (see the module doc)
                uniform_row(v, out, bi, hi, kh, i0 + r, nl)
            else:
                for c in range(dv):
                    out[bi, hi, i0 + r, c] = T.Cast(dtype, at[2 + c, r] / total[r])

    return block_task


# ------------------------------------------------------------- one query at a time
def _row_task(p: _Flash, uniform_row):
    """The macro of one task over one query of one head: a dot product per key, tile by tile."""
    d, dv, bk, lanes, group, dtype, kind = p.d, p.dv, p.bk, p.lanes, p.group, p.dtype, p.kind
    scale, zero, lowest, minus_inf = p.scale, p.zero, p.lowest, p.minus_inf
    f, mask_at, kept = p.f, p.mask_at, p.kept
    f32 = _F32

    @T.macro
    def row_task(q, k, v, mask, out, bi, hi, i, nl, tiles):
        qs = T.decl_buffer((d,), f32, scope="local")
        sc = T.decl_buffer((bk,), f32, scope="local")
        acc = T.decl_buffer((dv,), f32, scope="local")
        lane = T.decl_buffer((lanes,), f32, scope="local")
        state = T.decl_buffer((4,), f32, scope="local")  # maximum, sum, new maximum, factor
        seen = T.decl_buffer((1,), "int32", scope="local")
        kh = hi // group
        for c in T.vectorized(d):
            qs[c] = f(q[bi, hi, i, c]) * scale
        for c in T.vectorized(dv):
            acc[c] = zero
        state[0] = minus_inf
        state[1] = zero
        seen[0] = 0
        for tile in range(tiles):
            j0 = tile * bk
            cols = T.Cast("int32", T.min(T.int64(bk), nl - j0))
            live = 1
            if kind == "bool":
                live = 0
                for jj in range(cols):
                    live = T.max(live, kept(mask, bi, hi, i, j0 + jj))
                seen[0] = T.max(seen[0], live)
            if live != 0:
                for jj in range(bk):
                    if jj < cols:
                        for u in T.vectorized(lanes):
                            lane[u] = zero
                        for co in range(d // lanes):
                            for u in T.vectorized(lanes):
                                lane[u] = lane[u] + qs[co * lanes + u] * \
                                    f(k[bi, kh, j0 + jj, co * lanes + u])
                        sc[jj] = zero
                        for u in range(lanes):
                            sc[jj] = sc[jj] + lane[u]
                        if kind == "bool":
                            sc[jj] = T.Select(kept(mask, bi, hi, i, j0 + jj) > 0, sc[jj],
                                              lowest)
                        elif kind == "add":
                            sc[jj] = sc[jj] + f(mask_at(mask, bi, hi, i, j0 + jj))
                    else:
                        sc[jj] = minus_inf
                state[2] = state[0]
                for jj in range(bk):
                    state[2] = T.max(state[2], sc[jj])
                state[3] = T.exp(state[0] - state[2])
                state[0] = state[2]
                for jj in T.vectorized(bk):
                    sc[jj] = T.exp(sc[jj] - state[2])
                state[1] = state[1] * state[3]
                for jj in range(bk):
                    state[1] = state[1] + sc[jj]
                for c in T.vectorized(dv):
                    acc[c] = acc[c] * state[3]
                for jj in range(cols):
                    for c in T.vectorized(dv):
                        acc[c] = acc[c] + sc[jj] * f(v[bi, kh, j0 + jj, c])
        if kind == "bool" and seen[0] == 0:
            uniform_row(v, out, bi, hi, kh, i, nl)
        else:
            for c in range(dv):
                out[bi, hi, i, c] = T.Cast(dtype, acc[c] / state[1])

    return row_task


# ------------------------------------------------------------------------ the function
def _tasks(p: _Flash, block_task, row_task):
    """The macro of the whole call: parallel tasks of query blocks, or of single queries."""
    heads, bq, bk = p.heads, p.bq, p.bk

    @T.macro
    def body(q, k, v, mask, out, nb, ns, nl):
        tiles = (nl + (bk - 1)) // bk
        if ns >= BLOCK_MIN:
            blocks = (ns + (bq - 1)) // bq
            for task in T.parallel(nb * heads * blocks):
                i0 = task % blocks * bq
                block_task(q, k, v, mask, out, task // (heads * blocks), task // blocks % heads,
                           i0, T.Cast("int32", T.min(T.int64(bq), ns - i0)), nl, tiles)
        else:
            for task in T.parallel(nb * heads * ns):
                row_task(q, k, v, mask, out, task // (heads * ns), task // ns % heads,
                         task % ns, nl, tiles)

    return body


def _flash_func(p: _Flash, body) -> tirx.PrimFunc:
    """The PrimFunc ``(q, k, v[, mask], out)`` over symbolic ``b``, ``s``, ``L``: ``body``."""
    heads, kv_heads, d, dv, dtype = p.heads, p.kv_heads, p.d, p.dv, p.dtype
    full, mask_dtype = p.full, p.mask_dtype
    if p.kind == "none":
        @T.prim_func(private=True, check_well_formed=False)
        def func(q_handle: T.handle, k_handle: T.handle, v_handle: T.handle,
                 out_handle: T.handle):
            T.func_attr({"tirx.noalias": True})
            nb, ns, nl = T.int64(), T.int64(), T.int64()
            q = T.match_buffer(q_handle, (nb, heads, ns, d), dtype)
            k = T.match_buffer(k_handle, (nb, kv_heads, nl, d), dtype)
            v = T.match_buffer(v_handle, (nb, kv_heads, nl, dv), dtype)
            out = T.match_buffer(out_handle, (nb, heads, ns, dv), dtype)
            body(q, k, v, None, out, nb, ns, nl)
    else:
        @T.prim_func(private=True, check_well_formed=False)
        def func(q_handle: T.handle, k_handle: T.handle, v_handle: T.handle,
                 mask_handle: T.handle, out_handle: T.handle):
            T.func_attr({"tirx.noalias": True})
            nb, ns, nl = T.int64(), T.int64(), T.int64()
            q = T.match_buffer(q_handle, (nb, heads, ns, d), dtype)
            k = T.match_buffer(k_handle, (nb, kv_heads, nl, d), dtype)
            v = T.match_buffer(v_handle, (nb, kv_heads, nl, dv), dtype)
            mask = T.match_buffer(mask_handle, (nb if full[0] else 1, heads if full[1] else 1,
                                                ns if full[2] else 1, nl), mask_dtype)
            out = T.match_buffer(out_handle, (nb, heads, ns, dv), dtype)
            body(q, k, v, mask, out, nb, ns, nl)
    return func


@module_pass("tvm_distx.FlashAttention")
class FlashAttention:
    """Every attention kernel (:func:`attention_definition`) replaced by :func:`flash_attention`.

    Run on a rank-local module (after the local view): each kernel then has
    its rank's heads, and its implementation is built for them.
    """

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        def implement(name: str, func: tirx.PrimFunc) -> tirx.PrimFunc:
            kernel = AttentionKernel.of(func)
            logger.info("attention kernel %s: online softmax over %d local heads (%d key-value "
                        "heads), %s mask", name, kernel.heads, kernel.kv_heads, kernel.mask)
            return flash_attention(kernel)

        return implement_definitions(mod, ATTENTION_ATTR, implement)
