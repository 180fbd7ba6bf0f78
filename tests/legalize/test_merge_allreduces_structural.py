"""MergeAllReduces alone, in TVM's form: a local-view Before module, the Expected one.

Each Before is what TVM's local view writes for row-parallel products on a mesh
of 2: a kernel on local shards (``call_tir_local_view``) whose result is an
addend of the product, then its ``R.ccl.allreduce``. Each Expected is written
by hand: partial sums combined only linearly run the combining kernels on the
addends, and one all-reduce completes the combination; anything else is left
exactly as written.
"""

from __future__ import annotations

import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tvm_distx.legalize import MergeAllReduces


def test_two_allreduces_added_are_merged_into_one():
    """allreduce(a) + allreduce(b) -> allreduce(a + b): the add runs on the addends."""

    @I.ir_module
    class Before:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @T.prim_func(private=True, s_tir=True)
        def matmul(a: T.Buffer((T.int64(4), T.int64(4)), "float32"),
                   b: T.Buffer((T.int64(4), T.int64(8)), "float32"),
                   c: T.Buffer((T.int64(4), T.int64(8)), "float32")):
            for i, j, k in T.grid(T.int64(4), T.int64(8), T.int64(4)):
                with T.sblock("matmul"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    with T.init():
                        c[vi, vj] = T.float32(0.0)
                    c[vi, vj] = c[vi, vj] + a[vi, vk] * b[vk, vj]

        @T.prim_func(private=True, s_tir=True)
        def add(a: T.Buffer((T.int64(4), T.int64(8)), "float32"),
                b: T.Buffer((T.int64(4), T.int64(8)), "float32"),
                c: T.Buffer((T.int64(4), T.int64(8)), "float32")):
            for i, j in T.grid(T.int64(4), T.int64(8)):
                with T.sblock("add"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    c[vi, vj] = a[vi, vj] + b[vi, vj]

        @R.function
        def main(x1: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[1]"),
                 w1: R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]"),
                 x2: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[1]"),
                 w2: R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]")
                 ) -> R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"):
            cls = Before
            with R.dataflow():
                p1 = R.dist.call_tir_local_view(
                    cls.matmul, (x1, w1), out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"))
                y1 = R.ccl.allreduce(p1, op_type="sum", in_group=False)
                p2 = R.dist.call_tir_local_view(
                    cls.matmul, (x2, w2), out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"))
                y2 = R.ccl.allreduce(p2, op_type="sum", in_group=False)
                y = R.dist.call_tir_local_view(
                    cls.add, (y1, y2), out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"))
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @T.prim_func(private=True, s_tir=True)
        def matmul(a: T.Buffer((T.int64(4), T.int64(4)), "float32"),
                   b: T.Buffer((T.int64(4), T.int64(8)), "float32"),
                   c: T.Buffer((T.int64(4), T.int64(8)), "float32")):
            for i, j, k in T.grid(T.int64(4), T.int64(8), T.int64(4)):
                with T.sblock("matmul"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    with T.init():
                        c[vi, vj] = T.float32(0.0)
                    c[vi, vj] = c[vi, vj] + a[vi, vk] * b[vk, vj]

        @T.prim_func(private=True, s_tir=True)
        def add(a: T.Buffer((T.int64(4), T.int64(8)), "float32"),
                b: T.Buffer((T.int64(4), T.int64(8)), "float32"),
                c: T.Buffer((T.int64(4), T.int64(8)), "float32")):
            for i, j in T.grid(T.int64(4), T.int64(8)):
                with T.sblock("add"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    c[vi, vj] = a[vi, vj] + b[vi, vj]

        @R.function
        def main(x1: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[1]"),
                 w1: R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]"),
                 x2: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[1]"),
                 w2: R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]")
                 ) -> R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"):
            cls = Expected
            with R.dataflow():
                p1 = R.dist.call_tir_local_view(
                    cls.matmul, (x1, w1), out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"))
                p2 = R.dist.call_tir_local_view(
                    cls.matmul, (x2, w2), out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"))
                y_addend = R.dist.call_tir_local_view(
                    cls.add, (p1, p2), out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"))
                y = R.ccl.allreduce(y_addend, op_type="sum", in_group=False)
                R.output(y)
            return y

    tvm.ir.assert_structural_equal(MergeAllReduces()(Before), Expected)


def test_a_merge_through_a_scale_by_a_replicated_value():
    """allreduce(a) + g * allreduce(b), g whole on every rank: one all-reduce of a + g * b."""

    @I.ir_module
    class Before:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @T.prim_func(private=True, s_tir=True)
        def matmul(a: T.Buffer((T.int64(4), T.int64(4)), "float32"),
                   b: T.Buffer((T.int64(4), T.int64(8)), "float32"),
                   c: T.Buffer((T.int64(4), T.int64(8)), "float32")):
            for i, j, k in T.grid(T.int64(4), T.int64(8), T.int64(4)):
                with T.sblock("matmul"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    with T.init():
                        c[vi, vj] = T.float32(0.0)
                    c[vi, vj] = c[vi, vj] + a[vi, vk] * b[vk, vj]

        @T.prim_func(private=True, s_tir=True)
        def add(a: T.Buffer((T.int64(4), T.int64(8)), "float32"),
                b: T.Buffer((T.int64(4), T.int64(8)), "float32"),
                c: T.Buffer((T.int64(4), T.int64(8)), "float32")):
            for i, j in T.grid(T.int64(4), T.int64(8)):
                with T.sblock("add"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    c[vi, vj] = a[vi, vj] + b[vi, vj]

        @T.prim_func(private=True, s_tir=True)
        def scale(g: T.Buffer((T.int64(4), T.int64(1)), "float32"),
                  a: T.Buffer((T.int64(4), T.int64(8)), "float32"),
                  c: T.Buffer((T.int64(4), T.int64(8)), "float32")):
            for i, j in T.grid(T.int64(4), T.int64(8)):
                with T.sblock("scale"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    c[vi, vj] = g[vi, T.int64(0)] * a[vi, vj]

        @R.function
        def main(x1: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[1]"),
                 w1: R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]"),
                 x2: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[1]"),
                 w2: R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]"),
                 g: R.dist.DTensor((4, 1), "float32", "mesh[0]", "R")
                 ) -> R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"):
            cls = Before
            with R.dataflow():
                p1 = R.dist.call_tir_local_view(
                    cls.matmul, (x1, w1), out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"))
                y1 = R.ccl.allreduce(p1, op_type="sum", in_group=False)
                p2 = R.dist.call_tir_local_view(
                    cls.matmul, (x2, w2), out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"))
                y2 = R.ccl.allreduce(p2, op_type="sum", in_group=False)
                s2 = R.dist.call_tir_local_view(
                    cls.scale, (g, y2), out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"))
                y = R.dist.call_tir_local_view(
                    cls.add, (y1, s2), out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"))
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @T.prim_func(private=True, s_tir=True)
        def matmul(a: T.Buffer((T.int64(4), T.int64(4)), "float32"),
                   b: T.Buffer((T.int64(4), T.int64(8)), "float32"),
                   c: T.Buffer((T.int64(4), T.int64(8)), "float32")):
            for i, j, k in T.grid(T.int64(4), T.int64(8), T.int64(4)):
                with T.sblock("matmul"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    with T.init():
                        c[vi, vj] = T.float32(0.0)
                    c[vi, vj] = c[vi, vj] + a[vi, vk] * b[vk, vj]

        @T.prim_func(private=True, s_tir=True)
        def add(a: T.Buffer((T.int64(4), T.int64(8)), "float32"),
                b: T.Buffer((T.int64(4), T.int64(8)), "float32"),
                c: T.Buffer((T.int64(4), T.int64(8)), "float32")):
            for i, j in T.grid(T.int64(4), T.int64(8)):
                with T.sblock("add"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    c[vi, vj] = a[vi, vj] + b[vi, vj]

        @T.prim_func(private=True, s_tir=True)
        def scale(g: T.Buffer((T.int64(4), T.int64(1)), "float32"),
                  a: T.Buffer((T.int64(4), T.int64(8)), "float32"),
                  c: T.Buffer((T.int64(4), T.int64(8)), "float32")):
            for i, j in T.grid(T.int64(4), T.int64(8)):
                with T.sblock("scale"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    c[vi, vj] = g[vi, T.int64(0)] * a[vi, vj]

        @R.function
        def main(x1: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[1]"),
                 w1: R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]"),
                 x2: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[1]"),
                 w2: R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]"),
                 g: R.dist.DTensor((4, 1), "float32", "mesh[0]", "R")
                 ) -> R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"):
            cls = Expected
            with R.dataflow():
                p1 = R.dist.call_tir_local_view(
                    cls.matmul, (x1, w1), out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"))
                p2 = R.dist.call_tir_local_view(
                    cls.matmul, (x2, w2), out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"))
                s2_addend = R.dist.call_tir_local_view(
                    cls.scale, (g, p2), out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"))
                y_addend = R.dist.call_tir_local_view(
                    cls.add, (p1, s2_addend),
                    out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"))
                y = R.ccl.allreduce(y_addend, op_type="sum", in_group=False)
                R.output(y)
            return y

    tvm.ir.assert_structural_equal(MergeAllReduces()(Before), Expected)


@I.ir_module
class ScaledOnce:
    """One all-reduce, then a linear scale: no second all-reduce to merge with."""

    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @T.prim_func(private=True, s_tir=True)
    def matmul(a: T.Buffer((T.int64(4), T.int64(4)), "float32"),
               b: T.Buffer((T.int64(4), T.int64(8)), "float32"),
               c: T.Buffer((T.int64(4), T.int64(8)), "float32")):
        for i, j, k in T.grid(T.int64(4), T.int64(8), T.int64(4)):
            with T.sblock("matmul"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                with T.init():
                    c[vi, vj] = T.float32(0.0)
                c[vi, vj] = c[vi, vj] + a[vi, vk] * b[vk, vj]

    @T.prim_func(private=True, s_tir=True)
    def scale(g: T.Buffer((T.int64(4), T.int64(1)), "float32"),
              a: T.Buffer((T.int64(4), T.int64(8)), "float32"),
              c: T.Buffer((T.int64(4), T.int64(8)), "float32")):
        for i, j in T.grid(T.int64(4), T.int64(8)):
            with T.sblock("scale"):
                vi, vj = T.axis.remap("SS", [i, j])
                c[vi, vj] = g[vi, T.int64(0)] * a[vi, vj]

    @R.function
    def main(x1: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[1]"),
             w1: R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]"),
             g: R.dist.DTensor((4, 1), "float32", "mesh[0]", "R")
             ) -> R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"):
        cls = ScaledOnce
        with R.dataflow():
            p1 = R.dist.call_tir_local_view(
                cls.matmul, (x1, w1), out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"))
            y1 = R.ccl.allreduce(p1, op_type="sum", in_group=False)
            y = R.dist.call_tir_local_view(
                cls.scale, (g, y1), out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"))
            R.output(y)
        return y


def test_one_allreduce_followed_by_linear_kernels_is_left_as_written():
    """A chain that never meets a second all-reduce: the module is unchanged."""
    tvm.ir.assert_structural_equal(MergeAllReduces()(ScaledOnce), ScaledOnce)


@I.ir_module
class Product:
    """Two all-reduces multiplied: a * b is not linear in the pair, both stay."""

    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @T.prim_func(private=True, s_tir=True)
    def matmul(a: T.Buffer((T.int64(4), T.int64(4)), "float32"),
               b: T.Buffer((T.int64(4), T.int64(8)), "float32"),
               c: T.Buffer((T.int64(4), T.int64(8)), "float32")):
        for i, j, k in T.grid(T.int64(4), T.int64(8), T.int64(4)):
            with T.sblock("matmul"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                with T.init():
                    c[vi, vj] = T.float32(0.0)
                c[vi, vj] = c[vi, vj] + a[vi, vk] * b[vk, vj]

    @T.prim_func(private=True, s_tir=True)
    def multiply(a: T.Buffer((T.int64(4), T.int64(8)), "float32"),
                 b: T.Buffer((T.int64(4), T.int64(8)), "float32"),
                 c: T.Buffer((T.int64(4), T.int64(8)), "float32")):
        for i, j in T.grid(T.int64(4), T.int64(8)):
            with T.sblock("multiply"):
                vi, vj = T.axis.remap("SS", [i, j])
                c[vi, vj] = a[vi, vj] * b[vi, vj]

    @R.function
    def main(x1: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[1]"),
             w1: R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]"),
             x2: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[1]"),
             w2: R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]")
             ) -> R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"):
        cls = Product
        with R.dataflow():
            p1 = R.dist.call_tir_local_view(
                cls.matmul, (x1, w1), out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"))
            y1 = R.ccl.allreduce(p1, op_type="sum", in_group=False)
            p2 = R.dist.call_tir_local_view(
                cls.matmul, (x2, w2), out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"))
            y2 = R.ccl.allreduce(p2, op_type="sum", in_group=False)
            y = R.dist.call_tir_local_view(
                cls.multiply, (y1, y2), out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"))
            R.output(y)
        return y


def test_two_allreduces_multiplied_are_not_merged():
    """sum(a) * sum(b) is not sum(a * b): the module is unchanged."""
    tvm.ir.assert_structural_equal(MergeAllReduces()(Product), Product)


@I.ir_module
class UsedTwice:
    """The first all-reduce's result is also returned: it must be complete, no merge."""

    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @T.prim_func(private=True, s_tir=True)
    def matmul(a: T.Buffer((T.int64(4), T.int64(4)), "float32"),
               b: T.Buffer((T.int64(4), T.int64(8)), "float32"),
               c: T.Buffer((T.int64(4), T.int64(8)), "float32")):
        for i, j, k in T.grid(T.int64(4), T.int64(8), T.int64(4)):
            with T.sblock("matmul"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                with T.init():
                    c[vi, vj] = T.float32(0.0)
                c[vi, vj] = c[vi, vj] + a[vi, vk] * b[vk, vj]

    @T.prim_func(private=True, s_tir=True)
    def add(a: T.Buffer((T.int64(4), T.int64(8)), "float32"),
            b: T.Buffer((T.int64(4), T.int64(8)), "float32"),
            c: T.Buffer((T.int64(4), T.int64(8)), "float32")):
        for i, j in T.grid(T.int64(4), T.int64(8)):
            with T.sblock("add"):
                vi, vj = T.axis.remap("SS", [i, j])
                c[vi, vj] = a[vi, vj] + b[vi, vj]

    @R.function
    def main(x1: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[1]"),
             w1: R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]"),
             x2: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[1]"),
             w2: R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]")):
        cls = UsedTwice
        with R.dataflow():
            p1 = R.dist.call_tir_local_view(
                cls.matmul, (x1, w1), out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"))
            y1 = R.ccl.allreduce(p1, op_type="sum", in_group=False)
            p2 = R.dist.call_tir_local_view(
                cls.matmul, (x2, w2), out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"))
            y2 = R.ccl.allreduce(p2, op_type="sum", in_group=False)
            y = R.dist.call_tir_local_view(
                cls.add, (y1, y2), out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"))
            R.output(y1, y)
        return (y1, y)


def test_an_allreduce_with_another_use_is_not_merged():
    """y1 is returned as well as added: its all-reduce cannot wait, so nothing is merged."""
    tvm.ir.assert_structural_equal(MergeAllReduces()(UsedTwice), UsedTwice)


@I.ir_module
class DifferentMeshAxes:
    """2x2 mesh: one sum split on mesh axis 0, the other on axis 1; their all-reduces differ."""

    I.module_global_infos({"mesh": [R.dist.device_mesh((2, 2), I.Range(0, 4))]})

    @T.prim_func(private=True, s_tir=True)
    def matmul(a: T.Buffer((T.int64(4), T.int64(4)), "float32"),
               b: T.Buffer((T.int64(4), T.int64(8)), "float32"),
               c: T.Buffer((T.int64(4), T.int64(8)), "float32")):
        for i, j, k in T.grid(T.int64(4), T.int64(8), T.int64(4)):
            with T.sblock("matmul"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                with T.init():
                    c[vi, vj] = T.float32(0.0)
                c[vi, vj] = c[vi, vj] + a[vi, vk] * b[vk, vj]

    @T.prim_func(private=True, s_tir=True)
    def add(a: T.Buffer((T.int64(4), T.int64(8)), "float32"),
            b: T.Buffer((T.int64(4), T.int64(8)), "float32"),
            c: T.Buffer((T.int64(4), T.int64(8)), "float32")):
        for i, j in T.grid(T.int64(4), T.int64(8)):
            with T.sblock("add"):
                vi, vj = T.axis.remap("SS", [i, j])
                c[vi, vj] = a[vi, vj] + b[vi, vj]

    @R.function
    def main(x1: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[1]R"),
             w1: R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]R"),
             x2: R.dist.DTensor((4, 8), "float32", "mesh[0]", "RS[1]"),
             w2: R.dist.DTensor((8, 8), "float32", "mesh[0]", "RS[0]")
             ) -> R.dist.DTensor((4, 8), "float32", "mesh[0]", "RR"):
        cls = DifferentMeshAxes
        with R.dataflow():
            p1 = R.dist.call_tir_local_view(
                cls.matmul, (x1, w1), out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "RR"))
            y1 = R.ccl.allreduce(p1, op_type="sum", in_group=False)
            p2 = R.dist.call_tir_local_view(
                cls.matmul, (x2, w2), out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "RR"))
            y2 = R.ccl.allreduce(p2, op_type="sum", in_group=False)
            y = R.dist.call_tir_local_view(
                cls.add, (y1, y2), out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "RR"))
            R.output(y)
        return y


def test_2d_mesh_allreduces_over_different_mesh_axes_are_not_merged():
    """Sums over mesh axis 0 and over axis 1 need two groups: the module is unchanged."""
    tvm.ir.assert_structural_equal(MergeAllReduces()(DifferentMeshAxes), DifferentMeshAxes)
