"""SplitFusedProjections in TVM's test form: a ``Before`` module, an ``Expected`` one by hand.

The core rewrite, a fused q|k|v projection with a bias cut three ways into one matmul per
segment (the new parameters recorded, as data, in the module attribute), and the fused
projections it must leave alone: one whose fused value is read by something else, one cut
on an axis that is not the features, and one in a private function.
"""

from __future__ import annotations

import json

import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from tvm_distx.passes import SplitFusedProjections
from tvm_distx.passes.split_fused import ATTR


def split(mod: tvm.IRModule) -> tvm.IRModule:
    out = SplitFusedProjections()(mod)
    relax.analysis.well_formed(out)
    return out


def _cut(name: str, source: str, shape: list[int], axis: int, start: int, stop: int) -> dict:
    return {"name": name, "source": source, "source_shape": shape, "axis": axis,
            "start": start, "stop": stop}


@I.ir_module
class FusedQkv:
    @R.function
    def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 24), "float32"),
             b: R.Tensor((24,), "float32")) -> R.Tensor((4, 8), "float32"):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            y = R.matmul(x, w)
            yb = R.add(y, b)
            qkv = R.split(yb, 3, axis=1)
            q = qkv[0]
            k = qkv[1]
            v = qkv[2]
            out = R.add(R.multiply(q, k), v)
            R.output(out)
        return out


#: how each new parameter is cut from the user's weights: w (8, 24) on its columns,
#: b (24,) on its only axis, 8 features per segment
QKV_CUTS = json.dumps({"main": [
    _cut("w_seg0", "w", [8, 24], 1, 0, 8), _cut("w_seg1", "w", [8, 24], 1, 8, 16),
    _cut("w_seg2", "w", [8, 24], 1, 16, 24),
    _cut("b_seg0", "b", [24], 0, 0, 8), _cut("b_seg1", "b", [24], 0, 8, 16),
    _cut("b_seg2", "b", [24], 0, 16, 24),
]})


@I.ir_module
class FusedQkvSplit:
    I.module_attrs({ATTR: QKV_CUTS})

    @R.function
    def main(x: R.Tensor((4, 8), "float32"), w_seg0: R.Tensor((8, 8), "float32"),
             w_seg1: R.Tensor((8, 8), "float32"), w_seg2: R.Tensor((8, 8), "float32"),
             b_seg0: R.Tensor((8,), "float32"), b_seg1: R.Tensor((8,), "float32"),
             b_seg2: R.Tensor((8,), "float32")) -> R.Tensor((4, 8), "float32"):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            y0 = R.matmul(x, w_seg0)
            q = R.add(y0, b_seg0)
            y1 = R.matmul(x, w_seg1)
            k = R.add(y1, b_seg1)
            y2 = R.matmul(x, w_seg2)
            v = R.add(y2, b_seg2)
            out = R.add(R.multiply(q, k), v)
            R.output(out)
        return out


def test_fused_qkv_with_bias_becomes_one_matmul_and_bias_add_per_segment():
    """A (in, 3 * 8) weight and its bias, matmul + add then split in three on the features:
    three matmuls and adds on parameters w_seg0..2 (8, 8) and b_seg0..2 (8,), in place of w
    and b; the split and its items disappear, q, k and v are the segments' adds, and the
    module attribute records each cut ([0, 8), [8, 16), [16, 24) of w's axis 1 and b's
    axis 0)."""
    tvm.ir.assert_structural_equal(split(FusedQkv), FusedQkvSplit)


def test_split_module_is_left_as_it_is_when_split_again():
    """Nothing fused is left after the rewrite: running the pass again changes nothing."""
    tvm.ir.assert_structural_equal(split(FusedQkvSplit), FusedQkvSplit)


# --------------------------------------------------------------------------- left alone
@I.ir_module
class FusedValueReadElsewhere:
    @R.function
    def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 16), "float32")
             ) -> R.Tensor((4, 8), "float32"):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            y = R.matmul(x, w)
            halves = R.split(y, 2, axis=1)
            a = halves[0]
            c = halves[1]
            total = R.sum(y, axis=[1], keepdims=True)
            out = R.add(R.multiply(a, c), total)
            R.output(out)
        return out


@I.ir_module
class SplitOnTheTokens:
    @R.function
    def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 16), "float32")
             ) -> R.Tensor((2, 16), "float32"):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            y = R.matmul(x, w)
            halves = R.split(y, 2, axis=0)
            a = halves[0]
            c = halves[1]
            out = R.multiply(a, c)
            R.output(out)
        return out


@I.ir_module
class FusedInPrivateFunction:
    @R.function(private=True)
    def project(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 16), "float32")
                ) -> R.Tensor((4, 8), "float32"):
        y = R.matmul(x, w)
        halves = R.split(y, 2, axis=1)
        a = halves[0]
        c = halves[1]
        out = R.multiply(a, c)
        return out

    @R.function
    def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 16), "float32")
             ) -> R.Tensor((4, 8), "float32"):
        cls = FusedInPrivateFunction
        out = cls.project(x, w)
        return out


def test_fused_value_with_another_use_is_left_alone():
    """The matmul's result is split in two and also summed: cutting the weight would lose
    the sum's operand, so the module is unchanged (and has no derived-parameter attribute)."""
    tvm.ir.assert_structural_equal(split(FusedValueReadElsewhere), FusedValueReadElsewhere)


def test_split_of_the_tokens_axis_is_left_alone():
    """A split on axis 0 (the tokens), not the feature axis: no weight segment to cut."""
    tvm.ir.assert_structural_equal(split(SplitOnTheTokens), SplitOnTheTokens)


def test_fused_projection_in_a_private_function_is_left_alone():
    """A private function's parameters are not the user's weights: not rewritten."""
    tvm.ir.assert_structural_equal(split(FusedInPrivateFunction), FusedInPrivateFunction)
