"""The experts kernel of a sparse MLP: a dense definition, implemented by a sparse dispatch.

A mixture-of-experts layer with gated (SwiGLU) experts computes, for ``T``
tokens ``x`` of width ``H``, ``E`` experts with intermediate width ``I`` and the
routing matrix ``c`` (``c[t, e]`` is token ``t``'s weight for expert ``e``, zero
for the experts it was not routed to)::

    h[e, t, :] = x[t] @ W_up[e]^T                  (2I)  gate | up
    g[e, t, i] = silu(h[e, t, i]) * h[e, t, I + i]
    y[e, t, :] = g[e, t] @ W_down[e]^T              (H)
    out[t, :]  = sum_e c[t, e] * y[e, t]

This module owns that kernel in two forms with one signature
``(x (T, H), c (T, E), W_up, W_down) -> out (T, H)``:

* :func:`experts_definition` writes the formula above as plain ``SBlock`` TIR
  (``te.create_prim_func``). It is what sharding propagation reads
  (:mod:`tvm_distx.passes.tir_access`: the expert axis ``e`` is a summed axis,
  so splitting it leaves a partial sum) and what TVM's local-view lowering cuts
  to ``E / p`` experts per rank, adding the one all-reduce after it. Every
  rank's ``c`` is then the slice of the routing matrix of its own experts: the
  global expert ids need no offset, the slice renumbers them.
* :func:`sparse_experts` is how the kernel runs (:class:`SparseExperts`
  replaces the definition in the rank-local module, before scheduling). It is
  hand-written loop TIR: for each token (in parallel), for each of the rank's
  experts whose routing weight for that token is not zero, it runs that
  expert's MLP on the token and adds the result, scaled by the weight, into
  ``out[t]``. So a rank does ``(routed pairs on its experts) x 6 I H`` flops,
  about ``T k / p`` expert MLPs, instead of the definition's ``T E / p``.

Why a per-(token, expert) loop rather than sorting tokens by expert and a
grouped matmul: the routing is already a dense ``(T, E)`` matrix on every rank
(replicated router), so testing ``c[t, e] != 0`` costs ``T E / p`` compares
and no data-dependent shapes, no sort and no gather buffers; each expert MLP is
two matrix-vector products over contiguous weight rows. The price is that an
expert's weights are re-read for every token routed to it (a grouped matmul
would reuse them across tokens), which matters for long prompts on large
experts, not for decoding.

A routed expert whose weight is exactly zero is skipped; its contribution,
``0 * y``, is zero (the definition would give NaN only for an infinite ``y``).

This module imports TVM only; it is a compiler-side module (no rank process
imports it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import tvm
from tvm import te, tirx
from tvm.script import tirx as T

from tvm_distx.compiler.schedule.base import (RULE_ATTR, SCHEDULED_ATTR, implement_definitions,
                                              quick_macros)
from tvm_distx.ir.module_pass import module_pass

__all__ = ["EXPERTS_ATTR", "ExpertsKernel", "experts_definition", "sparse_experts",
           "SparseExperts", "expert_mlp_flops"]

logger = logging.getLogger(__name__)

#: Function attribute of both forms of the kernel: the dict of :meth:`ExpertsKernel.attrs`.
EXPERTS_ATTR = "tvm_distx.experts"

_OP_PATTERN_OPAQUE = 8  # FuseOps leaves the kernel alone

#: Vector lanes of the dot products (8 float32: one AVX2 register; LLVM splits or joins
#: them for other widths).
_LANES = 8


@dataclass(frozen=True)
class ExpertsKernel:
    """The shape of one experts kernel (``T``, the token count, is not part of it).

    Parameters
    ----------
    experts : int
        ``E``, the experts the kernel holds (on a rank: its local experts).
    hidden : int
        ``H``, the token width.
    intermediate : int
        ``I``, each expert's gated width (``W_up`` has ``2 I`` rows: gate | up).
    dtype : str
        The dtype of every operand.
    up_transposed : bool
        ``W_up`` stored ``(E, H, 2I)`` rather than ``(E, 2I, H)``.
    down_transposed : bool
        ``W_down`` stored ``(E, I, H)`` rather than ``(E, H, I)``.
    """

    experts: int
    hidden: int
    intermediate: int
    dtype: str = "float32"
    up_transposed: bool = False
    down_transposed: bool = False

    @property
    def up_shape(self) -> tuple[int, int, int]:
        """The shape of ``W_up``."""
        e, h, i2 = self.experts, self.hidden, 2 * self.intermediate
        return (e, h, i2) if self.up_transposed else (e, i2, h)

    @property
    def down_shape(self) -> tuple[int, int, int]:
        """The shape of ``W_down``."""
        e, h, i = self.experts, self.hidden, self.intermediate
        return (e, i, h) if self.down_transposed else (e, h, i)

    def attrs(self) -> dict:
        """The kernel's description, stored as :data:`EXPERTS_ATTR` on both forms."""
        return {"hidden": self.hidden, "intermediate": self.intermediate,
                "up_transposed": self.up_transposed, "down_transposed": self.down_transposed}

    @classmethod
    def of(cls, func: tirx.PrimFunc) -> "ExpertsKernel | None":
        """The kernel ``func`` is (read from its attribute and buffer shapes), or None."""
        attrs = func.attrs.get(EXPERTS_ATTR) if func.attrs is not None else None
        if attrs is None:
            return None
        up = func.params[2].ty
        return cls(int(up.shape[0]), int(attrs["hidden"]), int(attrs["intermediate"]),
                   str(up.dtype), bool(attrs["up_transposed"]), bool(attrs["down_transposed"]))


