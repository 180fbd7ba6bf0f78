"""LowerGlobalViewToLocalView alone, in TVM's form: a global-view Before, the Expected local view.

Each Before calls kernels on whole (global) tensors with ``R.dist.call_tir`` on
DTensors, as sharding propagation leaves them; each Expected is written by
hand: every kernel that touches a split tensor is rewritten over the local
shard (``call_tir_local_view`` of a copy with local buffers and loops), a
reduction over a split dimension is followed by TVM's ``R.ccl.allreduce``, and
the corrections this pass adds to TVM's (kernels on replicated tensors kept as
written, one mesh axis per split dimension, merged all-reduces, split symbolic
extents) are visible in the module.
"""

from __future__ import annotations

import tvm
from tvm import s_tir
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tvm_distx.legalize import LowerGlobalViewToLocalView
from tvm_distx.legalize.split_extents import bind_split_extents


def test_an_elementwise_kernel_on_split_rows_runs_on_the_local_rows():
    """relu on (8, 4) "S[0]" over 2 devices: a copy of the kernel on (4, 4) buffers."""

    @I.ir_module
    class Before:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @T.prim_func(private=True, s_tir=True)
        def relu(x: T.Buffer((T.int64(8), T.int64(4)), "float32"),
                 y: T.Buffer((T.int64(8), T.int64(4)), "float32")):
            for i, j in T.grid(T.int64(8), T.int64(4)):
                with T.sblock("relu"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    y[vi, vj] = T.max(x[vi, vj], T.float32(0.0))

        @R.function
        def main(x: R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]")
                 ) -> R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]"):
            cls = Before
            with R.dataflow():
                y = R.dist.call_tir(cls.relu, (x,),
                                    out_ty=R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]"))
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        # TVM's pass leaves the global-view kernel in the module, no longer called
        @T.prim_func(private=True, s_tir=True)
        def relu(x: T.Buffer((T.int64(8), T.int64(4)), "float32"),
                 y: T.Buffer((T.int64(8), T.int64(4)), "float32")):
            for i, j in T.grid(T.int64(8), T.int64(4)):
                with T.sblock("relu"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    y[vi, vj] = T.max(x[vi, vj], T.float32(0.0))

        @T.prim_func(private=True, s_tir=True)
        def relu1(x: T.Buffer((T.int64(4), T.int64(4)), "float32"),
                  y: T.Buffer((T.int64(4), T.int64(4)), "float32")):
            for i, j in T.grid(T.int64(4), T.int64(4)):
                with T.sblock("relu"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    y[vi, vj] = T.max(x[vi, vj], T.float32(0.0))

        @R.function
        def main(x: R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]")
                 ) -> R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]"):
            cls = Expected
            with R.dataflow():
                y = R.dist.call_tir_local_view(
                    cls.relu1, (x,), out_ty=R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]"))
                R.output(y)
            return y

    tvm.ir.assert_structural_equal(LowerGlobalViewToLocalView()(Before), Expected)


