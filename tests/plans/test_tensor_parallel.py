"""presets.tensor_parallel(): Megatron plans found from the graph, checked and run on ranks.

No test names a layer: the plan must come out the same for transformers' Llama
names (q_proj, gate_proj, ...), a reference Llama's (wq, w1, ...), GPT-2's fused
Conv1D (c_attn) and a home-made block's (fc1, out_proj).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import tvm_distx as td  # noqa: E402
from tvm_distx.plans import presets  # noqa: E402
from tvm_distx.errors import RuleError  # noqa: E402
from tvm_distx.compiler.pipeline import run_stages  # noqa: E402
from tvm_distx.runtime import shard_array  # noqa: E402

from hf_tiny import build, logits, tokens  # noqa: E402
from reference_llama import ReferenceLlama  # noqa: E402
from transformer import Transformer  # noqa: E402


def _import(model, example):
    return td.from_torch(model, (torch.from_numpy(example) if isinstance(example, np.ndarray)
                                 else example,))


@pytest.fixture(scope="module")
def llama():
    model = build("llama")
    mod, weights = _import(model, tokens(8))
    return model, mod, weights


def _collectives(annotated) -> list[str]:
    rows = td.comm_report(run_stages(annotated)["local_view"]).rows
    return [r.collective for r in rows if r.collective != "local_slice"]


def _per_rank_weight_bytes(exe, weights, ranks) -> list[int]:
    specs = {s.name: s for s in exe.signatures["main"].params}
    return [sum(shard_array(value, specs[name].sharding, rank).nbytes
                for name, value in weights.items() if name in specs)
            for rank in range(ranks)]


# ------------------------------------------------------------------------- the plan
def test_llama_gets_megatron_placements_from_its_structure(llama):
    _, mod, _ = llama
    plan = presets.tensor_parallel().plan(presets.set_device_meshes(mod, [(2,)]))
    want = {}
    for layer in (0, 1):
        prefix = f"p_model_layers_{layer}_"
        for name in ("self_attn_q_proj", "self_attn_k_proj", "self_attn_v_proj",
                     "mlp_gate_proj", "mlp_up_proj"):
            want[f"{prefix}{name}_weight"] = "S[0]"  # (out, in): output features split
        for name in ("self_attn_o_proj", "mlp_down_proj"):
            want[f"{prefix}{name}_weight"] = "S[1]"  # input features split
    want["p_lm_head_weight"] = "S[0]"
    want["p_model_embed_tokens_weight"] = "S[0]"  # untied, 128 rows >= 2 x 8 tokens: vocab
    assert plan.placements() == want
    assert [(b.kind, b.row) for b in plan.blocks] == [
        ("attention", "p_model_layers_0_self_attn_o_proj_weight"),
        ("mlp", "p_model_layers_0_mlp_down_proj_weight"),
        ("attention", "p_model_layers_1_self_attn_o_proj_weight"),
        ("mlp", "p_model_layers_1_mlp_down_proj_weight")]
    assert plan.role("p_model_embed_tokens_weight").role == "vocab"
    assert "4 blocks" in str(plan) and "lm_head" in str(plan)


def test_kv_heads_fewer_than_ranks_stay_replicated_and_the_queries_split(llama):
    _, mod, _ = llama
    plan = presets.tensor_parallel().plan(presets.set_device_meshes(mod, [(4,)]))
    placements = plan.placements()
    assert placements["p_model_layers_0_self_attn_q_proj_weight"] == "S[0]"
    for name in ("k_proj", "v_proj"):
        role = plan.role(f"p_model_layers_0_self_attn_{name}_weight")
        assert role.role == "replicated" and "2 heads do not divide by 4" in role.reason


def test_an_attention_whose_heads_do_not_divide_stays_whole(llama):
    _, mod, _ = llama
    plan = presets.tensor_parallel().plan(presets.set_device_meshes(mod, [(8,)]))
    assert [b.kind for b in plan.blocks] == ["replicated", "mlp"] * 2  # 4 heads, 8 ranks
    assert plan.placements()["p_model_layers_0_mlp_down_proj_weight"] == "S[1]"
    assert "p_model_layers_0_self_attn_q_proj_weight" not in plan.placements()


def test_qwen2_biases_follow_their_linears():
    model = build("qwen2", layers=1)
    mod, _ = _import(model, tokens(8))
    placements = presets.tensor_parallel().plan(presets.set_device_meshes(mod, [(2,)])).placements()
    for name in ("q_proj", "k_proj", "v_proj"):
        assert placements[f"p_model_layers_0_self_attn_{name}_bias"] == "S[0]"
    assert "p_model_layers_0_self_attn_o_proj_bias" not in placements  # o_proj has none


def test_the_preset_validates_its_mesh(llama):
    _, mod, _ = llama
    with pytest.raises(RuleError, match="no such mesh axis"):
        presets.tensor_parallel(model_axis=1)
    with pytest.raises(RuleError, match="no device mesh") as err:
        presets.tensor_parallel().apply(mod)
    assert "set_device_meshes" in str(err.value)
    with pytest.raises(RuleError, match="mesh_ndim=1"):
        presets.tensor_parallel().apply(presets.set_device_meshes(mod, [(2, 2)]))


def test_overrides_win(llama):
    _, mod, _ = llama
    preset = presets.tensor_parallel().override({"*lm_head_weight": "R"})
    rules = {r.param: str(r.result) for r in preset.rules(presets.set_device_meshes(mod, [(2,)]))}
    assert rules["p_lm_head_weight"] == "R"
    assert rules["p_model_layers_0_mlp_down_proj_weight"] == "S[1]"


# ------------------------------------------------------------------------ on ranks
@pytest.mark.parametrize("ranks", [2, 4])
def test_llama_runs_with_ideal_collectives_and_a_pth_of_the_weights(llama, ranks):
    model, mod, weights = llama
    annotated = presets.tensor_parallel().apply(presets.set_device_meshes(mod, [(ranks,)]))
    # the embedding's lookup, then one per attention and one per MLP
    assert _collectives(annotated) == ["all_reduce"] * 5
    exe = td.compile(annotated)
    ids = tokens(8, seed=ranks)
    np.testing.assert_allclose(exe.run(ids, params=weights, backend="mpi"), logits(model, ids),
                               atol=1e-4, rtol=0)
    # replicated by design: the norms, and (4 ranks) the 2 KV heads; the embedding is split
    def whole(name):
        return ("norm" in name
                or (ranks == 4 and ("k_proj" in name or "v_proj" in name)))

    replicated = sum(v.nbytes for n, v in weights.items() if whole(n))
    split = sum(v.nbytes for n, v in weights.items() if not whole(n))
    assert _per_rank_weight_bytes(exe, weights, ranks) == [replicated + split // ranks] * ranks


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_other_llama_families_run_tensor_parallel(family):
    model = build(family, layers=1)
    mod, weights = _import(model, tokens(8))
    annotated = presets.tensor_parallel().apply(presets.set_device_meshes(mod, [(2,)]))
    assert _collectives(annotated) == ["all_reduce"] * 3  # with the embedding's
    ids = tokens(8, seed=7)
    backend = "disco" if family == "mistral" else "mpi"
    np.testing.assert_allclose(td.compile(annotated).run(ids, params=weights, backend=backend),
                               logits(model, ids), atol=1e-4, rtol=0)


def test_gpt2_fused_qkv_is_split_per_segment_and_its_tied_head_split_with_its_lookups():
    model = build("gpt2", layers=1)
    mod, weights = _import(model, tokens(8))
    preset = presets.tensor_parallel()
    plan = preset.plan(preset.prepare(presets.set_device_meshes(mod, [(2,)])))
    # the LM head is tied to the token embedding: one parameter, the table, split on the
    # vocabulary for both its lookups and the head
    assert "p_lm_head_weight" not in weights
    head = plan.role("p_transformer_wte_weight")
    assert head.role == "lm_head" and head.axis == 0 and head.lookup and "tied" in head.reason
    assert plan.role("p_transformer_wpe_weight").role == "replicated"  # positions
    segments = [n for n, p in plan.placements().items() if "c_attn_weight_seg" in n]
    assert len(segments) == 3 and {plan.placements()[n] for n in segments} == {"S[1]"}
    annotated = preset.apply(presets.set_device_meshes(mod, [(2,)]))
    assert _collectives(annotated) == ["all_reduce"] * 3  # the lookup's, attention's, MLP's
    ids = tokens(8, seed=8)
    np.testing.assert_allclose(td.compile(annotated).run(ids, params=weights, backend="mpi"),
                               logits(model, ids), atol=1e-4, rtol=0)


def test_a_reference_llama_and_a_home_made_block_get_the_same_structure():
    torch.manual_seed(0)
    llama = ReferenceLlama(layers=1).eval()
    mod, weights = _import(llama, tokens(8))
    plan = presets.tensor_parallel().plan(presets.set_device_meshes(mod, [(2,)]))
    assert plan.placements() == {
        "p_layers_0_attention_wq_weight": "S[0]", "p_layers_0_attention_wk_weight": "S[0]",
        "p_layers_0_attention_wv_weight": "S[0]", "p_layers_0_attention_wo_weight": "S[1]",
        "p_layers_0_feed_forward_w1_weight": "S[0]", "p_layers_0_feed_forward_w3_weight": "S[0]",
        "p_layers_0_feed_forward_w2_weight": "S[1]", "p_output_weight": "S[0]",
        "p_tok_embeddings_weight": "S[0]"}
    block = Transformer(layers=1).eval()
    x = torch.randn(2, 16, 256)
    mod, weights = _import(block, x)
    annotated = presets.tensor_parallel().apply(presets.set_device_meshes(mod, [(2,)]))
    assert _collectives(annotated) == ["all_reduce"] * 2
    with torch.no_grad():
        want = block(x).numpy()
    np.testing.assert_allclose(td.compile(annotated).run(x.numpy(), params=weights,
                                                          backend="emulate"),
                               want, atol=1e-4, rtol=0)


def test_mixtral_gets_experts_split_by_the_moe_plan():
    model = build("mixtral", layers=1)
    mod, weights = _import(model, tokens(8))
    annotated = presets.tensor_parallel().apply(presets.set_device_meshes(mod, [(2,)]))
    # the embedding's, the attention's and the experts'
    assert _collectives(annotated) == ["all_reduce"] * 3
    ids = tokens(8, seed=9)
    np.testing.assert_allclose(td.compile(annotated).run(ids, params=weights, backend="mpi"),
                               logits(model, ids), atol=1e-4, rtol=0)


def test_the_summary_counts_collectives_against_the_ideal(llama):
    _, mod, _ = llama
    text = presets.tensor_parallel().summary(presets.set_device_meshes(mod, [(2,)]))
    assert ("collectives: 5 all-reduce for 4 split blocks and 1 vocabulary-parallel "
            "embedding(s) (ideal: one each)") in text
    assert "extra:" not in text


def test_the_summary_shows_what_an_even_split_of_fused_qkv_costs():
    """Without the per-segment cut, GPT-2's c_attn split evenly needs gathers: listed."""
    model = build("gpt2", layers=1)
    mod, _ = _import(model, tokens(8))
    meshed = presets.set_device_meshes(mod, [(2,)])
    text = presets.TensorParallel(split_fused=False).summary(meshed)
    assert "extra: all_gather" in text
    assert "extra:" not in presets.tensor_parallel().summary(meshed)


