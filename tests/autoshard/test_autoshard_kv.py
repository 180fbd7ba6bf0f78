"""auto_shard on a generation module: the key-value cache is state in the memory budget.

``decode`` of :func:`tvm_distx.export_decoder` takes the caches ``key_l`` /
``value_l`` (batch, kv_heads, max_length, head_dim) and returns them updated.
The plans are checked on the numbers they report and on the tokens the rules
generate on 2 MPI ranks through :class:`tvm_distx.CausalLM`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from tvm_distx.plans import presets
from tvm_distx.autoshard import auto_shard, plan_cost

pytest.importorskip("transformers")
from hf_tiny import build, greedy, prompt_ids  # noqa: E402

#: long enough that the cache (4 x 64 KiB) weighs like the weights (0.39 MiB)
MAX_LENGTH = 512
CACHES = ("key_0", "value_0", "key_1", "value_1")


@pytest.fixture(scope="module")
def decoder():
    from tvm_distx.frontend.decoder import export_decoder

    model = build("llama")
    program = export_decoder(model, max_length=MAX_LENGTH)
    weights = sum(np.asarray(v).nbytes for v in program.weights.values())
    return model, program, weights, program.cache.nbytes()


def _no_collective_on_the_cache(report) -> None:
    g = report.graph
    state = g.state_nodes()
    assert {g.nodes[i].name for i in g.state} == set(CACHES)
    for value, src, dst, _, _, steps in report.solution.moves:
        assert value not in state or all(k == "local_slice" for k, _ in steps), \
            (g.nodes[value].name, src, dst, steps)


def test_a_budget_without_room_for_a_replicated_cache_splits_it_by_heads(decoder):
    _, program, weights, cache = decoder
    budget = weights + cache  # both whole, and no byte left for an activation
    _, report = auto_shard(program.mod, (2,), function="decode", memory_per_rank=budget,
                           runner_ups=0, pin=False)
    for name in CACHES:
        assert report.placements[name] == "S[1]"  # (batch, kv_heads, ...): by heads
    assert report.cache_bytes_per_rank == cache // 2 == report.replicated_cache_bytes // 2
    assert report.solution.peak_bytes <= budget
    # the new caches are not counted beside the old: peak = weights + cache + activations
    assert report.solution.peak_bytes == (report.weight_bytes_per_rank + cache // 2
                                          + report.activation_bytes_per_rank)
    assert report.activation_bytes_per_rank < cache  # the returned caches are not activations
    _no_collective_on_the_cache(report)
    text = str(report)
    assert "cache 0.12 MiB of 0.25 MiB" in text and "activations" in text


@pytest.fixture(scope="module")
def tight(decoder):
    """A budget below the replicated weights and cache: 0.72 x their sum."""
    _, program, weights, cache = decoder
    return auto_shard(program.mod, (2,), function="decode",
                      memory_per_rank=int(0.72 * (weights + cache)), runner_ups=0, pin=False)


def test_a_budget_below_weights_and_cache_splits_both(decoder, tight):
    _, program, weights, cache = decoder
    _, report = tight
    assert report.cache_bytes_per_rank == cache // 2
    assert 0.5 <= report.weight_bytes_per_rank / weights <= 0.52
    for layer in range(2):  # the projections that write the cache split by heads too
        for name in ("k_proj", "v_proj"):
            assert report.placements[f"p_model_model_layers_{layer}_self_attn_{name}_weight"] \
                == "S[0]"
    _no_collective_on_the_cache(report)
    # a collective or two per block: never more messages than Megatron's all-reduces
    collectives = report.collectives()
    assert set(collectives) <= {"all_reduce", "all_gather", "reduce_scatter"}
    assert sum(collectives.values()) <= 2 * 4 + 1
    megatron = plan_cost(program.mod, (2,), presets.tensor_parallel(), function="decode")
    assert megatron.state_bytes == cache // 2
    assert report.solution.objective <= megatron.objective * (1 + 1e-9)


def test_the_rules_generate_like_transformers_on_mpi(decoder, tight):
    from tvm_distx.llm.causal_lm import CausalLM

    model, _, _, _ = decoder
    _, report = tight
    prompt = prompt_ids(5, seed=3)
    # decode's plan moves activations (an all-gather of the hidden state) that a prompt of
    # a run-time length could not take: the prompt gets a static length
    with CausalLM.from_hf(model, num_ranks=2, max_length=MAX_LENGTH, prompt_length=5,
                          plan=report.preset()) as lm:
        out = lm.generate(prompt, max_new_tokens=6)
    np.testing.assert_array_equal(out[0], greedy(model, prompt, 6))


# --------------------------------------------------------------------------- run-time extents
def _prefill_only(program):
    import tvm

    return tvm.IRModule({gv: f for gv, f in program.mod.functions.items()
                         if gv.name_hint != "decode"})


def test_a_symbolic_prompt_length_is_priced_at_a_size_and_runs_at_any(decoder):
    """prefill(input_ids (1, seq), ...) planned at seq=64, run at 5 and 9 tokens on 2 MPI ranks."""
    import tvm_distx as td
    from hf_tiny import logits, tokens

    model, program, weights, _ = decoder
    mod = _prefill_only(program)
    seq = str(mod["prefill"].params[0].ty.shape.values[1].name)
    with pytest.raises(td.errors.SymbolicExtentError, match=f"its symbolic extents: {seq}"):
        auto_shard(mod, (2,), function="prefill", sizes={"seq": 64}, runner_ups=0)
    unbounded = mod.clone()
    unbounded["prefill"] = mod["prefill"].without_attr("tir_var_upper_bound")
    with pytest.raises(td.errors.SymbolicExtentError, match=f"sizes=\\{{'{seq}': 128\\}}"):
        auto_shard(unbounded, (2,), function="prefill", runner_ups=0)
    annotated, report = auto_shard(mod, (2,), function="prefill", sizes={seq: 64},
                                   runner_ups=0)
    assert report.graph.sizes == {seq: 64} and f"{seq}=64" in str(report)
    assert report.collectives()["all_reduce"] == 4  # Megatron: one per attention, per MLP
    for value, _, _, _, _, steps in report.solution.moves:  # the rest: static masks
        node = report.graph.nodes[value]
        assert not node.dynamic or {k for k, _ in steps} <= {"all_reduce", "local_slice"}
    assert 0.5 <= report.weight_bytes_per_rank / weights <= 0.55  # norms whole
    exe = td.compile(annotated)
    session = exe.session(2, backend="mpi", params=program.weights, function="prefill")
    try:  # one launch of the ranks, two prompt lengths
        for length in (5, 9):
            ids = tokens(length, seed=length)
            out = session.run(ids, np.arange(length), *program.cache.zeros(),
                              function="prefill")
            np.testing.assert_allclose(out[0], logits(model, ids)[:, -1:], atol=1e-4)
    finally:
        session.close()


def test_the_prefill_plan_serves_generation_at_any_prompt_length_on_mpi(decoder):
    """Rules of ``prefill`` planned at seq=64 serve ``decode`` too, prompts of run-time length."""
    from tvm_distx.llm.causal_lm import CausalLM

    model, program, _, _ = decoder
    mod = _prefill_only(program)
    seq = str(mod["prefill"].params[0].ty.shape.values[1].name)
    _, report = auto_shard(mod, (2,), function="prefill", sizes={seq: 64}, runner_ups=0,
                           pin=False)
    assert all(report.placements[name] == "S[1]" for name in CACHES)
    prompts = [prompt_ids(5, seed=4), prompt_ids(9, seed=5)]
    with CausalLM.from_hf(model, num_ranks=2, max_length=MAX_LENGTH,
                          plan=report.preset()) as lm:
        rows = lm.generate(prompts, max_new_tokens=4)
    for row, prompt in zip(rows, prompts):
        np.testing.assert_array_equal(row, greedy(model, prompt, 4))


ALIASED = """
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class Module:
    @R.function
    def step(x: R.Tensor((4, 64), "float32"), key: R.Tensor((1, 2, 256, 16), "float32"),
             value: R.Tensor((1, 2, 256, 16), "float32"), mask: R.Tensor((1, 1, 256, 1), "bool"),
             new: R.Tensor((1, 2, 256, 16), "float32"), w: R.Tensor((64, 64), "float32")):
        R.func_attr({"num_input": 5})
        with R.dataflow():
            y = R.matmul(x, w)
            written = R.where(mask, new, value)
            out = (y, key, written)
            R.output(out)
        return out