def test_a_product_over_a_split_sum_gets_tvms_allreduce():
    """x (4, 8) "S[1]" @ w (8, 8) "S[0]" -> "R": each rank sums its half of k, then an all-reduce."""

    @I.ir_module
    class Before:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @T.prim_func(private=True, s_tir=True)
        def matmul(a: T.Buffer((T.int64(4), T.int64(8)), "float32"),
                   b: T.Buffer((T.int64(8), T.int64(8)), "float32"),
                   c: T.Buffer((T.int64(4), T.int64(8)), "float32")):
            for i, j, k in T.grid(T.int64(4), T.int64(8), T.int64(8)):
                with T.sblock("matmul"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    with T.init():
                        c[vi, vj] = T.float32(0.0)
                    c[vi, vj] = c[vi, vj] + a[vi, vk] * b[vk, vj]

        @R.function
        def main(x: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[1]"),
                 w: R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]")
                 ) -> R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"):
            cls = Before
            with R.dataflow():
                y = R.dist.call_tir(cls.matmul, (x, w),
                                    out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"))
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        # TVM's pass leaves the global-view kernel in the module, no longer called
        @T.prim_func(private=True, s_tir=True)
        def matmul(a: T.Buffer((T.int64(4), T.int64(8)), "float32"),
                   b: T.Buffer((T.int64(8), T.int64(8)), "float32"),
                   c: T.Buffer((T.int64(4), T.int64(8)), "float32")):
            for i, j, k in T.grid(T.int64(4), T.int64(8), T.int64(8)):
                with T.sblock("matmul"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    with T.init():
                        c[vi, vj] = T.float32(0.0)
                    c[vi, vj] = c[vi, vj] + a[vi, vk] * b[vk, vj]

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
                 w: R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]")
                 ) -> R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"):
            cls = Expected
            with R.dataflow():
                addend = R.dist.call_tir_local_view(
                    cls.matmul1, (x, w), out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"))
                y = R.ccl.allreduce(addend, op_type="sum", in_group=False)
                R.output(y)
            return y

    tvm.ir.assert_structural_equal(LowerGlobalViewToLocalView()(Before), Expected)


def test_a_kernel_on_replicated_tensors_is_called_as_written():
    """relu on "R": every rank computes on whole tensors, the kernel is not copied."""

    @I.ir_module
    class Before:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @T.prim_func(private=True, s_tir=True)
        def relu(x: T.Buffer((T.int64(8), T.int64(4)), "float32"),
                 y: T.Buffer((T.int64(8), T.int64(4)), "float32")):
            for i, j in T.grid(T.int64(8), T.int64(4)):
                with T.sblock("relu"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    y[vi, vj] = T.max(x[vi, vj], T.float32(0.0))

        @R.function
        def main(x: R.dist.DTensor((8, 4), "float32", "mesh[0]", "R")
                 ) -> R.dist.DTensor((8, 4), "float32", "mesh[0]", "R"):
            cls = Before
            with R.dataflow():
                y = R.dist.call_tir(cls.relu, (x,),
                                    out_ty=R.dist.DTensor((8, 4), "float32", "mesh[0]", "R"))
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @T.prim_func(private=True, s_tir=True)
        def relu(x: T.Buffer((T.int64(8), T.int64(4)), "float32"),
                 y: T.Buffer((T.int64(8), T.int64(4)), "float32")):
            for i, j in T.grid(T.int64(8), T.int64(4)):
                with T.sblock("relu"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    y[vi, vj] = T.max(x[vi, vj], T.float32(0.0))

        @R.function
        def main(x: R.dist.DTensor((8, 4), "float32", "mesh[0]", "R")
                 ) -> R.dist.DTensor((8, 4), "float32", "mesh[0]", "R"):
            cls = Expected
            with R.dataflow():
                y = R.dist.call_tir_local_view(
                    cls.relu, (x,), out_ty=R.dist.DTensor((8, 4), "float32", "mesh[0]", "R"))
                R.output(y)
            return y

    tvm.ir.assert_structural_equal(LowerGlobalViewToLocalView()(Before), Expected)


def test_2d_mesh_rows_split_by_both_axes_run_split_by_the_first_only():
    """relu on "S[0]S[0]" (2x2): moved to "S[0]R", run on (4, 4) blocks, moved back."""

    @I.ir_module
    class Before:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2, 2), I.Range(0, 4))]})

        @T.prim_func(private=True, s_tir=True)
        def relu(x: T.Buffer((T.int64(8), T.int64(4)), "float32"),
                 y: T.Buffer((T.int64(8), T.int64(4)), "float32")):
            for i, j in T.grid(T.int64(8), T.int64(4)):
                with T.sblock("relu"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    y[vi, vj] = T.max(x[vi, vj], T.float32(0.0))

        @R.function
        def main(x: R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]S[0]")
                 ) -> R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]S[0]"):
            cls = Before
            with R.dataflow():
                y = R.dist.call_tir(cls.relu, (x,),
                                    out_ty=R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]S[0]"))
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2, 2), I.Range(0, 4))]})

        @T.prim_func(private=True, s_tir=True)
        def relu(x: T.Buffer((T.int64(8), T.int64(4)), "float32"),
                 y: T.Buffer((T.int64(8), T.int64(4)), "float32")):
            for i, j in T.grid(T.int64(8), T.int64(4)):
                with T.sblock("relu"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    y[vi, vj] = T.max(x[vi, vj], T.float32(0.0))

        # rows split in 2 (mesh axis 0 only), not in 4
        @T.prim_func(private=True, s_tir=True)
        def relu1(x: T.Buffer((T.int64(4), T.int64(4)), "float32"),
                  y: T.Buffer((T.int64(4), T.int64(4)), "float32")):
            for i, j in T.grid(T.int64(4), T.int64(4)):
                with T.sblock("relu"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    y[vi, vj] = T.max(x[vi, vj], T.float32(0.0))

        @R.function
        def main(x: R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]S[0]")
                 ) -> R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]S[0]"):
            cls = Expected
            with R.dataflow():
                x_split_once = R.dist.redistribute(x, device_mesh="mesh[0]", placement="S[0]R")
                y_split_once = R.dist.call_tir_local_view(
                    cls.relu1, (x_split_once,),
                    out_ty=R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]R"))
                y = R.dist.redistribute(y_split_once, device_mesh="mesh[0]", placement="S[0]S[0]")
                R.output(y)
            return y

    tvm.ir.assert_structural_equal(LowerGlobalViewToLocalView()(Before), Expected)


