"""Partial sums: the all-reduce TVM's local view inserts, read back, planned and folded.

A row-parallel matmul (its summed dimension split) leaves a partial sum, which
TVM's local view completes with an ``R.ccl.allreduce`` typed replicated. When
the only use of that all-reduce is a redistribute that splits the sum on the
same mesh axis, LegalizeRedistribute writes one reduce-scatter instead.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tvm_distx.legalize import LegalizeRedistribute, LowerDistIR
from tvm_distx.layout import DeviceMesh as Mesh
from tvm_distx.layout import Placement, TensorSharding
from tvm_distx.legalize.partial_sums import PartialSum, fold_targets, plan_completion
from tvm_distx.legalize.planner import Collective


# x (4, 8) split on its columns and w (8, 8) on its rows: each rank's matmul1 is
# an addend of x @ w, completed by the all-reduce; the relu wants rows split.
@I.ir_module
class Before:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @T.prim_func(private=True, s_tir=True)
    def matmul1(a: T.Buffer((T.int64(4), T.int64(4)), "float32"),
                b: T.Buffer((T.int64(4), T.int64(8)), "float32"),
                c: T.Buffer((T.int64(4), T.int64(8)), "float32")):
        for i, j, k in T.grid(T.int64(4), T.int64(8), T.int64(4)):
            with T.sblock("matmul"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                with T.init():
                    c[vi, vj] = T.float32(0.0)
                c[vi, vj] = c[vi, vj] + a[vi, vk] * b[vk, vj]

    @T.prim_func(private=True, s_tir=True)
    def relu1(z: T.Buffer((T.int64(2), T.int64(8)), "float32"),
              out: T.Buffer((T.int64(2), T.int64(8)), "float32")):
        for i, j in T.grid(T.int64(2), T.int64(8)):
            with T.sblock("relu"):
                vi, vj = T.axis.remap("SS", [i, j])
                out[vi, vj] = T.max(z[vi, vj], T.float32(0.0))

    @R.function
    def main(x: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[1]"),
             w: R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]")
             ) -> R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[0]"):
        cls = Before
        with R.dataflow():
            lv = R.dist.call_tir_local_view(cls.matmul1, (x, w),
                                            out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"))
            y = R.ccl.allreduce(lv, op_type="sum", in_group=False)
            z = R.dist.redistribute(y, device_mesh="mesh[0]", placement="S[0]")
            o = R.dist.call_tir_local_view(cls.relu1, (z,),
                                           out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[0]"))
            R.output(o)
        return o


@I.ir_module
class Expected:
    """After LegalizeRedistribute and LowerDistIR: what every rank runs."""

    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @T.prim_func(private=True, s_tir=True)
    def matmul1(a: T.Buffer((T.int64(4), T.int64(4)), "float32"),
                b: T.Buffer((T.int64(4), T.int64(8)), "float32"),
                c: T.Buffer((T.int64(4), T.int64(8)), "float32")):
        for i, j, k in T.grid(T.int64(4), T.int64(8), T.int64(4)):
            with T.sblock("matmul"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                with T.init():
                    c[vi, vj] = T.float32(0.0)
                c[vi, vj] = c[vi, vj] + a[vi, vk] * b[vk, vj]

    @T.prim_func(private=True, s_tir=True)
    def relu1(z: T.Buffer((T.int64(2), T.int64(8)), "float32"),
              out: T.Buffer((T.int64(2), T.int64(8)), "float32")):
        for i, j in T.grid(T.int64(2), T.int64(8)):
            with T.sblock("relu"):
                vi, vj = T.axis.remap("SS", [i, j])
                out[vi, vj] = T.max(z[vi, vj], T.float32(0.0))

    @R.function
    def main(x: R.Tensor((4, 4), "float32"), w: R.Tensor((4, 8), "float32")
             ) -> R.Tensor((2, 8), "float32"):
        cls = Expected
        with R.dataflow():
            lv = R.call_tir(cls.matmul1, (x, w), out_ty=R.Tensor((4, 8), "float32"))
            # kind sum (0); the group along mesh axis 0 of the 2-device mesh
            # (ndim 1, shape 2, first device 0, axis 0); rows split (dim 0)
            z = R.call_dps_packed("tvm_distx.ccl.reducescatter",
                                  (lv, R.prim_value(0), R.shape([1, 2, 0, 0]), R.shape([0])),
                                  out_ty=R.Tensor((2, 8), "float32"))
            o = R.call_tir(cls.relu1, (z,), out_ty=R.Tensor((2, 8), "float32"))
            R.output(o)
        return o


def lowered(mod: tvm.IRModule) -> tvm.IRModule:
    return LowerDistIR()(LegalizeRedistribute()(mod))


def test_allreduce_then_split_becomes_one_reduce_scatter():
    assert list(fold_targets(Before["main"]).values())[0].name == "z"
    tvm.ir.assert_structural_equal(lowered(Before), Expected)


@I.ir_module
class SharedBefore:
    """The same partial sum, but the completed sum is also returned: no fold."""

    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @T.prim_func(private=True, s_tir=True)
    def matmul1(a: T.Buffer((T.int64(4), T.int64(4)), "float32"),
                b: T.Buffer((T.int64(4), T.int64(8)), "float32"),
                c: T.Buffer((T.int64(4), T.int64(8)), "float32")):
        for i, j, k in T.grid(T.int64(4), T.int64(8), T.int64(4)):
            with T.sblock("matmul"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                with T.init():
                    c[vi, vj] = T.float32(0.0)
                c[vi, vj] = c[vi, vj] + a[vi, vk] * b[vk, vj]

    @R.function
    def main(x: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[1]"),
             w: R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]")):
        cls = SharedBefore
        with R.dataflow():
            lv = R.dist.call_tir_local_view(cls.matmul1, (x, w),
                                            out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"))
            y = R.ccl.allreduce(lv, op_type="sum", in_group=False)
            z = R.dist.redistribute(y, device_mesh="mesh[0]", placement="S[0]")
            R.output(y, z)
        return (y, z)


@I.ir_module
class SharedExpected:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @T.prim_func(private=True, s_tir=True)
    def matmul1(a: T.Buffer((T.int64(4), T.int64(4)), "float32"),
                b: T.Buffer((T.int64(4), T.int64(8)), "float32"),
                c: T.Buffer((T.int64(4), T.int64(8)), "float32")):
        for i, j, k in T.grid(T.int64(4), T.int64(8), T.int64(4)):
            with T.sblock("matmul"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                with T.init():
                    c[vi, vj] = T.float32(0.0)
                c[vi, vj] = c[vi, vj] + a[vi, vk] * b[vk, vj]

    @R.function
    def main(x: R.Tensor((4, 4), "float32"), w: R.Tensor((4, 8), "float32")):
        cls = SharedExpected
        with R.dataflow():
            lv = R.call_tir(cls.matmul1, (x, w), out_ty=R.Tensor((4, 8), "float32"))
            y = R.call_dps_packed("tvm_distx.ccl.allreduce",
                                  (lv, R.prim_value(0), R.shape([1, 2, 0, 0])),
                                  out_ty=R.Tensor((4, 8), "float32"))
            z_local_slice = R.call_dps_packed("tvm_distx.ccl.local_slice",
                                              (y, R.shape([1, 2, 0, 0]), R.shape([0])),
                                              out_ty=R.Tensor((2, 8), "float32"))
            z = z_local_slice
            R.output(y, z)
        return (y, z)


def test_a_completed_sum_used_elsewhere_keeps_its_allreduce():
    assert not fold_targets(SharedBefore["main"])
    tvm.ir.assert_structural_equal(lowered(SharedBefore), SharedExpected)


def sharding(mesh_shape, text):
    n = int(np.prod(mesh_shape))
    return TensorSharding(Mesh(tuple(mesh_shape), range(0, n)), Placement.parse(text))


@pytest.mark.parametrize("p", [2, 4])
def test_completion_bytes_reduce_scatter_is_half_an_allreduce(p):
    shape, size = (8, 16), 8 * 16 * 4
    summed = PartialSum(None, sharding((p,), "P"))
    assert summed.completed == sharding((p,), "R")
    to_r = plan_completion(summed, None, shape, "float32")
    to_s = plan_completion(summed, sharding((p,), "S[1]"), shape, "float32")
    assert [(s.collective, s.tensor_axes) for s in to_r.steps] == [(Collective.ALL_REDUCE, ())]
    assert [(s.collective, s.tensor_axes) for s in to_s.steps] == [
        (Collective.REDUCE_SCATTER, (1,))]
    assert to_r.bytes_received == 2 * size * (p - 1) // p
    assert to_s.bytes_received == size * (p - 1) // p


def test_completion_on_a_2d_mesh_scatters_the_summed_axis():
    # data parallel on axis 0 (rows), the sum over axis 1: "S[0]P" -> "S[0]S[1]"
    summed = PartialSum(None, sharding((2, 2), "S[0]P"))
    plan = plan_completion(summed, sharding((2, 2), "S[0]S[1]"), (8, 16), "float32")
    assert [(s.mesh_axis, s.collective, str(s.dst.placement)) for s in plan.steps] == [
        (1, Collective.REDUCE_SCATTER, "S[0]S[1]")]
    assert plan.bytes_received == (4 * 16 * 4) // 2


# ---------------------------------------------------------------------- propagation
@I.ir_module
class RowParallel:
    """A row-parallel matmul, a bias, then a residual add with rows split."""

    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 8), "float32"),
             b: R.Tensor((8,), "float32"), r: R.Tensor((4, 8), "float32")):
        with R.dataflow():
            xs = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="S[1]")
            ws = R.dist.annotate_sharding(w, device_mesh="mesh[0]", placement="S[0]")
            rs = R.dist.annotate_sharding(r, device_mesh="mesh[0]", placement="S[0]")
            y = R.matmul(xs, ws)
            z = R.add(y, b)
            o = R.add(rs, z)
            R.output(o)
        return o


@I.ir_module
class RowParallelPropagated:
    """The bias waits for its use: the partial sum y is split before it (a reduce-scatter)."""

    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[1]"),
             w: R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]"),
             b: R.dist.DTensor((8,), "float32", "mesh[0]", "R"),
             r: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[0]")
             ) -> R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[0]"):
        with R.dataflow():
            y = R.matmul(x, w, out_dtype=None)
            y_redist = R.dist.redistribute(y, device_mesh="mesh[0]", placement="S[0]")
            z = R.add(y_redist, b)
            o = R.add(r, z)
            R.output(o)
        return o


def test_propagation_lets_the_use_of_a_partial_sum_choose_its_layout():
    from tvm_distx.passes import PropagateSharding

    tvm.ir.assert_structural_equal(PropagateSharding()(RowParallel), RowParallelPropagated)


def test_explain_shows_the_partial_sum_and_how_it_is_completed():
    import tvm_distx as td

    report = td.explain(RowParallel)
    y = report.row("main", "y")
    assert (y.placement, y.local_shape) == ("P", (4, 8))
    assert "partial sum (P) on mesh axis 0" in y.reason
    assert report.row("main", "z").placement == "S[0]"
    assert report.row("main", "o").placement == "S[0]"


@I.ir_module
class RowParallelReplicatedUse:
    """The same, but the residual is not split: nothing asks for a split of the sum."""

    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 8), "float32"),
             b: R.Tensor((8,), "float32"), r: R.Tensor((4, 8), "float32")):
        with R.dataflow():
            xs = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="S[1]")
            ws = R.dist.annotate_sharding(w, device_mesh="mesh[0]", placement="S[0]")
            y = R.matmul(xs, ws)
            z = R.add(y, b)
            o = R.add(r, z)
            R.output(o)
        return o


def test_a_partial_sum_no_use_splits_is_completed_replicated():
    import tvm_distx as td

    report = td.explain(RowParallelReplicatedUse)
    assert report.row("main", "y").placement == "P"
    # the deferred bias add is decided from its operands once nothing else can decide it
    assert report.row("main", "z").placement == "R"
    assert report.row("main", "z").reason == "result of relax.add at 'z'"
    assert report.row("main", "o").placement == "R"
