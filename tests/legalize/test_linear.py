"""LegalizeLinear: a matmul reads its (out, in) weight in place, decoded or not."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

import tvm_distx as td
from tvm_distx import AnnotateSharding, ShardingRule
from tvm_distx.sources import formats
from tvm_distx.legalize.linear import LegalizeLinear
from tvm_distx.plans import presets

MESH = R.dist.device_mesh((2,), I.Range(0, 2))


@I.ir_module
class DecodedBefore:
    """A q8 weight decoded as ``td.quantize`` writes it, its parts split on their rows."""

    I.module_global_infos({"mesh": [MESH]})

    @R.function
    def main(x: R.Tensor((1, 64), "float32"), w: R.Tensor((32, 64), "int8"),
             w_scale: R.Tensor((32, 2), "float16")) -> R.Tensor((1, 32), "float32"):
        with R.dataflow():
            data = R.dist.annotate_sharding(w, device_mesh="mesh[0]", placement="S[0]")
            scale = R.dist.annotate_sharding(w_scale, device_mesh="mesh[0]", placement="S[0]")
            lv: R.Tensor((32, 64), "float32") = R.astype(data, "float32")
            lv1: R.Tensor((32, 2, 32), "float32") = R.reshape(lv, R.shape([32, 2, 32]))
            lv2: R.Tensor((32, 2), "float32") = R.astype(scale, "float32")
            lv3: R.Tensor((32, 2, 1), "float32") = R.reshape(lv2, R.shape([32, 2, 1]))
            lv4: R.Tensor((32, 2, 32), "float32") = R.multiply(lv1, lv3)
            decoded: R.Tensor((32, 64), "float32") = R.reshape(lv4, R.shape([32, 64]))
            transposed: R.Tensor((64, 32), "float32") = R.permute_dims(decoded)
            gv: R.Tensor((1, 32), "float32") = R.matmul(x, transposed)
            R.output(gv)
        return gv


@I.ir_module
class DecodedExpected:
    """The transpose is gone: one kernel reads the decoded weight as ``W[j, k]``."""

    I.module_global_infos({"mesh": [MESH]})

    @T.prim_func(private=True, s_tir=True)
    def matmul_weight_transposed(x: T.Buffer((T.int64(1), T.int64(64)), "float32"),
                                 decoded: T.Buffer((T.int64(32), T.int64(64)), "float32"),
                                 matmul: T.Buffer((T.int64(1), T.int64(32)), "float32")):
        T.func_attr({"tirx.noalias": True})
        for i0, i1, k in T.grid(T.int64(1), T.int64(32), T.int64(64)):
            with T.sblock("matmul"):
                v_i0, v_i1, v_k = T.axis.remap("SSR", [i0, i1, k])
                T.reads(x[v_i0, v_k], decoded[v_i1, v_k])
                T.writes(matmul[v_i0, v_i1])
                with T.init():
                    matmul[v_i0, v_i1] = T.float32(0.0)
                matmul[v_i0, v_i1] = matmul[v_i0, v_i1] + x[v_i0, v_k] * decoded[v_i1, v_k]

    @R.function
    def main(x: R.Tensor((1, 64), "float32"), w: R.Tensor((32, 64), "int8"),
             w_scale: R.Tensor((32, 2), "float16")) -> R.Tensor((1, 32), "float32"):
        cls = DecodedExpected
        with R.dataflow():
            data = R.dist.annotate_sharding(w, device_mesh="mesh[0]", placement="S[0]")
            scale = R.dist.annotate_sharding(w_scale, device_mesh="mesh[0]", placement="S[0]")
            lv: R.Tensor((32, 64), "float32") = R.astype(data, "float32")
            lv1: R.Tensor((32, 2, 32), "float32") = R.reshape(lv, R.shape([32, 2, 32]))
            lv2: R.Tensor((32, 2), "float32") = R.astype(scale, "float32")
            lv3: R.Tensor((32, 2, 1), "float32") = R.reshape(lv2, R.shape([32, 2, 1]))
            lv4: R.Tensor((32, 2, 32), "float32") = R.multiply(lv1, lv3)
            decoded: R.Tensor((32, 64), "float32") = R.reshape(lv4, R.shape([32, 64]))
            gv = R.call_tir(cls.matmul_weight_transposed, (x, decoded),
                            out_ty=R.Tensor((1, 32), "float32"))
            R.output(gv)
        return gv


def test_the_transpose_of_a_decoded_weight_is_folded_into_its_matmul():
    tvm.ir.assert_structural_equal(LegalizeLinear()(DecodedBefore), DecodedExpected)


@I.ir_module
class ActivationBefore:
    """A transposed *activation* (a matmul's result) is no weight: left to LegalizeOps."""

    @R.function
    def main(x: R.Tensor((1, 64), "float32"), w: R.Tensor((64, 64), "float32")
             ) -> R.Tensor((1, 64), "float32"):
        with R.dataflow():
            h: R.Tensor((64, 64), "float32") = R.matmul(w, w)
            t: R.Tensor((64, 64), "float32") = R.permute_dims(R.astype(h, "float32"))
            gv: R.Tensor((1, 64), "float32") = R.matmul(x, t)
            R.output(gv)
        return gv


def test_a_transposed_value_computed_from_activations_is_left_alone():
    out = LegalizeLinear()(ActivationBefore)
    tvm.ir.assert_structural_equal(out, ActivationBefore)


@pytest.mark.parametrize("fmt", ["q8", "q4", "bf16"])
@pytest.mark.parametrize("placement", ["S[0]", "S[1]"])  # column- and row-parallel
def test_a_decoded_linear_split_either_way_equals_numpy_on_two_ranks(fmt, placement):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 128), "float32"))
    w = relax.Var("w", relax.TensorType((64, 128), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.matmul(x, relax.op.permute_dims(w)))
        bb.emit_func_output(out)
    mod = presets.set_device_meshes(bb.get(), [(2,)])
    annotated = AnnotateSharding([ShardingRule(param="w", result=placement)])(mod)
    weight = np.random.default_rng(3).standard_normal((64, 128), dtype="float32")
    quantized, stored = td.quantize(annotated, {"w": weight}, fmt)
    parts = {"data": np.asarray(stored["w"])}
    if "w_scale" in stored:
        parts["scale"] = np.asarray(stored["w_scale"])
    exe = td.compile(quantized)
    x = np.random.default_rng(4).standard_normal((2, 128), dtype="float32")
    got = exe.run(x, params=stored, backend="emulate")
    want = x @ formats.decode(parts, fmt).T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