def test_two_allreduces_added_are_merged_into_one():
    """Two row-parallel products added: TVM's two all-reduces become one, after the add."""

    @I.ir_module
    class Before:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @T.prim_func(private=True, s_tir=True)
        def matmul(a: T.Buffer((T.int64(4), T.int64(8)), "float32"),
                   b: T.Buffer((T.int64(8), T.int64(8)), "float32"),
                   c: T.Buffer((T.int64(4), T.int64(8)), "float32")):
            for i, j, k in T.grid(T.int64(4), T.int64(8), T.int64(8)):
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
                y1 = R.dist.call_tir(cls.matmul, (x1, w1),
                                     out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"))
                y2 = R.dist.call_tir(cls.matmul, (x2, w2),
                                     out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"))
                y = R.dist.call_tir(cls.add, (y1, y2),
                                    out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"))
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @T.prim_func(private=True, s_tir=True)
        def matmul(a: T.Buffer((T.int64(4), T.int64(8)), "float32"),
                   b: T.Buffer((T.int64(8), T.int64(8)), "float32"),
                   c: T.Buffer((T.int64(4), T.int64(8)), "float32")):
            for i, j, k in T.grid(T.int64(4), T.int64(8), T.int64(8)):
                with T.sblock("matmul"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    with T.init():
                        c[vi, vj] = T.float32(0.0)
                    c[vi, vj] = c[vi, vj] + a[vi, vk] * b[vk, vj]

        # each rank's half of the summed dimension (one copy serves both products)
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
                    cls.matmul1, (x1, w1), out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"))
                p2 = R.dist.call_tir_local_view(
                    cls.matmul1, (x2, w2), out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"))
                y_addend = R.dist.call_tir_local_view(
                    cls.add, (p1, p2), out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"))
                y = R.ccl.allreduce(y_addend, op_type="sum", in_group=False)
                R.output(y)
            return y

    tvm.ir.assert_structural_equal(LowerGlobalViewToLocalView()(Before), Expected)


def test_a_sharded_kernel_result_passed_to_a_function_goes_through_a_redistribute():
    """relu's "S[0]" result passed to another Relax function: a redistribute to its own
    sharding first, which TVM types by its destination (and LegalizeRedistribute plans
    from the true layout); the callee's parameter type then always matches."""

    @I.ir_module
    class Before:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @T.prim_func(private=True, s_tir=True)
        def relu(x: T.Buffer((T.int64(8), T.int64(4)), "float32"),
                 y: T.Buffer((T.int64(8), T.int64(4)), "float32")):
            for i, j in T.grid(T.int64(8), T.int64(4)):
                with T.sblock("relu"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    y[vi, vj] = T.max(x[vi, vj], T.float32(0.0))

        @R.function(private=True)
        def keep(a: R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]")
                 ) -> R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]"):
            return a

        @R.function
        def main(x: R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]")
                 ) -> R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]"):
            cls = Before
            y = R.dist.call_tir(cls.relu, (x,),
                                out_ty=R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]"))
            z = cls.keep(y)
            return z

    @I.ir_module
    class Expected:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        # TVM's pass leaves the global-view kernel in the module, no longer called
        @T.prim_func(private=True, s_tir=True)
        def relu(x: T.Buffer((T.int64(8), T.int64(4)), "float32"),
                 y: T.Buffer((T.int64(8), T.int64(4)), "float32")):
            for i, j in T.grid(T.int64(8), T.int64(4)):
                with T.sblock("relu"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    y[vi, vj] = T.max(x[vi, vj], T.float32(0.0))

        @T.prim_func(private=True, s_tir=True)
        def relu1(x: T.Buffer((T.int64(4), T.int64(4)), "float32"),
                  y: T.Buffer((T.int64(4), T.int64(4)), "float32")):
            for i, j in T.grid(T.int64(4), T.int64(4)):
                with T.sblock("relu"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    y[vi, vj] = T.max(x[vi, vj], T.float32(0.0))

        @R.function(private=True)
        def keep(a: R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]")
                 ) -> R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]"):
            return a

        @R.function
        def main(x: R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]")
                 ) -> R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]"):
            cls = Expected
            y = R.dist.call_tir_local_view(
                cls.relu1, (x,), out_ty=R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]"))
            y_pin = R.dist.redistribute(y, device_mesh="mesh[0]", placement="S[0]")
            z = cls.keep(y_pin)
            return z

    tvm.ir.assert_structural_equal(LowerGlobalViewToLocalView()(Before), Expected)


def test_a_split_symbolic_extent_is_written_as_parts_times_a_local_extent():
    """relu on ("n", 4) "S[0]" over 2: n becomes 2 * n_local, each rank runs n_local rows.

    The function takes the local extents as a last parameter until LowerDistIR drops
    it; the kernel is specialized to ``2 * n_local`` rows (a copy, ``relu_split``, taking
    ``n_local``), which TVM's pass can divide in 2.
    """

    @I.ir_module
    class Before:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @T.prim_func(private=True, s_tir=True)
        def relu(var_x: T.handle, var_y: T.handle):
            n = T.int64()
            x = T.match_buffer(var_x, (n, T.int64(4)))
            y = T.match_buffer(var_y, (n, T.int64(4)))
            for i, j in T.grid(n, T.int64(4)):
                with T.sblock("relu"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    y[vi, vj] = T.max(x[vi, vj], T.float32(0.0))

        @R.function
        def main(x: R.dist.DTensor(("n", 4), "float32", "mesh[0]", "S[0]")
                 ) -> R.dist.DTensor(("n", 4), "float32", "mesh[0]", "S[0]"):
            n = T.int64()
            cls = Before
            with R.dataflow():
                y = R.dist.call_tir(cls.relu, (x,),
                                    out_ty=R.dist.DTensor((n, 4), "float32", "mesh[0]", "S[0]"))
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @T.prim_func(private=True, s_tir=True)
        def relu(var_x: T.handle, var_y: T.handle):
            n = T.int64()
            x = T.match_buffer(var_x, (n, T.int64(4)))
            y = T.match_buffer(var_y, (n, T.int64(4)))
            for i, j in T.grid(n, T.int64(4)):
                with T.sblock("relu"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    y[vi, vj] = T.max(x[vi, vj], T.float32(0.0))

        # the kernel specialized to the operand's rows, 2 * n_local, taking n_local
        @T.prim_func(private=True, s_tir=True)
        def relu_split(var_x: T.handle, n_local: T.int64, var_y: T.handle):
            x = T.match_buffer(var_x, (n_local * T.int64(2), T.int64(4)))
            y = T.match_buffer(var_y, (n_local * T.int64(2), T.int64(4)))
            for i, j in T.grid(n_local * T.int64(2), T.int64(4)):
                with T.sblock("relu"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    y[vi, vj] = T.max(x[vi, vj], T.float32(0.0))

        # TVM's local view of it: each rank's n_local rows, which TVM writes as
        # (n_local * 2) // 2 (it proves the division, and does not simplify)
        @T.prim_func(private=True, s_tir=True)
        def relu_split1(var_x: T.handle, n_local: T.int64, var_y: T.handle):
            x = T.match_buffer(var_x, (n_local * T.int64(2) // T.int64(2), T.int64(4)))
            y = T.match_buffer(var_y, (n_local * T.int64(2) // T.int64(2), T.int64(4)))
            for i, j in T.grid(n_local * T.int64(2) // T.int64(2), T.int64(4)):
                with T.sblock("relu"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    y[vi, vj] = T.max(x[vi, vj], T.float32(0.0))

        @R.function
        def main(x: R.dist.DTensor(("n_local * 2", 4), "float32", "mesh[0]", "S[0]"),
                 tvm_distx_local_extents: R.Shape(["n_local"])
                 ) -> R.dist.DTensor(("n_local * 2", 4), "float32", "mesh[0]", "S[0]"):
            n_local = T.int64()
            cls = Expected
            with R.dataflow():
                y = R.dist.call_tir_local_view(
                    cls.relu_split1, (x, R.prim_value(n_local)),
                    out_ty=R.dist.DTensor((n_local * 2, 4), "float32", "mesh[0]", "S[0]"))
                R.output(y)
            return y

    tvm.ir.assert_structural_equal(LowerGlobalViewToLocalView()(Before), Expected)


@I.ir_module
class SymbolicRows:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @T.prim_func(private=True, s_tir=True)
    def relu(var_x: T.handle, var_y: T.handle):
        n = T.int64()
        x = T.match_buffer(var_x, (n, T.int64(4)))
        y = T.match_buffer(var_y, (n, T.int64(4)))
        for i, j in T.grid(n, T.int64(4)):
            with T.sblock("relu"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = T.max(x[vi, vj], T.float32(0.0))

    @R.function
    def main(x: R.dist.DTensor(("n", 4), "float32", "mesh[0]", "S[0]")
             ) -> R.dist.DTensor(("n", 4), "float32", "mesh[0]", "S[0]"):
        n = T.int64()
        cls = SymbolicRows
        with R.dataflow():
            y = R.dist.call_tir(cls.relu, (x,),
                                out_ty=R.dist.DTensor((n, 4), "float32", "mesh[0]", "S[0]"))
            R.output(y)
        return y


def test_the_specialized_kernel_defines_its_own_variables():
    """The copy ``relu_split`` beside ``relu`` must not reuse relu's loop variables.

    ``PrimFunc.specialize`` keeps the variables it does not bind, and TIR allows one
    definition of each variable in a module: TVM's verifier rejected the module
    ("multiple definitions of variable i") until the copy got fresh definitions.
    """
    assert s_tir.analysis.verify_well_formed(bind_split_extents(SymbolicRows))
    assert s_tir.analysis.verify_well_formed(LowerGlobalViewToLocalView()(SymbolicRows))
