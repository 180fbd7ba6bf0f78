"""Mixture of experts: transformers' sparse MLPs imported with a static dispatch, run expert
parallel on 2 and 4 MPI ranks and compared with transformers (float32)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

import tvm_distx as td  # noqa: E402
from tvm_distx.plans import moe  # noqa: E402
from tvm_distx.errors import RuleError  # noqa: E402
from tvm_distx.frontend.pytorch import from_torch  # noqa: E402
from tvm_distx.compiler.pipeline import run_stages  # noqa: E402
from tvm_distx.plans.presets import megatron, set_device_meshes  # noqa: E402
from tvm_distx.layout.arrays import shard_array  # noqa: E402
from tvm_distx.frontend.torch_moe import find_experts, static_experts  # noqa: E402

TOKENS, HIDDEN = 8, 64


def _mixtral_config(**extra):
    return tf.MixtralConfig(vocab_size=128, hidden_size=HIDDEN, intermediate_size=96,
                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                            num_local_experts=4, num_experts_per_tok=2,
                            max_position_embeddings=64, tie_word_embeddings=False, **extra)


def _qwen2_moe_config():
    return tf.Qwen2MoeConfig(vocab_size=128, hidden_size=HIDDEN, intermediate_size=96,
                             moe_intermediate_size=48, shared_expert_intermediate_size=80,
                             num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                             num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                             tie_word_embeddings=False)


def _import_block(block):
    """A transformers sparse-MLP block, imported (from_torch switches its experts to the
    static dispatch)."""
    torch.manual_seed(1)
    x = torch.randn(1, TOKENS, HIDDEN)
    with torch.no_grad():
        want = block(x)
    want = (want[0] if isinstance(want, tuple) else want).numpy()
    mod, weights = from_torch(block, (x,))
    return mod, weights, x.numpy(), want


@pytest.fixture(scope="module")
def mixtral_block():
    torch.manual_seed(0)
    model = tf.MixtralForCausalLM(_mixtral_config()).eval()
    return _import_block(model.model.layers[0].mlp)


@pytest.fixture(scope="module")
def mixtral():
    torch.manual_seed(0)
    model = tf.MixtralForCausalLM(_mixtral_config()).eval()
    ids = torch.randint(0, 128, (1, TOKENS))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits.numpy()
    mod, weights = from_torch(model, (ids,))
    return mod, weights, ids.numpy(), want


def _attention(ranks: int):
    """Attention split by heads; with fewer KV heads (2) than ranks, k and v stay whole."""
    kv = ["*k_proj_weight", "*v_proj_weight"] if ranks <= 2 else []
    return megatron(column=["*q_proj_weight", *kv], column_bias=[], row=["*o_proj_weight"])


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def mixtral_expert_parallel(request, mixtral):
    mod, _, _, _ = mixtral
    plan = moe.expert_parallel(base=_attention(request.param))
    annotated = plan.apply(set_device_meshes(mod, [(request.param,)]))
    return request.param, annotated, td.compile(annotated)


def _deepseek_v3():
    # multi-head latent attention, a dense first layer, group-limited sigmoid routing
    config = tf.DeepseekV3Config(
        vocab_size=128, hidden_size=HIDDEN, intermediate_size=96, moe_intermediate_size=48,
        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
        topk_group=1, n_shared_experts=1, q_lora_rank=32, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=64,
        tie_word_embeddings=False)
    return tf.DeepseekV3ForCausalLM(config), "model.layers.1.mlp.experts"


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_static_dispatch_equals_transformers_in_torch(family):
    torch.manual_seed(0)
    if family == "mixtral":
        model, experts = tf.MixtralForCausalLM(_mixtral_config()), "model.layers.0.mlp.experts"
    else:
        model, experts = _deepseek_v3()
    model = model.eval()
    ids = torch.randint(0, 128, (2, TOKENS))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
        with static_experts(model) as names:
            got = model(ids, use_cache=False).logits
        again = model(ids, use_cache=False).logits
    assert names == [experts]
    assert [n for n, _ in find_experts(model)] == names
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert torch.equal(again, want)  # the original forward is back
    assert "forward" not in vars(model.get_submodule(experts))


def test_expert_weights_are_found_by_structure(mixtral_block):
    mod, weights, _, _ = mixtral_block
    found = moe.expert_weights(mod)
    assert found == [
        moe.ExpertWeight("p_experts_gate_up_proj", 4, expert_dim=0, intermediate_dim=1,
                         role="up"),
        moe.ExpertWeight("p_experts_down_proj", 4, expert_dim=0, intermediate_dim=2,
                         role="down"),
    ]
    assert weights["p_experts_gate_up_proj"].shape == (4, 2 * 96, HIDDEN)
    # the router stays replicated; a base preset places the other weights
    plan = moe.expert_parallel(base=megatron(column=["*gate_weight"], column_bias=[], row=[]))
    rules = {r.param: str(r.result) for r in plan.rules(mod)}
    assert rules == {"p_gate_weight": "S[0]", "p_experts_gate_up_proj": "S[0]",
                     "p_experts_down_proj": "S[0]"}
    assert {r.param: str(r.result) for r in plan.override({"*gate_weight": "R"}).rules(mod)}[
        "p_gate_weight"] == "R"
    tensor = {r.param: str(r.result) for r in moe.expert_tensor_parallel().rules(mod)}
    assert tensor == {"p_experts_gate_up_proj": "S[1]", "p_experts_down_proj": "S[2]"}
    # applied, the fused gate|up weight is first split per segment, each cut within itself
    annotated = moe.expert_tensor_parallel().apply(set_device_meshes(mod, [(2,)]))
    assert [p.name for p in annotated["main"].params][2:] == [
        "p_experts_gate_up_proj_seg0", "p_experts_gate_up_proj_seg1", "p_experts_down_proj"]


def test_a_model_without_experts_is_refused_with_a_hint():
    linear = torch.nn.Sequential(torch.nn.Linear(8, 8)).eval()
    mod, _ = from_torch(linear, (torch.randn(2, 8),))
    with pytest.raises(RuleError, match="no expert weights") as err:
        moe.expert_parallel().rules(mod)
    assert "static_experts" in str(err.value)
    with pytest.raises(RuleError, match="strategy"):
        moe.MoePlan("pipeline")


def test_expert_parallel_mixtral_logits_equal_transformers_on_mpi_and_disco(
        mixtral, mixtral_expert_parallel):
    _, weights, ids, want = mixtral
    ranks, _, exe = mixtral_expert_parallel
    out = exe.run(ids, params=weights, backend="mpi")
    np.testing.assert_allclose(out, want, atol=1e-4, rtol=0)
    if ranks == 2:
        out = exe.run(ids, params=weights, backend="disco")
        np.testing.assert_allclose(out, want, atol=1e-4, rtol=0)


def test_expert_parallel_holds_one_pth_of_the_experts_and_all_reduces_once_per_block(
        mixtral, mixtral_expert_parallel):
    _, weights, _, _ = mixtral
    ranks, annotated, exe = mixtral_expert_parallel
    rows = [r for r in td.comm_report(run_stages(annotated)["local_view"]).rows
            if r.collective != "local_slice"]
    # one all-reduce completes the attention's output projection, one the MoE layer
    assert [(r.collective, r.src, r.dst) for r in rows] == [("all_reduce", "P", "R")] * 2
    # each the (tokens, hidden) output only, as a ring all-reduce receives it
    assert {r.bytes_per_rank for r in rows} == {2 * (ranks - 1) * TOKENS * HIDDEN * 4 // ranks}
    specs = {s.name: s for s in exe.signatures["main"].params}
    experts = ("p_model_layers_0_mlp_experts_gate_up_proj",
               "p_model_layers_0_mlp_experts_down_proj")
    total = sum(weights[n].nbytes for n in experts)
    held = []
    for rank in range(ranks):
        parts = [shard_array(weights[n], specs[n].sharding, rank) for n in experts]
        held.append(sum(p.nbytes for p in parts))
        # whole experts: rank r holds experts r*E/p .. (r+1)*E/p - 1
        per_rank = 4 // ranks
        np.testing.assert_array_equal(
            parts[0], weights[experts[0]][rank * per_rank:(rank + 1) * per_rank])
    assert held == [total // ranks] * ranks
    router = specs["p_model_layers_0_mlp_gate_weight"]
    assert router.sharding.placement.entries[0].is_replicate()
    query = specs["p_model_layers_0_self_attn_q_proj_weight"]
    assert query.local_shape == (HIDDEN // ranks, HIDDEN)  # whole heads per rank


def test_one_expert_parallel_compile_serves_every_sequence_length():
    torch.manual_seed(0)
    model = tf.MixtralForCausalLM(_mixtral_config()).eval()
    seq = torch.export.Dim("seq", min=1, max=32)
    mod, weights = from_torch(model, (torch.randint(0, 128, (1, TOKENS)),),
                              dynamic_shapes=({1: seq},))
    # attention split by heads and the experts split, the sequence length symbolic
    exe = td.compile(moe.expert_parallel(base=_attention(2)).apply(set_device_meshes(mod, [(2,)])))
    for length in (1, 7, 32):
        ids = torch.randint(0, 128, (1, length))
        with torch.no_grad():
            want = model(ids, use_cache=False).logits.numpy()
        out = exe.run(ids.numpy(), params=weights, backend="emulate")
        np.testing.assert_allclose(out, want, atol=1e-4, rtol=0, err_msg=f"length {length}")


def test_the_comparison_prefers_expert_parallel(mixtral_block):
    mod, _, _, _ = mixtral_block
    meshed = set_device_meshes(mod, [(2,)])
    comparison = moe.compare(meshed)
    assert comparison.chosen == "expert"
    expert = moe.MoeComparison.collectives(comparison.expert)
    tensor = moe.MoeComparison.collectives(comparison.tensor)
    assert [r.collective for r in expert] == ["all_reduce"]
    # inside each expert (the fused gate|up weight split per segment), the down
    # projection's partial sums still carry the expert dimension: E times the bytes
    assert [r.collective for r in tensor] == ["all_reduce"]
    assert comparison.tensor.total_bytes_per_rank == 4 * comparison.expert.total_bytes_per_rank
    assert "<- chosen" in str(comparison).splitlines()[1]
    # expert-MLP work per token and rank: the sparse dispatch runs k / p = 1 expert MLP
    # (6 H I flops), the masked dense dispatch of the tensor plan E / p = 2
    assert comparison.expert_flops == 6 * HIDDEN * 96
    assert comparison.tensor_flops == 2 * 6 * HIDDEN * 96
    assert f"{6 * HIDDEN * 96:,}" in str(comparison).splitlines()[1]
    assert moe.choose_expert_plan(meshed).strategy == "expert"
    # the plan not chosen is correct too, from the fused weights as imported
    _, weights, x, want = mixtral_block
    exe = td.compile(moe.expert_tensor_parallel().apply(meshed))
    np.testing.assert_allclose(exe.run(x, params=weights, backend="emulate"), want,
                               atol=1e-4, rtol=0)


def test_a_plan_that_cannot_be_lowered_is_not_chosen(mixtral_block, monkeypatch):
    """A plan the module cannot be lowered with (GPT-OSS's prefill over a run-time prompt
    length with the experts' tensor plan) leaves the other; both refused is an error."""
    mod, _, _, _ = mixtral_block
    meshed = set_device_meshes(mod, [(2,)])
    apply = moe.MoePlan.apply

    def refuse(strategies):
        def patched(plan, mod, function="main"):
            if plan.strategy in strategies:
                raise td.errors.UnsupportedProgramError(f"no {plan.strategy} plan here")
            return apply(plan, mod, function)
        monkeypatch.setattr(moe.MoePlan, "apply", patched)

    refuse({"expert"})
    comparison = moe.compare(meshed)
    assert comparison.chosen == "tensor" and comparison.expert is None
    assert "no expert plan here" in comparison.refused["expert"]
    assert "expert parallel          cannot be lowered" in str(comparison)
    refuse({"expert", "tensor"})
    with pytest.raises(td.errors.UnsupportedProgramError, match="no expert plan here"):
        moe.compare(meshed)


def test_qwen2_moe_runs_expert_parallel_on_two_mpi_ranks():
    """Qwen2-MoE: q/k/v biases, and a dense shared expert with a sigmoid gate beside the
    routed experts (replicated here)."""
    torch.manual_seed(0)
    model = tf.Qwen2MoeForCausalLM(_qwen2_moe_config()).eval()
    ids = torch.randint(0, 128, (1, TOKENS))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits.numpy()
    mod, weights = from_torch(model, (ids,))
    assert [w.name for w in moe.expert_weights(mod)] == [
        "p_model_layers_0_mlp_experts_gate_up_proj", "p_model_layers_0_mlp_experts_down_proj"]
    annotated = moe.expert_parallel(base=_attention(2)).apply(set_device_meshes(mod, [(2,)]))
    rows = [r for r in td.comm_report(run_stages(annotated)["local_view"]).rows
            if r.collective != "local_slice"]
    assert [r.collective for r in rows] == ["all_reduce"] * 2
    out = td.compile(annotated).run(ids.numpy(), params=weights, backend="mpi")
    np.testing.assert_allclose(out, want, atol=1e-4, rtol=0)


def test_deepseek_v3_routing_converts_and_runs_expert_parallel():
    """DeepSeek-V3's router: sigmoid scores, a group mask built in place (scatter_,
    masked_fill with -inf), topk(sorted=False), an in-place normalisation; plus shared
    experts beside the routed ones."""
    torch.manual_seed(0)
    model, _ = _deepseek_v3()
    mod, weights, x, want = _import_block(model.eval().model.layers[1].mlp)
    assert [w.role for w in moe.expert_weights(mod)] == ["up", "down"]
    exe = td.compile(moe.expert_parallel().apply(set_device_meshes(mod, [(2,)])))
    np.testing.assert_allclose(exe.run(x, params=weights, backend="emulate"), want,
                               atol=1e-4, rtol=0)


def test_transposed_biased_experts_run_expert_parallel():
    """GPT-OSS stores its experts transposed ((E, H, 2I)), with biases and an
    interleaved gate: the same structure search finds the axes, and the biased
    batched matmuls are scheduled correctly."""
    torch.manual_seed(0)
    config = tf.GptOssConfig(vocab_size=128, hidden_size=HIDDEN, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             intermediate_size=96, num_local_experts=4, num_experts_per_tok=2)
    block = tf.GptOssForCausalLM(config).eval().model.layers[0].mlp
    for weight in block.parameters():  # the router starts at zero: break the ties
        torch.nn.init.normal_(weight, std=0.1)
    mod, weights, x, want = _import_block(block)
    assert moe.expert_weights(mod) == [
        moe.ExpertWeight("p_experts_gate_up_proj", 4, expert_dim=0, intermediate_dim=2,
                         role="up"),
        moe.ExpertWeight("p_experts_gate_up_proj_bias", 4, expert_dim=0, intermediate_dim=1,
                         role="up_bias"),
        moe.ExpertWeight("p_experts_down_proj", 4, expert_dim=0, intermediate_dim=1,
                         role="down"),
        moe.ExpertWeight("p_experts_down_proj_bias", 4, expert_dim=0, intermediate_dim=None,
                         role="down_bias"),
    ]
    tensor = {r.param: str(r.result) for r in moe.expert_tensor_parallel().rules(mod)}
    assert tensor["p_experts_down_proj_bias"] == "R"
    exe = td.compile(moe.expert_parallel().apply(set_device_meshes(mod, [(2,)])))
    # every expert weight and bias is split on the expert dimension
    specs = {s.name: s for s in exe.signatures["main"].params}
    for weight in moe.expert_weights(mod):
        assert specs[weight.name].local_shape[0] == 2, weight.name
    out = exe.run(x, params=weights, backend="emulate")[0]
    np.testing.assert_allclose(out, want, atol=1e-4, rtol=0)
