"""AnnotateSharding in TVM's test form: a ``Before`` module, an ``Expected`` one written by hand.

The main cases of the pass, one small module each: rules on parameters (the
annotations open the function, in parameter order), rules on values (an operator's
arguments and result, a private function's call), a preset's rules, and the inputs it
leaves as they are (an annotation already there, a rule that matches nothing when not
strict).
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from tvm_distx import ShardingRule
from tvm_distx.passes import AnnotateSharding
from tvm_distx.plans import presets


def annotate(mod: tvm.IRModule, rules, **kwargs) -> tvm.IRModule:
    out = AnnotateSharding(rules, **kwargs)(mod)
    relax.analysis.well_formed(out)
    return out


# --------------------------------------------------------------------------- parameters
@I.ir_module
class Linear:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((16, 8), "float32"),
             b: R.Tensor((16,), "float32")) -> R.Tensor((4, 16), "float32"):
        with R.dataflow():
            wt = R.permute_dims(w)
            y = R.matmul(x, wt)
            z = R.add(y, b)
            R.output(z)
        return z


@I.ir_module
class LinearColumnParallel:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((16, 8), "float32"),
             b: R.Tensor((16,), "float32")) -> R.Tensor((4, 16), "float32"):
        w_ann = R.dist.annotate_sharding(w, device_mesh="mesh[0]", placement="S[0]")
        b_ann = R.dist.annotate_sharding(b, device_mesh="mesh[0]", placement="S[0]")
        with R.dataflow():
            wt = R.permute_dims(w_ann)
            y = R.matmul(x, wt)
            z = R.add(y, b_ann)
            R.output(z)
        return z


def test_param_rules_annotate_a_column_parallel_weight_and_bias_at_function_start():
    """Parameter rules (weight S[0], bias S[0]; written bias first): one block of
    annotations opens main, in parameter order, and every use reads the annotated value;
    the body is otherwise unchanged (no DTensor type yet: that is propagation's job)."""
    rules = [ShardingRule(param="b", result="S[0]"), ShardingRule(param="w", result="S[0]")]
    tvm.ir.assert_structural_equal(annotate(Linear, rules), LinearColumnParallel)


# --------------------------------------------------------------------------- values
@I.ir_module
class Mlp:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 16), "float32")
             ) -> R.Tensor((4, 16), "float32"):
        with R.dataflow():
            y = R.matmul(x, w)
            z = R.nn.relu(y)
            R.output(z)
        return z


@I.ir_module
class MlpOpAnnotated:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 16), "float32")
             ) -> R.Tensor((4, 16), "float32"):
        with R.dataflow():
            x_ann = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="R")
            y_raw = R.matmul(x_ann, w)
            y = R.dist.annotate_sharding(y_raw, device_mesh="mesh[0]", placement="S[1]")
            z = R.nn.relu(y)
            R.output(z)
        return z


def test_op_rule_annotates_an_argument_before_the_call_and_the_result_after_it():
    """An operator rule (matmul: argument 0 R, result S[1]): the argument is annotated just
    before the call, the call's value is annotated right after it, and the annotated result
    keeps the original variable, so relu (a later use) reads the annotated value."""
    rule = ShardingRule(op="relax.matmul", args={0: "R"}, result="S[1]")
    tvm.ir.assert_structural_equal(annotate(Mlp, [rule]), MlpOpAnnotated)


@I.ir_module
class CallsBlock:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function(private=True)
    def block(x: R.Tensor((4, 8), "float32")) -> R.Tensor((4, 8), "float32"):
        y = R.nn.relu(x)
        return y

    @R.function
    def main(x: R.Tensor((4, 8), "float32")) -> R.Tensor((4, 8), "float32"):
        cls = CallsBlock
        with R.dataflow():
            a = cls.block(x)
            b = cls.block(a)
            R.output(b)
        return b