def test_the_per_layer_summary_places_weights_and_collectives_in_their_layers(llama):
    """Llama, 2 layers: each layer splits its own q/k/v/o and gate/up/down and runs two
    all-reduces, the ideal, and the first also the embedding's lookup (split on its
    vocabulary, one all-reduce); the LM head is its own row."""
    _, mod, _ = llama
    summary = presets.tensor_parallel().layers(presets.set_device_meshes(mod, [(2,)]))
    assert [layer.name for layer in summary.layers] == ["layer 0", "layer 1", "head"]
    assert summary.ideal and [layer.all_reduces for layer in summary.layers] == [3, 2, 0]
    assert [layer.ideal for layer in summary.layers] == [3, 2, 0]
    for index, layer in enumerate(summary.layers[:2]):
        split = {name: placement for name, placement, _ in layer.split
                 if name != "p_model_embed_tokens_weight"}
        assert len(split) == 7 and all(f"layers_{index}_" in name for name in split)
        assert split[f"p_model_layers_{index}_mlp_down_proj_weight"] == "S[1]"
    assert ("p_model_embed_tokens_weight", "S[0]") in \
        [(name, placement) for name, placement, _ in summary.layers[0].split]
    assert [name for name, _, _ in summary.layers[2].split] == ["p_lm_head_weight"]
    assert "layer 1: 2 all-reduce(s), ideal 2 (ideal)" in str(summary)


