"""LegalizeLinear alone, in TVM's form: a Before module, the Expected one, structurally.

Each Before is a ``(out, in)`` weight used as ``matmul(x, permute_dims(w))``,
as TVM's PyTorch frontend imports ``Linear``; each Expected is written by hand:
one kernel ``matmul_weight_transposed`` that reads ``w[j, k]`` where it is
stored, and no transpose. What the pass must not fold stays as written.
"""

from __future__ import annotations

import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tvm_distx.legalize.linear import LegalizeLinear


def test_the_transpose_of_a_weight_parameter_is_read_in_place_by_one_kernel():
    """x (2, 8) @ w.T for w (6, 8): one kernel summing x[i, k] * w[j, k], no transpose."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 8), "float32"), w: R.Tensor((6, 8), "float32")
                 ) -> R.Tensor((2, 6), "float32"):
            with R.dataflow():
                wt = R.permute_dims(w)
                y = R.matmul(x, wt)
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        @T.prim_func(private=True, s_tir=True)
        def matmul_weight_transposed(x: T.Buffer((T.int64(2), T.int64(8)), "float32"),
                                     w: T.Buffer((T.int64(6), T.int64(8)), "float32"),
                                     matmul: T.Buffer((T.int64(2), T.int64(6)), "float32")):
            T.func_attr({"tirx.noalias": True})
            for i, j, k in T.grid(T.int64(2), T.int64(6), T.int64(8)):
                with T.sblock("matmul"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    T.reads(x[vi, vk], w[vj, vk])
                    T.writes(matmul[vi, vj])
                    with T.init():
                        matmul[vi, vj] = T.float32(0.0)
                    matmul[vi, vj] = matmul[vi, vj] + x[vi, vk] * w[vj, vk]

        @R.function
        def main(x: R.Tensor((2, 8), "float32"), w: R.Tensor((6, 8), "float32")
                 ) -> R.Tensor((2, 6), "float32"):
            cls = Expected
            with R.dataflow():
                y = R.call_tir(cls.matmul_weight_transposed, (x, w),
                               out_ty=R.Tensor((2, 6), "float32"))
                R.output(y)
            return y

    tvm.ir.assert_structural_equal(LegalizeLinear()(Before), Expected)


def test_a_sharded_weight_is_read_in_place_and_keeps_its_annotation():
    """w annotated S[0] (column-parallel), batched x (2, 3, 8): the kernel reads the annotation."""

    @I.ir_module
    class Before:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @R.function
        def main(x: R.Tensor((2, 3, 8), "float32"), w: R.Tensor((6, 8), "float32")
                 ) -> R.Tensor((2, 3, 6), "float32"):
            with R.dataflow():
                ws = R.dist.annotate_sharding(w, device_mesh="mesh[0]", placement="S[0]")
                wt = R.permute_dims(ws, axes=[1, 0])
                y = R.matmul(x, wt)
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @T.prim_func(private=True, s_tir=True)
        def matmul_weight_transposed(x: T.Buffer((T.int64(2), T.int64(3), T.int64(8)), "float32"),
                                     ws: T.Buffer((T.int64(6), T.int64(8)), "float32"),
                                     matmul: T.Buffer((T.int64(2), T.int64(3), T.int64(6)),
                                                      "float32")):
            T.func_attr({"tirx.noalias": True})
            for b, i, j, k in T.grid(T.int64(2), T.int64(3), T.int64(6), T.int64(8)):
                with T.sblock("matmul"):
                    vb, vi, vj, vk = T.axis.remap("SSSR", [b, i, j, k])
                    T.reads(x[vb, vi, vk], ws[vj, vk])
                    T.writes(matmul[vb, vi, vj])
                    with T.init():
                        matmul[vb, vi, vj] = T.float32(0.0)
                    matmul[vb, vi, vj] = matmul[vb, vi, vj] + x[vb, vi, vk] * ws[vj, vk]

        @R.function
        def main(x: R.Tensor((2, 3, 8), "float32"), w: R.Tensor((6, 8), "float32")
                 ) -> R.Tensor((2, 3, 6), "float32"):
            cls = Expected
            with R.dataflow():
                ws = R.dist.annotate_sharding(w, device_mesh="mesh[0]", placement="S[0]")
                y = R.call_tir(cls.matmul_weight_transposed, (x, ws),
                               out_ty=R.Tensor((2, 3, 6), "float32"))
                R.output(y)
            return y

    tvm.ir.assert_structural_equal(LegalizeLinear()(Before), Expected)


def test_an_out_dtype_casts_both_operands_in_the_kernel():
    """float16 x and w with out_dtype float32: the kernel sums the products in float32."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 8), "float16"), w: R.Tensor((6, 8), "float16")
                 ) -> R.Tensor((2, 6), "float32"):
            with R.dataflow():
                wt = R.permute_dims(w)
                y = R.matmul(x, wt, out_dtype="float32")
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        @T.prim_func(private=True, s_tir=True)
        def matmul_weight_transposed(x: T.Buffer((T.int64(2), T.int64(8)), "float16"),
                                     w: T.Buffer((T.int64(6), T.int64(8)), "float16"),
                                     matmul: T.Buffer((T.int64(2), T.int64(6)), "float32")):
            T.func_attr({"tirx.noalias": True})
            for i, j, k in T.grid(T.int64(2), T.int64(6), T.int64(8)):
                with T.sblock("matmul"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    T.reads(x[vi, vk], w[vj, vk])
                    T.writes(matmul[vi, vj])
                    with T.init():
                        matmul[vi, vj] = T.float32(0.0)
                    matmul[vi, vj] = matmul[vi, vj] + T.Cast("float32", x[vi, vk]) * T.Cast(
                        "float32", w[vj, vk])

        @R.function
        def main(x: R.Tensor((2, 8), "float16"), w: R.Tensor((6, 8), "float16")
                 ) -> R.Tensor((2, 6), "float32"):
            cls = Expected
            with R.dataflow():
                y = R.call_tir(cls.matmul_weight_transposed, (x, w),
                               out_ty=R.Tensor((2, 6), "float32"))
                R.output(y)
            return y

    tvm.ir.assert_structural_equal(LegalizeLinear()(Before), Expected)


def test_two_linears_of_the_same_shape_share_one_kernel():
    """Two (8, 8) weights applied in turn to (2, 8) values: one kernel, called twice."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 8), "float32"), w1: R.Tensor((8, 8), "float32"),
                 w2: R.Tensor((8, 8), "float32")) -> R.Tensor((2, 8), "float32"):
            with R.dataflow():
                w1t = R.permute_dims(w1)
                h = R.matmul(x, w1t)
                w2t = R.permute_dims(w2)
                y = R.matmul(h, w2t)
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        @T.prim_func(private=True, s_tir=True)
        def matmul_weight_transposed(x: T.Buffer((T.int64(2), T.int64(8)), "float32"),
                                     w1: T.Buffer((T.int64(8), T.int64(8)), "float32"),
                                     matmul: T.Buffer((T.int64(2), T.int64(8)), "float32")):
            T.func_attr({"tirx.noalias": True})
            for i, j, k in T.grid(T.int64(2), T.int64(8), T.int64(8)):
                with T.sblock("matmul"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    T.reads(x[vi, vk], w1[vj, vk])
                    T.writes(matmul[vi, vj])
                    with T.init():
                        matmul[vi, vj] = T.float32(0.0)
                    matmul[vi, vj] = matmul[vi, vj] + x[vi, vk] * w1[vj, vk]

        @R.function
        def main(x: R.Tensor((2, 8), "float32"), w1: R.Tensor((8, 8), "float32"),
                 w2: R.Tensor((8, 8), "float32")) -> R.Tensor((2, 8), "float32"):
            cls = Expected
            with R.dataflow():
                h = R.call_tir(cls.matmul_weight_transposed, (x, w1),
                               out_ty=R.Tensor((2, 8), "float32"))
                y = R.call_tir(cls.matmul_weight_transposed, (h, w2),
                               out_ty=R.Tensor((2, 8), "float32"))
                R.output(y)
            return y

    tvm.ir.assert_structural_equal(LegalizeLinear()(Before), Expected)


@I.ir_module
class TransposeUsedTwice:
    """The transposed weight is also returned: the transpose must stay, nothing is folded."""

    @R.function
    def main(x: R.Tensor((2, 8), "float32"), w: R.Tensor((6, 8), "float32")):
        with R.dataflow():
            wt = R.permute_dims(w)
            y = R.matmul(x, wt)
            R.output(wt, y)
        return (wt, y)


def test_a_transpose_with_another_use_is_left_to_legalize_ops():
    """The permute_dims has two uses: folding one would not save the copy; unchanged."""
    tvm.ir.assert_structural_equal(LegalizeLinear()(TransposeUsedTwice), TransposeUsedTwice)


@I.ir_module
class IdentityPermutation:
    """permute_dims(w, [0, 1]) is no transpose: the matmul reads w as (in, out), unchanged."""

    @R.function
    def main(x: R.Tensor((2, 8), "float32"), w: R.Tensor((8, 8), "float32")
             ) -> R.Tensor((2, 8), "float32"):
        with R.dataflow():
            same = R.permute_dims(w, axes=[0, 1])
            y = R.matmul(x, same)
            R.output(y)
        return y


def test_a_permutation_that_is_not_a_transpose_is_not_folded():
    """axes [0, 1] keep w's layout: folding it as w.T would compute x @ w.T, wrongly."""
    tvm.ir.assert_structural_equal(LegalizeLinear()(IdentityPermutation), IdentityPermutation)
