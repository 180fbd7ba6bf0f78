"""GroupedQueryAttention in TVM's test form: a ``Before`` module, an ``Expected`` one by hand.

Two key-value heads, each shared by two query heads (``repeat_kv`` as transformers
traces it), in a decode step (one query token) over a cache of 8. The pass rewrites both
attention products to read the unrepeated heads and drops the repeats; it leaves the
module alone when the heads split would cut a group, and when the query length is only
known at run time.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from tvm_distx.passes import GroupedQueryAttention


def rewrite(mod: tvm.IRModule, **kwargs) -> tvm.IRModule:
    out = GroupedQueryAttention("main", **kwargs)(mod)
    relax.analysis.well_formed(out)
    return out


@I.ir_module
class RepeatedHeads:
    @R.function
    def main(q: R.Tensor((1, 4, 1, 4), "float32"), k: R.Tensor((1, 2, 8, 4), "float32"),
             v: R.Tensor((1, 2, 8, 4), "float32")) -> R.Tensor((1, 4, 1, 4), "float32"):
        with R.dataflow():
            k_wide = R.expand_dims(k, axis=[2])
            k_bcast = R.broadcast_to(k_wide, R.shape([1, 2, 2, 8, 4]))
            k_rep = R.reshape(k_bcast, R.shape([1, 4, 8, 4]))
            k_t = R.permute_dims(k_rep, axes=[0, 1, 3, 2])
            scores = R.matmul(q, k_t)
            probs = R.nn.softmax(scores, axis=-1)
            v_wide = R.expand_dims(v, axis=[2])
            v_bcast = R.broadcast_to(v_wide, R.shape([1, 2, 2, 8, 4]))
            v_rep = R.reshape(v_bcast, R.shape([1, 4, 8, 4]))
            attn = R.matmul(probs, v_rep)
            out = R.nn.relu(attn)
            R.output(out)
        return out


@I.ir_module
class GroupedHeads:
    @R.function
    def main(q: R.Tensor((1, 4, 1, 4), "float32"), k: R.Tensor((1, 2, 8, 4), "float32"),
             v: R.Tensor((1, 2, 8, 4), "float32")) -> R.Tensor((1, 4, 1, 4), "float32"):
        with R.dataflow():
            # query head 2 * i + j is row j of key-value head i: (1, 4, 1, 4) -> (1, 2, 2, 4)
            q_rows = R.reshape(q, R.shape([1, 2, 2, 4]))
            k_t = R.permute_dims(k, axes=[0, 1, 3, 2])
            scores_grouped = R.matmul(q_rows, k_t)
            scores = R.reshape(scores_grouped, R.shape([1, 4, 1, 8]))
            probs = R.nn.softmax(scores, axis=-1)
            probs_rows = R.reshape(probs, R.shape([1, 2, 2, 8]))
            attn_grouped = R.matmul(probs_rows, v)
            attn = R.reshape(attn_grouped, R.shape([1, 4, 1, 4]))
            out = R.nn.relu(attn)
            R.output(out)
        return out


def test_both_attention_products_read_the_unrepeated_key_value_heads():
    """Scores (q @ repeat(k)^T) and output (probs @ repeat(v)): each query operand is
    reshaped into (b, kv heads, group * length, d), multiplied with the unrepeated k
    (transposed) or v, and reshaped back to the product's shape; the repeats
    (expand_dims, broadcast_to, reshape) are removed."""
    tvm.ir.assert_structural_equal(rewrite(RepeatedHeads), GroupedHeads)


def test_heads_divisor_that_splits_inside_a_group_leaves_the_module_unchanged():
    """heads_divisor=4 with 2 key-value heads: a split of the heads over 4 ranks would cut
    a group, so both products keep reading the repeated heads."""
    tvm.ir.assert_structural_equal(rewrite(RepeatedHeads, heads_divisor=4), RepeatedHeads)


def test_heads_divisor_that_divides_the_key_value_heads_rewrites():
    """heads_divisor=2 with 2 key-value heads: each rank holds one whole group, rewritten."""
    tvm.ir.assert_structural_equal(rewrite(RepeatedHeads, heads_divisor=2), GroupedHeads)


@I.ir_module
class RunTimeLength:
    @R.function
    def main(q: R.Tensor((1, 4, "s", 4), "float32"), k: R.Tensor((1, 2, 8, 4), "float32")
             ) -> R.Tensor((1, 4, "s", 8), "float32"):
        with R.dataflow():
            k_wide = R.expand_dims(k, axis=[2])
            k_bcast = R.broadcast_to(k_wide, R.shape([1, 2, 2, 8, 4]))
            k_rep = R.reshape(k_bcast, R.shape([1, 4, 8, 4]))
            k_t = R.permute_dims(k_rep, axes=[0, 1, 3, 2])
            scores = R.matmul(q, k_t)
            out = R.nn.softmax(scores, axis=-1)
            R.output(out)
        return out


def test_run_time_query_length_leaves_the_module_unchanged():
    """A query length s known only at run time (a prefill): g * s would merge a run-time
    extent into the rows, so the product keeps reading the repeated keys."""
    tvm.ir.assert_structural_equal(rewrite(RunTimeLength), RunTimeLength)


@I.ir_module
class ProductIsTheOutput:
    @R.function
    def main(p: R.Tensor((1, 4, 1, 8), "float32"), v: R.Tensor((1, 2, 8, 4), "float32")
             ) -> R.Tensor((1, 4, 1, 4), "float32"):
        with R.dataflow():
            v_wide = R.expand_dims(v, axis=[2])
            v_bcast = R.broadcast_to(v_wide, R.shape([1, 2, 2, 8, 4]))
            v_rep = R.reshape(v_bcast, R.shape([1, 4, 8, 4]))
            attn = R.matmul(p, v_rep)
            R.output(attn)
        return attn


@I.ir_module
class ProductIsTheOutputGrouped:
    @R.function
    def main(p: R.Tensor((1, 4, 1, 8), "float32"), v: R.Tensor((1, 2, 8, 4), "float32")
             ) -> R.Tensor((1, 4, 1, 4), "float32"):
        with R.dataflow():
            p_rows = R.reshape(p, R.shape([1, 2, 2, 8]))
            attn_grouped = R.matmul(p_rows, v)
            attn = R.reshape(attn_grouped, R.shape([1, 4, 1, 4]))
            R.output(attn)
        return attn


def test_product_that_is_the_dataflow_output_stays_the_output():
    """The output product bound directly to the dataflow block's output variable: the final
    reshape is that output (a variable visible after the block), not a block-local one."""
    tvm.ir.assert_structural_equal(rewrite(ProductIsTheOutput), ProductIsTheOutputGrouped)
