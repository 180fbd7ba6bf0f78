"""The attention kernel: its online-softmax implementation equals the formula, and
FuseAttention finds attention written as operators.

The implementation is built alone for this host and compared with numpy in float64
for every mask kind, grouped-query heads, both layouts (blocks of queries for a
prompt, one query at a time for a decoded token), key counts that end inside a
tile, a mask broadcast over batch and heads, queries whose keys are all masked,
and half-precision operands. FuseAttention is checked on Relax functions written
here: the chain becomes one call of the definition, and a chain whose scores
are used elsewhere is left alone.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from tvm import relax

from tvm_distx.compiler.fuse_attention import FuseAttention, attention_chains
from tvm_distx.compiler.schedule import ScheduleCPU, x86_target
from tvm_distx.compiler.schedule.attention import (ATTENTION_ATTR, AttentionKernel,
                                                 attention_definition, flash_attention)
from tvm_distx.compiler.schedule.base import RULE_ATTR
from tvm_distx import errors as td_errors

TARGET = x86_target(2)
LOWEST = float(np.finfo(np.float32).min)


def reference(q, k, v, mask, kernel: AttentionKernel) -> np.ndarray:
    """The module docstring's formula in float64."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    k, v = np.repeat(k, kernel.group, axis=1), np.repeat(v, kernel.group, axis=1)
    z = np.einsum("bhid,bhjd->bhij", q, k) * kernel.scale
    if kernel.mask == "bool":
        z = np.where(mask, z, LOWEST)
    elif kernel.mask == "add":
        z = z + mask
    z = np.exp(z - z.max(-1, keepdims=True))
    return np.einsum("bhij,bhjd->bhid", z / z.sum(-1, keepdims=True), v)


def run(kernel: AttentionKernel, *arrays) -> np.ndarray:
    mod = tvm.IRModule({"main": flash_attention(kernel).with_attr("global_symbol", "main")})
    lib = tvm.compile(ScheduleCPU(TARGET)(mod), target=TARGET)
    q = arrays[0]
    out = np.zeros(q.shape[:3] + (kernel.value_dim,), kernel.dtype)
    tensors = [tvm.runtime.tensor(a) for a in (*arrays, out)]
    lib["main"](*tensors)
    return tensors[-1].numpy()


def causal(queries: int, keys: int, start: int) -> np.ndarray:
    """The mask of queries at positions ``start ..`` over ``keys`` cache slots."""
    positions = np.arange(start, start + queries)
    return (np.arange(keys)[None, :] <= positions[:, None])[None, None]


@pytest.mark.parametrize("kind", ["none", "bool", "add"])
@pytest.mark.parametrize("batch,heads,kv_heads,queries,keys,start", [
    (1, 4, 2, 1, 37, 20),      # a decoded token: one query at a time
    (1, 4, 4, 5, 16, 9),       # a few queries, one whole tile
    (2, 4, 1, 33, 40, 7),      # blocks of queries, the last block and tile partial
    (1, 6, 2, 70, 70, 0),      # a prompt attending to itself
])
def test_the_kernel_equals_the_formula(kind, batch, heads, kv_heads, queries, keys, start):
    rng = np.random.default_rng(queries * 7 + keys)
    d = 64 if queries == 1 else 16
    kernel = AttentionKernel(heads, kv_heads, d, d, 1 / np.sqrt(d), kind,
                             mask_dtype="float32" if kind == "add" else "bool")
    q = rng.standard_normal((batch, heads, queries, d), dtype=np.float32)
    k = rng.standard_normal((batch, kv_heads, keys, d), dtype=np.float32)
    v = rng.standard_normal((batch, kv_heads, keys, d), dtype=np.float32)
    arrays = [q, k, v]
    mask = None
    if kind == "bool":
        mask = causal(queries, keys, start)
        arrays.append(mask)
    elif kind == "add":
        mask = rng.standard_normal((1, 1, queries, keys)).astype(np.float32)
        arrays.append(mask)
    np.testing.assert_allclose(run(kernel, *arrays), reference(q, k, v, mask, kernel),
                               rtol=0, atol=2e-6)


