"""GroupedQueryAttention: attention products over repeated key-value heads read each head once."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax

from tvm_distx.errors import ArgumentError
from tvm_distx.passes import GroupedQueryAttention
from tvm_distx.passes.grouped_attention import repeated_heads

B, KV, GROUP, CACHE, DIM = 1, 2, 3, 16, 8
HEADS = KV * GROUP


def _attention(length=1, grouped: bool = False) -> tvm.IRModule:
    """``softmax(q @ repeat(k)^T) @ repeat(v)`` as transformers traces it; or, with
    ``grouped``, the products the pass should write instead."""
    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType([B, HEADS, length, DIM], "float32"))
    k = relax.Var("k", relax.TensorType([B, KV, CACHE, DIM], "float32"))
    v = relax.Var("v", relax.TensorType([B, KV, CACHE, DIM], "float32"))
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            if grouped:
                rows = bb.emit(relax.op.reshape(q, [B, KV, GROUP * length, DIM]))
                keys = bb.emit(relax.op.permute_dims(k, [0, 1, 3, 2]))
                product = bb.emit(relax.op.matmul(rows, keys))
                scores = bb.emit(relax.op.reshape(product, [B, HEADS, length, CACHE]))
            else:
                keys = bb.emit(relax.op.permute_dims(_repeat(bb, k), [0, 1, 3, 2]))
                scores = bb.emit(relax.op.matmul(q, keys))
            probs = bb.emit(relax.op.nn.softmax(scores, axis=-1))
            if grouped:
                rows = bb.emit(relax.op.reshape(probs, [B, KV, GROUP * length, CACHE]))
                product = bb.emit(relax.op.matmul(rows, v))
                out = bb.emit(relax.op.reshape(product, [B, HEADS, length, DIM]))
            else:
                out = bb.emit(relax.op.matmul(probs, _repeat(bb, v)))
            out = bb.emit_output(out)
        bb.emit_func_output(out)
    return bb.get()


def _repeat(bb: relax.BlockBuilder, x: relax.Var) -> relax.Var:
    wide = bb.emit(relax.op.expand_dims(x, [2]))
    wide = bb.emit(relax.op.broadcast_to(wide, [B, KV, GROUP, CACHE, DIM]))
    return bb.emit(relax.op.reshape(wide, [B, HEADS, CACHE, DIM]))


def _run(mod: tvm.IRModule, *arrays) -> np.ndarray:
    from tvm_distx.compiler.pipeline import legalize_ops

    exe = tvm.compile(legalize_ops(mod), target="llvm")
    vm = relax.VirtualMachine(exe, tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in arrays]).numpy()


def test_the_products_read_the_unrepeated_heads():
    after = GroupedQueryAttention("main")(_attention())
    assert tvm_ffi.structural_equal(after, _attention(grouped=True), map_free_vars=True), \
        after.script()


def test_the_rewritten_attention_computes_the_same_values():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s, dtype="float32") for s in
               ((B, HEADS, 1, DIM), (B, KV, CACHE, DIM), (B, KV, CACHE, DIM)))
    before, after = _attention(), GroupedQueryAttention("main")(_attention())
    expected = _run(before, q, k, v)
    # numpy's reading of repeat_kv: query head i * GROUP + j uses key-value head i
    keys, values = np.repeat(k, GROUP, axis=1), np.repeat(v, GROUP, axis=1)
    scores = q @ keys.transpose(0, 1, 3, 2)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    np.testing.assert_allclose(expected, probs @ values, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_run(after, q, k, v), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("divisor", [4, 3])
def test_heads_a_split_would_cut_inside_a_group_are_left_repeated(divisor):
    # 2 key-value heads over 4 (or 3) ranks: each rank's query heads would straddle groups
    before = _attention()
    assert GroupedQueryAttention("main", heads_divisor=divisor)(before).same_as(before)


def test_a_run_time_query_length_is_left_repeated():
    before = _attention(length=tvm.tirx.Var("seq", "int64"))
    assert GroupedQueryAttention("main")(before).same_as(before)


def test_the_pattern_is_repeat_kv_exactly():
    func = _attention()["main"]
    bound = {b.var: b.value for blk in func.body.blocks for b in blk.bindings}
    repeats = [var for var, value in bound.items()
               if isinstance(value, relax.Call) and value.op.name == "relax.reshape"]
    found = [repeated_heads(var, bound) for var in repeats]
    assert [(x.name, g) for x, g in found] == [("k", GROUP), ("v", GROUP)]
    assert repeated_heads(func.params[0], bound) is None  # a parameter repeats nothing


def test_a_bad_divisor_is_refused_with_what_to_give():
    with pytest.raises(ArgumentError, match="heads_divisor=0"):
        GroupedQueryAttention("main", heads_divisor=0)