def expert_mlp_flops(hidden: int, intermediate: int) -> int:
    """Floating-point operations of one expert MLP on one token: three ``H x I`` products."""
    return 2 * 3 * hidden * intermediate


def _i64(value: int) -> tirx.IntImm:
    return tirx.IntImm("int64", int(value))


def experts_definition(kernel: ExpertsKernel, tokens=None) -> tirx.PrimFunc:
    """The kernel as the formula of the module docstring, in ``SBlock`` TIR.

    Parameters
    ----------
    kernel : ExpertsKernel
    tokens : int or tirx.Var, optional
        ``T``; a fresh symbolic ``int64`` variable by default.

    Returns
    -------
    tvm.tirx.PrimFunc
        ``(x, c, W_up, W_down, out)`` in destination-passing style, marked with
        :data:`EXPERTS_ATTR` and as opaque for ``FuseOps``.
    """
    n = tirx.Var("tokens", "int64") if tokens is None else tokens
    n = _i64(n) if isinstance(n, int) else n
    e, h, i = (_i64(v) for v in (kernel.experts, kernel.hidden, kernel.intermediate))
    dtype = kernel.dtype
    x = te.placeholder((n, h), dtype, name="x")
    c = te.placeholder((n, e), dtype, name="routing")
    w_up = te.placeholder(tuple(_i64(d) for d in kernel.up_shape), dtype, name="w_up")
    w_down = te.placeholder(tuple(_i64(d) for d in kernel.down_shape), dtype, name="w_down")
    k = te.reduce_axis((_i64(0), h), name="k")
    if kernel.up_transposed:
        up = te.compute((e, n, 2 * i), lambda ex, t, j: te.sum(x[t, k] * w_up[ex, k, j], axis=k),
                        name="up")
    else:
        up = te.compute((e, n, 2 * i), lambda ex, t, j: te.sum(x[t, k] * w_up[ex, j, k], axis=k),
                        name="up")
    gated = te.compute((e, n, i), lambda ex, t, j: up[ex, t, j] * tirx.sigmoid(up[ex, t, j])
                       * up[ex, t, j + i], name="gate")
    r = te.reduce_axis((_i64(0), i), name="r")
    if kernel.down_transposed:
        down = te.compute((e, n, h), lambda ex, t, d: te.sum(gated[ex, t, r] * w_down[ex, r, d],
                                                              axis=r), name="down")
    else:
        down = te.compute((e, n, h), lambda ex, t, d: te.sum(gated[ex, t, r] * w_down[ex, d, r],
                                                              axis=r), name="down")
    s = te.reduce_axis((_i64(0), e), name="s")
    out = te.compute((n, h), lambda t, d: te.sum(c[t, s] * down[s, t, d], axis=s),
                     name="combine")
    func = te.create_prim_func([x, c, w_up, w_down, out])
    # private: the module that calls it names it
    return func.with_attrs({EXPERTS_ATTR: kernel.attrs(), "op_pattern": _OP_PATTERN_OPAQUE}) \
        .without_attr("global_symbol")