@pytest.mark.parametrize("queries", [1, 24])
def test_a_mask_over_every_axis_and_queries_with_every_key_masked(queries):
    """A (b, h, s, L) mask; the queries with no key get the mean of all values, as the
    formula's uniform weights over ``lowest`` scores give."""
    rng = np.random.default_rng(queries)
    kernel = AttentionKernel(2, 2, 16, 8, 0.25, "bool", (True, True, True))
    q = rng.standard_normal((2, 2, queries, 16), dtype=np.float32)
    k = rng.standard_normal((2, 2, 50, 16), dtype=np.float32)
    v = rng.standard_normal((2, 2, 50, 8), dtype=np.float32)
    mask = rng.random((2, 2, queries, 50)) < 0.3
    mask[0, 1, 0, :] = False
    mask[1, 0, -1, :] = False
    got = run(kernel, q, k, v, mask)
    np.testing.assert_allclose(got, reference(q, k, v, mask, kernel), rtol=0, atol=2e-6)
    np.testing.assert_allclose(got[0, 1, 0], v[0, 1].mean(axis=0), rtol=0, atol=1e-6)


@pytest.mark.parametrize("queries", [1, 40])
def test_keys_past_the_context_are_never_read(queries):
    """Cache slots no query may see hold NaN (as stale or unwritten memory could): the
    tiles the mask hides are skipped, so the output stays finite and exact."""
    rng = np.random.default_rng(3)
    kernel = AttentionKernel(4, 2, 16, 16, 0.25, "bool")
    keys, context = 4096, 40 + queries
    q = rng.standard_normal((1, 4, queries, 16), dtype=np.float32)
    k = rng.standard_normal((1, 2, keys, 16), dtype=np.float32)
    v = rng.standard_normal((1, 2, keys, 16), dtype=np.float32)
    mask = causal(queries, keys, 40)
    first_hidden = -(-context // 16) * 16  # the first tile no query sees
    k[:, :, first_hidden:] = np.nan
    v[:, :, first_hidden:] = np.nan
    got = run(kernel, q, k, v, mask)
    want = reference(q, k[:, :, :context], v[:, :, :context], mask[..., :context], kernel)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)


def test_half_precision_operands_accumulate_in_float32():
    rng = np.random.default_rng(5)
    kernel = AttentionKernel(4, 2, 16, 16, 0.25, "bool", dtype="float16")
    q, k, v = (rng.standard_normal(s).astype(np.float16)
               for s in ((1, 4, 20, 16), (1, 2, 30, 16), (1, 2, 30, 16)))
    mask = causal(20, 30, 10)
    np.testing.assert_allclose(run(kernel, q, k, v, mask).astype(np.float64),
                               reference(q, k, v, mask, kernel), rtol=0, atol=2e-3)


def test_both_forms_carry_the_description_and_the_implementation_is_scheduled():
    kernel = AttentionKernel(8, 2, 64, 64, 0.125, "bool", (False, False, True))
    definition, implementation = attention_definition(kernel, 1, None, 2048), \
        flash_attention(kernel)
    assert AttentionKernel.of(definition) == kernel == AttentionKernel.of(implementation)
    assert implementation.attrs[RULE_ATTR] == "attention"
    assert ATTENTION_ATTR in definition.attrs and RULE_ATTR not in definition.attrs


