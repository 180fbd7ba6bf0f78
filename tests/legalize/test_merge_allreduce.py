"""MergeAllReduces: partial sums combined linearly share one all-reduce.

``linear_in`` is checked on kernels written in TVMScript; the rewrite on TVM's
own local view of a small module (Before) against the module written out
(Expected); the numbers on 2 MPI ranks against numpy.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

import tvm_distx as td
from tvm_distx.legalize.linearity import linear_in
from tvm_distx.legalize.local_view import _tvm_local_view
from tvm_distx.legalize.merge_allreduce import MergeAllReduces
from tvm_distx.compiler.pipeline import run_stages


# ------------------------------------------------------------------- linear_in
@T.prim_func(private=True, s_tir=True)
def _axpy(a: T.Buffer((4,), "float32"), b: T.Buffer((4,), "float32"),
          c: T.Buffer((4,), "float32"), out: T.Buffer((4,), "float32")):
    for i in range(4):
        with T.sblock("out"):
            vi = T.axis.remap("S", [i])
            out[vi] = c[vi] * a[vi] + b[vi] / T.float32(2.0)


@T.prim_func(private=True, s_tir=True)
def _square(a: T.Buffer((4,), "float32"), out: T.Buffer((4,), "float32")):
    for i in range(4):
        with T.sblock("out"):
            vi = T.axis.remap("S", [i])
            out[vi] = a[vi] * a[vi]


@T.prim_func(private=True, s_tir=True)
def _exp(a: T.Buffer((4,), "float32"), out: T.Buffer((4,), "float32")):
    for i in range(4):
        with T.sblock("out"):
            vi = T.axis.remap("S", [i])
            out[vi] = T.exp(a[vi])


@T.prim_func(private=True, s_tir=True)
def _row_sum(a: T.Buffer((4, 3), "float32"), out: T.Buffer((4,), "float32")):
    for i, k in T.grid(4, 3):
        with T.sblock("out"):
            vi, vk = T.axis.remap("SR", [i, k])
            with T.init():
                out[vi] = T.float32(0.0)
            out[vi] = out[vi] + a[vi, vk]


@T.prim_func(private=True, s_tir=True)
def _to_int(a: T.Buffer((4,), "float32"), out: T.Buffer((4,), "int32")):
    for i in range(4):
        with T.sblock("out"):
            vi = T.axis.remap("S", [i])
            out[vi] = T.Cast("int32", a[vi])


@T.prim_func(private=True, s_tir=True)
def _gather(a: T.Buffer((4,), "int64"), table: T.Buffer((8,), "float32"),
            out: T.Buffer((4,), "float32")):
    for i in range(4):
        with T.sblock("out"):
            vi = T.axis.remap("S", [i])
            out[vi] = table[a[vi]]


@pytest.mark.parametrize("func, summed, inputs, linear", [
    (_axpy, {0, 1}, 3, True),     # c * a + b / 2: every term reads one summed operand once
    (_axpy, {0}, 3, False),       # ... but b, held whole, would be added once per rank
    (_axpy, {0, 2}, 3, False),    # c * a is of degree two in {a, c}
    (_square, {0}, 1, False),
    (_exp, {0}, 1, False),
    (_row_sum, {0}, 1, True),     # a reduction: init 0, then out + a
    (_to_int, {0}, 1, False),     # a cast to an integer truncates
    (_gather, {0}, 2, False),     # a summed value used as an index
])
def test_linear_in(func, summed, inputs, linear):
    assert linear_in(func, frozenset(summed), inputs) is linear


# ------------------------------------------------------------------- the rewrite
@I.ir_module
class SharedAndRouted:
    """Two row-parallel products, one scaled by a per-row gate, then added."""

    I.module_attrs({"device_num": 2})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(a: R.Tensor((4, 8), "float32"), b: R.Tensor((4, 8), "float32"),
             w1: R.Tensor((8, 6), "float32"), w2: R.Tensor((8, 6), "float32"),
             g: R.Tensor((4, 1), "float32")) -> R.Tensor((4, 6), "float32"):
        w1s = R.dist.annotate_sharding(w1, device_mesh="mesh[0]", placement="S[0]")
        w2s = R.dist.annotate_sharding(w2, device_mesh="mesh[0]", placement="S[0]")
        with R.dataflow():
            y1 = R.matmul(a, w1s)
            y2 = R.matmul(b, w2s)
            y3 = R.multiply(g, y2)
            y = R.add(y1, y3)
            R.output(y)
        return y


@I.ir_module
class OneProduct:
    """A row-parallel product scaled and then added to a value every rank holds whole."""

    I.module_attrs({"device_num": 2})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(a: R.Tensor((4, 8), "float32"), w1: R.Tensor((8, 6), "float32"),
             g: R.Tensor((4, 1), "float32"), c: R.Tensor((4, 6), "float32")
             ) -> R.Tensor((4, 6), "float32"):
        w1s = R.dist.annotate_sharding(w1, device_mesh="mesh[0]", placement="S[0]")
        with R.dataflow():
            y1 = R.matmul(a, w1s)
            y2 = R.multiply(g, y1)
            y = R.add(y2, c)
            R.output(y)
        return y


def _tvm_view(mod):
    """TVM's own local view of ``mod`` (before any merge)."""
    return _tvm_local_view(run_stages(mod)["propagate_sharding"])