"""


def test_caches_returned_as_is_or_written_count_once(tmp_path):
    """``key`` is returned as is (an alias), ``value`` written by a ``where``: each counts once."""
    from tvm_distx.frontend.script import load_module

    path = tmp_path / "step.py"
    path.write_text(ALIASED)
    _, report = auto_shard(load_module(path), (2,), function="step", runner_ups=0, pin=False)
    g = report.graph
    assert {g.nodes[i].name: g.nodes[o].name for i, o in g.state.items()} == \
        {"key": "key", "value": "written"}  # new, also an input of that shape, is not state
    cache = 2 * (2 * 256 * 16 * 4)
    assert report.replicated_cache_bytes == cache
    held = report.cache_bytes_per_rank
    activations = report.activation_bytes_per_rank
    assert report.solution.peak_bytes == report.weight_bytes_per_rank + held + activations
    # x, mask, new and y, all live when y is made; never the cache's bytes again
    chosen = [g.strategies[i][c] for i, c in enumerate(report.solution.choice)]
    assert activations == sum(g.local_bytes(i, chosen[i]) for i, n in enumerate(g.nodes)
                              if n.name in ("x", "mask", "new", "y"))
    assert f"cache {held / 2**20:.2f} MiB of {cache / 2**20:.2f} MiB" in str(report)