# --------------------------------------------------------------------- FuseAttention
def attention_function(*, grouped: bool, mask: str, share_scores: bool = False):
    """A Relax function computing attention the way the torch frontend writes it."""
    bb = relax.BlockBuilder()
    seq = tvm.tirx.Var("seq", "int64")
    q = relax.Var("q", relax.TensorType((1, 4, seq, 16), "float32"))
    kv_heads = 2 if grouped else 4
    k = relax.Var("k", relax.TensorType((1, kv_heads, 32, 16), "float32"))
    v = relax.Var("v", relax.TensorType((1, kv_heads, 32, 16), "float32"))
    m = relax.Var("m", relax.TensorType((1, 1, seq, 32), "bool" if mask == "bool" else "float32"))
    with bb.function("main", [q, k, v, m]):
        with bb.dataflow():
            keys, values = k, v
            if grouped:
                keys = bb.emit(relax.op.repeat(k, 2, axis=1))
                values = bb.emit(relax.op.repeat(v, 2, axis=1))
            z = bb.emit(relax.op.matmul(q, bb.emit(relax.op.permute_dims(keys, [0, 1, 3, 2]))))
            scaled = bb.emit(relax.op.multiply(z, relax.const(0.25, "float32")))
            if mask == "bool":
                scaled = bb.emit(relax.op.where(m, scaled, relax.const(LOWEST, "float32")))
            else:
                scaled = bb.emit(relax.op.add(scaled, m))
            weights = bb.emit(relax.op.nn.softmax(scaled, axis=-1))
            out = bb.emit(relax.op.matmul(weights, values))
            result = bb.emit_output(relax.Tuple([out, z]) if share_scores else out)
        bb.emit_func_output(result)
    return bb.get()


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("mask", ["bool", "add"])
def test_the_chain_becomes_one_call_of_the_definition(grouped, mask):
    mod = attention_function(grouped=grouped, mask=mask)
    fused = FuseAttention()(mod)
    calls = [b.value for b in fused["main"].body.blocks[0].bindings
             if isinstance(b.value, relax.Call)]
    assert [c.op.name for c in calls] == ["relax.call_tir"]
    kernel = AttentionKernel.of(fused[calls[0].args[0]])
    assert kernel == AttentionKernel(4, 2 if grouped else 4, 16, 16, 0.25, mask,
                                     (False, False, True), "float32",
                                     "bool" if mask == "bool" else "float32")
    assert [a.name for a in calls[0].args[1].fields] == ["q", "k", "v", "m"]


def test_a_chain_whose_scores_are_read_elsewhere_is_left_as_it_is():
    mod = attention_function(grouped=True, mask="bool", share_scores=True)
    assert attention_chains(mod["main"]) == {}
    assert FuseAttention()(mod).same_as(mod)


def test_a_kernel_description_that_cannot_exist_is_refused():
    with pytest.raises(td_errors.ArgumentError, match="whole groups"):
        AttentionKernel(6, 4, 16, 16, 0.25)
    with pytest.raises(td_errors.ArgumentError, match="not a mask kind"):
        AttentionKernel(4, 2, 16, 16, 0.25, "causal")


def test_the_kernels_memory_does_not_grow_with_the_context():
    """Every buffer of the implementation is a fixed tile: the same at 2k, 8k or any context."""
    kernel = AttentionKernel(16, 8, 64, 64, 0.125, "bool", (False, False, True))
    text = flash_attention(kernel).script()
    allocations = re.findall(r"T\.alloc_\w+\(\(([^)]*)\)(?:, \"(\w+)\")?\)", text)
    assert allocations and "sblock_alloc_buffer" not in text
    total = 0
    for extents, dtype in allocations:
        sizes = [int(e) for e in extents.split(",") if e.strip()]  # a symbol would not parse
        total += int(np.prod(sizes)) * np.dtype(dtype or "float32").itemsize
    assert total < 16 << 10, total  # a few KiB of registers and stack per task


def test_quick_macros_build_the_kernel_tvms_own_macro_lookup_builds():
    """``quick_macros`` changes how a macro finds its parser, not what it builds; it is
    undone afterwards."""
    from tvm.script.parser.core.parser import ScriptMacro

    own = ScriptMacro.__dict__["_find_parser_def"]
    kernel = AttentionKernel(4, 2, 16, 16, 0.25, "bool")
    quick = flash_attention.__wrapped__(kernel)            # under quick_macros
    slow = flash_attention.__wrapped__.__wrapped__(kernel)  # TVM's own lookup
    tvm.ir.assert_structural_equal(quick, slow)
    assert ScriptMacro.__dict__["_find_parser_def"] is own