@quick_macros()
def sparse_experts(kernel: ExpertsKernel, *, count: bool = False) -> tirx.PrimFunc:
    """The kernel's implementation: each token runs only the experts it was routed to.

    Parameters
    ----------
    kernel : ExpertsKernel
    count : bool
        Add a last output, ``evaluations (T,) int32``: how many expert MLPs each
        token ran (for tests and measurements; the kernels that run a model
        have no such output).

    Returns
    -------
    tvm.tirx.PrimFunc
        Loop TIR over a symbolic token count, marked scheduled and opaque.
    """
    n_exp, hid, inter = kernel.experts, kernel.hidden, kernel.intermediate
    two_i, dtype = 2 * inter, kernel.dtype
    up_t, down_t = kernel.up_transposed, kernel.down_transposed
    up_shape, down_shape = kernel.up_shape, kernel.down_shape
    zero = tirx.const(0, dtype)

    lanes = _LANES
    hid_main, inter_main = hid // lanes * lanes, inter // lanes * lanes

    @T.macro
    def body(x, c, w_up, w_down, out, evaluations, n):
        for t in T.parallel(n):
            act = T.decl_buffer((two_i,), dtype)
            lane = T.decl_buffer((lanes,), dtype, scope="local")
            total = T.decl_buffer((1,), dtype, scope="local")
            for d in range(hid):
                out[t, d] = zero
            if count:
                evaluations[t] = 0
            for ex in range(n_exp):
                if c[t, ex] != zero:
                    if count:
                        evaluations[t] = evaluations[t] + 1
                    # gate | up: an axpy per input feature, or a dot product per row
                    # (vector lanes over the contiguous features, then their sum)
                    if up_t:
                        for j in range(two_i):
                            act[j] = zero
                        for k in range(hid):
                            for j in range(two_i):
                                act[j] = act[j] + x[t, k] * w_up[ex, k, j]
                    else:
                        for j in range(two_i):
                            for v in T.vectorized(lanes):
                                lane[v] = zero
                            for ko in range(hid_main // lanes):
                                for v in T.vectorized(lanes):
                                    lane[v] = lane[v] + x[t, ko * lanes + v] * \
                                        w_up[ex, j, ko * lanes + v]
                            total[0] = zero
                            for v in range(lanes):
                                total[0] = total[0] + lane[v]
                            for k in range(hid_main, hid):
                                total[0] = total[0] + x[t, k] * w_up[ex, j, k]
                            act[j] = total[0]
                    for j in range(inter):
                        act[j] = act[j] * T.sigmoid(act[j]) * act[j + inter]
                    # down, scaled by the routing weight, added into the token's row
                    if down_t:
                        for j in range(inter):
                            for d in range(hid):
                                out[t, d] = out[t, d] + c[t, ex] * act[j] * w_down[ex, j, d]
                    else:
                        for d in range(hid):
                            for v in T.vectorized(lanes):
                                lane[v] = zero
                            for jo in range(inter_main // lanes):
                                for v in T.vectorized(lanes):
                                    lane[v] = lane[v] + act[jo * lanes + v] * \
                                        w_down[ex, d, jo * lanes + v]
                            total[0] = zero
                            for v in range(lanes):
                                total[0] = total[0] + lane[v]
                            for j in range(inter_main, inter):
                                total[0] = total[0] + act[j] * w_down[ex, d, j]
                            out[t, d] = out[t, d] + c[t, ex] * total[0]

    if count:
        @T.prim_func(private=True, check_well_formed=False)
        def func(x_handle: T.handle, c_handle: T.handle, w_up: T.Buffer(up_shape, dtype),
                 w_down: T.Buffer(down_shape, dtype), out_handle: T.handle,
                 count_handle: T.handle):
            T.func_attr({"tirx.noalias": True})
            n = T.int64()
            x = T.match_buffer(x_handle, (n, hid), dtype)
            c = T.match_buffer(c_handle, (n, n_exp), dtype)
            out = T.match_buffer(out_handle, (n, hid), dtype)
            evaluations = T.match_buffer(count_handle, (n,), "int32")
            body(x, c, w_up, w_down, out, evaluations, n)
    else:
        @T.prim_func(private=True, check_well_formed=False)
        def func(x_handle: T.handle, c_handle: T.handle, w_up: T.Buffer(up_shape, dtype),
                 w_down: T.Buffer(down_shape, dtype), out_handle: T.handle):
            T.func_attr({"tirx.noalias": True})
            n = T.int64()
            x = T.match_buffer(x_handle, (n, hid), dtype)
            c = T.match_buffer(c_handle, (n, n_exp), dtype)
            out = T.match_buffer(out_handle, (n, hid), dtype)
            body(x, c, w_up, w_down, out, None, n)

    return func.with_attrs({EXPERTS_ATTR: kernel.attrs(), "op_pattern": _OP_PATTERN_OPAQUE,
                            SCHEDULED_ATTR: True, RULE_ATTR: "experts"})


@module_pass("tvm_distx.SparseExperts")
class SparseExperts:
    """Every experts kernel (:func:`experts_definition`) replaced by :func:`sparse_experts`.

    Run on a rank-local module (after the local view): each kernel then has
    its rank's shapes, and its implementation is built for them.
    """

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        def implement(name: str, func: tirx.PrimFunc) -> tirx.PrimFunc:
            kernel = ExpertsKernel.of(func)
            logger.info("experts kernel %s: sparse dispatch over %d local experts "
                        "(H=%d, I=%d)", name, kernel.experts, kernel.hidden,
                        kernel.intermediate)
            return sparse_experts(kernel)

        return implement_definitions(mod, EXPERTS_ATTR, implement)