@I.ir_module
class Expected:
    """SharedAndRouted after the merge: the sum of both addends, one all-reduce."""

    I.module_attrs({"device_num": 2})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})
    @T.prim_func(private=True, s_tir=True)
    def add(y1: T.Buffer((T.int64(4), T.int64(6)), "float32"), y3: T.Buffer((T.int64(4), T.int64(6)), "float32"), T_add: T.Buffer((T.int64(4), T.int64(6)), "float32")):
        T.func_attr({"tirx.noalias": True})
        for ax0, ax1 in T.grid(T.int64(4), T.int64(6)):
            with T.sblock("T_add"):
                v_ax0, v_ax1 = T.axis.remap("SS", [ax0, ax1])
                T.reads(y1[v_ax0, v_ax1], y3[v_ax0, v_ax1])
                T.writes(T_add[v_ax0, v_ax1])
                T_add[v_ax0, v_ax1] = y1[v_ax0, v_ax1] + y3[v_ax0, v_ax1]

    @T.prim_func(private=True, s_tir=True)
    def matmul(a: T.Buffer((T.int64(4), T.int64(8)), "float32"), w1s: T.Buffer((T.int64(8), T.int64(6)), "float32"), matmul: T.Buffer((T.int64(4), T.int64(6)), "float32")):
        T.func_attr({"tirx.noalias": True})
        for i0, i1, k in T.grid(T.int64(4), T.int64(6), T.int64(8)):
            with T.sblock("matmul"):
                v_i0, v_i1, v_k = T.axis.remap("SSR", [i0, i1, k])
                T.reads(a[v_i0, v_k], w1s[v_k, v_i1])
                T.writes(matmul[v_i0, v_i1])
                with T.init():
                    matmul[v_i0, v_i1] = T.float32(0.0)
                matmul[v_i0, v_i1] = matmul[v_i0, v_i1] + a[v_i0, v_k] * w1s[v_k, v_i1]

    @T.prim_func(private=True, s_tir=True)
    def matmul1(a: T.Buffer((T.int64(4), T.int64(4)), "float32"), w1s: T.Buffer((T.int64(4), T.int64(6)), "float32"), matmul: T.Buffer((T.int64(4), T.int64(6)), "float32")):
        T.func_attr({"tirx.noalias": True})
        for i0, i1, k in T.grid(T.int64(4), T.int64(6), T.int64(4)):
            with T.sblock("matmul"):
                v_i0, v_i1, v_k = T.axis.remap("SSR", [i0, i1, k])
                T.reads(a[v_i0, v_k], w1s[v_k, v_i1])
                T.writes(matmul[v_i0, v_i1])
                with T.init():
                    matmul[v_i0, v_i1] = T.float32(0.0)
                matmul[v_i0, v_i1] = matmul[v_i0, v_i1] + a[v_i0, v_k] * w1s[v_k, v_i1]

    @T.prim_func(private=True, s_tir=True)
    def multiply(g: T.Buffer((T.int64(4), T.int64(1)), "float32"), y2: T.Buffer((T.int64(4), T.int64(6)), "float32"), T_multiply: T.Buffer((T.int64(4), T.int64(6)), "float32")):
        T.func_attr({"tirx.noalias": True})
        for ax0, ax1 in T.grid(T.int64(4), T.int64(6)):
            with T.sblock("T_multiply"):
                v_ax0, v_ax1 = T.axis.remap("SS", [ax0, ax1])
                T.reads(g[v_ax0, T.int64(0)], y2[v_ax0, v_ax1])
                T.writes(T_multiply[v_ax0, v_ax1])
                T_multiply[v_ax0, v_ax1] = g[v_ax0, T.int64(0)] * y2[v_ax0, v_ax1]

    @R.function
    def main(a: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[1]"), b: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[1]"), w1: R.dist.DTensor((8, 6), "float32", "mesh[0]", "S[0]"), w2: R.dist.DTensor((8, 6), "float32", "mesh[0]", "S[0]"), g: R.dist.DTensor((4, 1), "float32", "mesh[0]", "R")) -> R.dist.DTensor((4, 6), "float32", "mesh[0]", "R"):
        cls = Expected
        with R.dataflow():
            lv: R.dist.DTensor((4, 6), "float32", "mesh[0]", "R") = R.dist.call_tir_local_view(cls.matmul1, (a, w1), out_ty=R.dist.DTensor((4, 6), "float32", "mesh[0]", "R"))
            lv1: R.dist.DTensor((4, 6), "float32", "mesh[0]", "R") = R.dist.call_tir_local_view(cls.matmul1, (b, w2), out_ty=R.dist.DTensor((4, 6), "float32", "mesh[0]", "R"))
            y3_addend: R.dist.DTensor((4, 6), "float32", "mesh[0]", "R") = R.dist.call_tir_local_view(cls.multiply, (g, lv1), out_ty=R.dist.DTensor((4, 6), "float32", "mesh[0]", "R"))
            y_addend: R.dist.DTensor((4, 6), "float32", "mesh[0]", "R") = R.dist.call_tir_local_view(cls.add, (lv, y3_addend), out_ty=R.dist.DTensor((4, 6), "float32", "mesh[0]", "R"))
            y: R.dist.DTensor((4, 6), "float32", "mesh[0]", "R") = R.ccl.allreduce(y_addend, op_type="sum", in_group=False)
            R.output(y)
        return y




def test_two_partial_sums_combined_linearly_share_one_allreduce():
    tvm.ir.assert_structural_equal(MergeAllReduces()(_tvm_view(SharedAndRouted)), Expected)


def test_a_chain_that_meets_no_other_allreduce_is_left_as_written():
    before = _tvm_view(OneProduct)
    tvm.ir.assert_structural_equal(MergeAllReduces()(before), before)


def test_the_comm_report_reads_the_merged_allreduce():
    rows = td.comm_report(run_stages(SharedAndRouted)["local_view"]).rows
    assert [r.collective for r in rows] == ["all_reduce"]
    assert rows[0].bytes_per_rank > 0


def test_merged_allreduce_runs_equal_to_numpy_on_two_mpi_ranks():
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((2, 4, 8), dtype=np.float32)
    w1, w2 = rng.standard_normal((2, 8, 6), dtype=np.float32)
    g = rng.standard_normal((4, 1), dtype=np.float32)
    got = td.compile(SharedAndRouted).run(a, b, w1, w2, g, backend="mpi")
    np.testing.assert_allclose(got, a @ w1 + g * (b @ w2), rtol=1e-5, atol=1e-5)