@I.ir_module
class CallsBlockAnnotated:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function(private=True)
    def block(x: R.Tensor((4, 8), "float32")) -> R.Tensor((4, 8), "float32"):
        y = R.nn.relu(x)
        return y

    @R.function
    def main(x: R.Tensor((4, 8), "float32")) -> R.Tensor((4, 8), "float32"):
        cls = CallsBlockAnnotated
        with R.dataflow():
            x_ann = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="S[0]")
            a = cls.block(x_ann)
            a_ann = R.dist.annotate_sharding(a, device_mesh="mesh[0]", placement="S[0]")
            b = cls.block(a_ann)
            R.output(b)
        return b


def test_callee_rule_annotates_the_argument_of_every_call_and_leaves_the_callee_alone():
    """A callee rule (block: argument 0 S[0]) matches both calls of the private function:
    each argument is annotated before its call, and the callee itself is not touched."""
    rule = ShardingRule(callee="block", args={0: "S[0]"})
    tvm.ir.assert_structural_equal(annotate(CallsBlock, [rule]), CallsBlockAnnotated)


# --------------------------------------------------------------------------- a preset
@I.ir_module
class TwoLayerMlp:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.Tensor((4, 8), "float32"), p_fc1_weight: R.Tensor((16, 8), "float32"),
             p_fc1_bias: R.Tensor((16,), "float32"), p_fc2_weight: R.Tensor((8, 16), "float32"),
             p_fc2_bias: R.Tensor((8,), "float32")) -> R.Tensor((4, 8), "float32"):
        with R.dataflow():
            w1 = R.permute_dims(p_fc1_weight)
            h = R.add(R.matmul(x, w1), p_fc1_bias)
            a = R.nn.gelu(h)
            w2 = R.permute_dims(p_fc2_weight)
            y = R.add(R.matmul(a, w2), p_fc2_bias)
            R.output(y)
        return y


@I.ir_module
class TwoLayerMlpMegatron:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.Tensor((4, 8), "float32"), p_fc1_weight: R.Tensor((16, 8), "float32"),
             p_fc1_bias: R.Tensor((16,), "float32"), p_fc2_weight: R.Tensor((8, 16), "float32"),
             p_fc2_bias: R.Tensor((8,), "float32")) -> R.Tensor((4, 8), "float32"):
        w1_ann = R.dist.annotate_sharding(p_fc1_weight, device_mesh="mesh[0]", placement="S[0]")
        b1_ann = R.dist.annotate_sharding(p_fc1_bias, device_mesh="mesh[0]", placement="S[0]")
        w2_ann = R.dist.annotate_sharding(p_fc2_weight, device_mesh="mesh[0]", placement="S[1]")
        with R.dataflow():
            w1 = R.permute_dims(w1_ann)
            h = R.add(R.matmul(x, w1), b1_ann)
            a = R.nn.gelu(h)
            w2 = R.permute_dims(w2_ann)
            y = R.add(R.matmul(a, w2), p_fc2_bias)
            R.output(y)
        return y


def test_megatron_preset_makes_fc1_column_parallel_and_fc2_row_parallel():
    """The megatron preset's rules on a two-layer MLP: fc1's (out, in) weight and its bias
    S[0] (column parallel), fc2's weight S[1] (row parallel); fc2's bias and the input
    are not annotated (they stay replicated)."""
    rules = presets.megatron().rules(TwoLayerMlp)
    tvm.ir.assert_structural_equal(annotate(TwoLayerMlp, rules), TwoLayerMlpMegatron)


# --------------------------------------------------------------------------- unchanged
def test_annotation_already_present_is_left_as_it_is():
    """Rules asking for the annotations a module already has change nothing (idempotent):
    the column-parallel module annotated again is the same module."""
    rules = [ShardingRule(param="w", result="S[0]"), ShardingRule(param="b", result="S[0]")]
    tvm.ir.assert_structural_equal(annotate(LinearColumnParallel, rules), LinearColumnParallel)


def test_rule_that_matches_nothing_leaves_the_module_unchanged_when_not_strict():
    """A parameter rule naming no parameter, with strict=False: the module is unchanged."""
    rule = ShardingRule(param="not_a_param", result="S[0]")
    tvm.ir.assert_structural_equal(annotate(Linear, [rule], strict=False), Linear)