def test_the_per_layer_summary_flags_extra_collectives_in_the_layer_that_has_them():
    """GPT-2 with c_attn split evenly (no per-segment cut): each layer gathers q|k|v."""
    model = build("gpt2", layers=2)
    mod, _ = _import(model, tokens(8))
    meshed = presets.set_device_meshes(mod, [(2,)])
    summary = presets.TensorParallel(split_fused=False).layers(meshed)
    assert not summary.ideal
    assert all(any(r.collective == "all_gather" for r in layer.extra)
               for layer in summary.layers[:2])
    assert "extra: all_gather" in str(summary)
    assert presets.tensor_parallel().layers(meshed).ideal


def test_a_moe_layer_counts_one_all_reduce_with_its_attention():
    model = build("mixtral", layers=2)
    mod, _ = _import(model, tokens(8))
    summary = presets.tensor_parallel().layers(presets.set_device_meshes(mod, [(2,)]))
    assert summary.ideal and [layer.ideal for layer in summary.layers] == [3, 2, 0]
    experts = [name for name, _, reason in summary.layers[1].split if "experts" in reason]
    assert experts and all("layers_1_" in name for name in experts)


# --------------------------------------------------------------------------- honest plans
class _Residual(torch.nn.Module):
    """``x + down(relu(up(x)))``: one column -> row block."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, hidden, bias=False)
        self.down = torch.nn.Linear(hidden, width, bias=False)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class _Blocks(torch.nn.Sequential):
    """Residual MLP blocks of the given hidden widths over 64 features."""

    def __init__(self, *hidden: int) -> None:
        super().__init__(*[_Residual(64, h) for h in hidden])


def _planned(*hidden: int, **options):
    torch.manual_seed(0)
    mod, _ = td.from_torch(_Blocks(*hidden).eval(), (torch.randn(4, 64),))
    meshed = presets.set_device_meshes(mod, [(2,)])
    return presets.tensor_parallel(**options), meshed


def test_the_plan_counts_the_bytes_it_splits_and_names_the_block_it_leaves_whole():
    """Block 1 splits; block 2's 63 hidden features do not divide by 2 ranks: whole."""
    preset, meshed = _planned(128, 63)
    plan = preset.plan(meshed)
    split, whole = 2 * 64 * 128 * 4, 2 * 64 * 63 * 4
    assert (plan.split_bytes, plan.matrix_bytes) == (split, split + whole)
    assert f"weights split: {split / (split + whole):.0%} of the matrices' bytes" in str(plan)
    assert "p_1_up_weight: replicated (no column of the block divides by 2 ranks)" in str(plan)
    summary = preset.layers(meshed)
    assert (summary.split_bytes, summary.matrix_bytes) == (split, split + whole)


def test_a_plan_that_splits_less_than_half_warns_or_with_strict_raises(caplog):
    preset, meshed = _planned(16, 63, 63)
    with caplog.at_level("WARNING", logger="tvm_distx.plans.tensor_parallel"):
        annotated = preset.apply(meshed)
    assert "splits less than half of the matrices" in caplog.text
    assert "presets.from_hf(model)" in caplog.text  # the hint
    assert annotated is not None
    strict, _ = _planned(16, 63, 63, strict=True)
    with pytest.raises(RuleError, match=r"splits less than half(.|\n)*hint: presets.from_hf"):
        strict.apply(meshed)


def test_a_plan_that_splits_nothing_raises_before_compiling():
    preset, meshed = _planned(63)
    for call in (preset.plan, preset.apply):
        with pytest.raises(RuleError, match=r"tensor_parallel\(\) splits no matrix of 'main' "
                                            r"on 2 ranks \(weights split: 0%"):
            call(meshed)
