"""Our LowerGlobalViewToLocalView: kernels on a dimension split by several mesh axes.

TVM's local view gets the shard shapes of such kernels wrong. ``split_once``
runs each of them with every dimension split by its first mesh axis only and
moves the values in and out with redistributes; the chain of kernels between
them keeps the single split. Checked structurally, then on emulated ranks.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

import tvm_distx as td
from tvm_distx.legalize.local_view import split_once

MESH = R.dist.device_mesh((2, 2), I.Range(0, 4))


@I.ir_module
class KernelsOnNestedSplits:
    """relu then matmul on rows split by both axes of a 2x2 mesh."""

    I.module_global_infos({"mesh": [MESH]})

    @T.prim_func(private=True, s_tir=True)
    def relu(x: T.Buffer((T.int64(8), T.int64(4)), "float32"),
             y: T.Buffer((T.int64(8), T.int64(4)), "float32")):
        for i, j in T.grid(T.int64(8), T.int64(4)):
            with T.sblock("relu"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = T.max(x[vi, vj], T.float32(0.0))

    @T.prim_func(private=True, s_tir=True)
    def matmul(a: T.Buffer((T.int64(8), T.int64(4)), "float32"),
               w: T.Buffer((T.int64(4), T.int64(6)), "float32"),
               y: T.Buffer((T.int64(8), T.int64(6)), "float32")):
        for i, j, k in T.grid(T.int64(8), T.int64(6), T.int64(4)):
            with T.sblock("matmul"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                with T.init():
                    y[vi, vj] = T.float32(0.0)
                y[vi, vj] = y[vi, vj] + a[vi, vk] * w[vk, vj]

    @R.function
    def main(x: R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]S[0]"),
             w: R.dist.DTensor((4, 6), "float32", "mesh[0]", "RR"),
             ) -> R.dist.DTensor((8, 6), "float32", "mesh[0]", "S[0]S[0]"):
        cls = KernelsOnNestedSplits
        with R.dataflow():
            b = R.dist.call_tir(cls.relu, (x,),
                                out_ty=R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]S[0]"))
            c = R.dist.call_tir(cls.matmul, (b, w),
                                out_ty=R.dist.DTensor((8, 6), "float32", "mesh[0]", "S[0]S[0]"))
            R.output(c)
        return c


@I.ir_module
class KernelsOnSingleSplits:
    """One all-gather along mesh axis 1 in, the kernels on "S[0]R", a local slice out."""

    I.module_global_infos({"mesh": [MESH]})

    @T.prim_func(private=True, s_tir=True)
    def relu(x: T.Buffer((T.int64(8), T.int64(4)), "float32"),
             y: T.Buffer((T.int64(8), T.int64(4)), "float32")):
        for i, j in T.grid(T.int64(8), T.int64(4)):
            with T.sblock("relu"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = T.max(x[vi, vj], T.float32(0.0))

    @T.prim_func(private=True, s_tir=True)
    def matmul(a: T.Buffer((T.int64(8), T.int64(4)), "float32"),
               w: T.Buffer((T.int64(4), T.int64(6)), "float32"),
               y: T.Buffer((T.int64(8), T.int64(6)), "float32")):
        for i, j, k in T.grid(T.int64(8), T.int64(6), T.int64(4)):
            with T.sblock("matmul"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                with T.init():
                    y[vi, vj] = T.float32(0.0)
                y[vi, vj] = y[vi, vj] + a[vi, vk] * w[vk, vj]

    @R.function
    def main(x: R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]S[0]"),
             w: R.dist.DTensor((4, 6), "float32", "mesh[0]", "RR"),
             ) -> R.dist.DTensor((8, 6), "float32", "mesh[0]", "S[0]S[0]"):
        cls = KernelsOnSingleSplits
        with R.dataflow():
            x_split_once = R.dist.redistribute(x, device_mesh="mesh[0]", placement="S[0]R")
            b_split_once = R.dist.call_tir(
                cls.relu, (x_split_once,),
                out_ty=R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]R"))
            c_split_once = R.dist.call_tir(
                cls.matmul, (b_split_once, w),
                out_ty=R.dist.DTensor((8, 6), "float32", "mesh[0]", "S[0]R"))
            c = R.dist.redistribute(c_split_once, device_mesh="mesh[0]", placement="S[0]S[0]")
            R.output(c)
        return c


def test_kernels_on_a_nested_split_run_on_the_outer_split_only():
    tvm.ir.assert_structural_equal(split_once(KernelsOnNestedSplits), KernelsOnSingleSplits)


def test_kernels_on_single_splits_are_left_alone():
    tvm.ir.assert_structural_equal(split_once(KernelsOnSingleSplits), KernelsOnSingleSplits)


@pytest.mark.parametrize("placement", ["S[0]S[0]", "S[1]S[1]", "S[1]S[0]"])
def test_a_model_on_a_nested_split_equals_numpy(placement):
    """A sum over a dimension split by both axes all-reduces over the outer axis only."""
    bb = tvm.relax.BlockBuilder()
    x = tvm.relax.Var("x", tvm.relax.TensorType((8, 8), "float32"))
    w = tvm.relax.Var("w", tvm.relax.TensorType((8, 8), "float32"))
    mesh = tvm.relax.distributed.DeviceMesh([2, 2], tvm.ir.Range(0, 4))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            a = bb.emit(tvm.relax.op.distributed.annotate_sharding(
                x, mesh, tvm.relax.distributed.Placement.from_text(placement)))
            h = bb.emit(tvm.relax.op.matmul(tvm.relax.op.nn.relu(a), w))
            out = bb.emit_output(tvm.relax.op.sum(h, axis=[1]))
        bb.emit_func_output(out)
    mod = bb.get()
    mod.update_global_info("mesh", [mesh])
    exe = td.compile(mod, target="x86")
    rng = np.random.default_rng(7)
    xs, ws = rng.standard_normal((2, 8, 8), dtype="float32")
    np.testing.assert_allclose(exe.run(xs, ws, backend="emulate"),
                               (np.maximum(xs, 0) @ ws).sum(axis=1), rtol=1e-5, atol=1e-5)



@I.ir_module
class SplitOfANestedSplit:
    I.module_attrs({"device_num": 4})
    I.module_global_infos({"mesh": [MESH]})

    @R.function
    def main(x: R.Tensor((8, 8), "float32")) -> R.Tensor((8, 4), "float32"):
        with R.dataflow():
            a = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="S[0]S[0]")
            halves = R.split(a, 2, axis=1)
            y = R.add(halves[0], halves[1])
            R.output(y)
        return y


def test_a_kernel_with_several_results_on_a_nested_split_equals_numpy():
    """split legalizes to one kernel with a tuple result: each field moves back."""
    x = np.random.default_rng(8).standard_normal((8, 8), dtype="float32")
    got = td.compile(SplitOfANestedSplit, target="x86", schedule=False).run(x, backend="emulate")
    np.testing.assert_array_equal(got, x[:, :4] + x[:, 4:])
