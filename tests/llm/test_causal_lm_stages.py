"""Pipeline stages for causal LMs: ``CausalLM.from_*(..., stages=...)`` and ``--stages``.

A decoder's layers are cut into consecutive stages, each a block of consecutive ranks
with tensor parallelism inside; the activations move from stage to stage (a prompt of
run-time length included). Tokens must equal transformers' greedy ones, on 2 stages of
1 rank and of 2 ranks, in a session and from an exported bundle, and from the compile
cache; each rank must hold only its stage's weights and its layers' cache.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import tvm_distx as td  # noqa: E402
from tvm_distx.errors import ArgumentError  # noqa: E402
from tvm_distx.llm.causal_lm import CausalLM  # noqa: E402
from tvm_distx.plans import presets  # noqa: E402
from tvm_distx.plans.stages import layer_prefix, pipeline_stages_of  # noqa: E402

from hf_tiny import build, greedy, prompt_ids  # noqa: E402

NEW_TOKENS = 10
LAYERS = 4


# ---------------------------------------------------------------------- the plan alone
def test_the_layers_are_found_from_the_weight_names_of_any_family():
    llama = ["p_model_model_embed_tokens_weight", "p_model_model_norm_weight",
             "p_model_lm_head_weight"] + [f"p_model_model_layers_{i}_{w}" for i in range(3)
                                          for w in ("self_attn_q_proj_weight", "mlp_up_weight")]
    assert layer_prefix(llama) == ("p_model_model_layers_", 3)
    gpt2 = ["p_model_transformer_wte_weight"] + [f"p_model_transformer_h_{i}_attn_c_attn_weight"
                                                  for i in range(2)]
    assert layer_prefix(gpt2) == ("p_model_transformer_h_", 2)
    # the experts inside each layer name fewer weights than the layers
    moe = [f"p_model_model_layers_{i}_mlp_experts_{e}_w{k}" for i in range(2) for e in range(4)
           for k in (1, 2)] + [f"p_model_model_layers_{i}_self_attn_q_proj_weight"
                               for i in range(2)]
    assert layer_prefix(moe) == ("p_model_model_layers_", 2)
    assert layer_prefix(["p_weight", "p_bias"]) is None
    assert layer_prefix(["p_a_1_w", "p_a_2_w"]) is None  # not numbered from 0


def test_stage_counts_split_the_layers_and_need_a_rank_count_they_divide():
    base = presets.tensor_parallel()
    plan = pipeline_stages_of(2, num_ranks=4, num_layers=5, base=base)
    assert plan.layers == (3, 2) and plan.ranks_per_stage == 2 and plan.meshes() == [(2,), (2,)]
    assert [plan.stage_of_layer(i) for i in range(5)] == [0, 0, 0, 1, 1]
    assert pipeline_stages_of([1, 4], num_ranks=2, num_layers=5, base=base).layers == (1, 4)
    assert pipeline_stages_of(1, num_ranks=2, num_layers=5, base=base) is None
    with pytest.raises(ArgumentError, match=r"stages=3\): 3 stages cannot share 4 ranks"):
        pipeline_stages_of(3, num_ranks=4, num_layers=5, base=base)
    with pytest.raises(ArgumentError, match=r"the stages hold 4 layers, the model has 5"):
        pipeline_stages_of([2, 2], num_ranks=2, num_layers=5, base=base)
    with pytest.raises(ArgumentError, match=r"stages=6\): the model has 5 layers"):
        pipeline_stages_of(6, num_ranks=6, num_layers=5, base=base)
    with pytest.raises(ArgumentError, match="not a stage count"):
        pipeline_stages_of(True, num_ranks=2, num_layers=5, base=base)


# ---------------------------------------------------------------------- runs
@pytest.fixture(scope="module")
def llama():
    return build("llama", layers=LAYERS)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("stages-cache")


@pytest.fixture(scope="module")
def two_stages(llama, cache_dir):
    lm = CausalLM.from_hf(llama, num_ranks=2, stages=2, max_length=32, compile_cache=cache_dir)
    yield lm
    lm.close()


def test_two_stages_of_one_rank_generate_transformers_tokens(llama, two_stages):
    for seed, length in ((1, 5), (2, 9)):  # two prompt lengths: one program, run-time sizes
        prompt = prompt_ids(length, seed=seed)
        out = two_stages.generate(prompt[None, :], max_new_tokens=NEW_TOKENS)
        np.testing.assert_array_equal(out[0], greedy(llama, prompt, NEW_TOKENS))


def test_each_stage_holds_its_layers_weights_and_cache_only(llama, two_stages):
    single = sum(t.numel() * t.element_size() for t in llama.state_dict().values()
                 if True) - llama.lm_head.weight.numel() * 4 * (
                     llama.lm_head.weight is llama.model.embed_tokens.weight)
    held = two_stages.weight_bytes_per_rank
    assert len(held) == 2 and sum(held) == single  # nothing held twice
    layer = sum(t.numel() * 4 for n, t in llama.named_parameters() if ".layers.0." in n)
    assert all(h >= 2 * layer for h in held) and max(held) < single - layer
    entries = two_stages.exe.module.attrs["tvm_distx.rank_entries"]["decode"]
    rank0, rank1 = (two_stages.exe.module[e] for e in entries)
    names = [{p.name for p in f.params} for f in (rank0, rank1)]
    assert {f"key_{i}" for i in (0, 1)} <= names[0] and not {"key_2", "key_3"} & names[0]
    assert {f"key_{i}" for i in (2, 3)} <= names[1] and not {"key_0", "key_1"} & names[1]


def test_a_bundle_of_stages_and_a_compile_cache_hit_generate_the_same_tokens(
        llama, two_stages, cache_dir, tmp_path):
    prompt = prompt_ids(6, seed=4)
    expected = greedy(llama, prompt, NEW_TOKENS)
    two_stages.export(tmp_path / "bundle")
    with CausalLM.from_bundle(tmp_path / "bundle") as lm:
        np.testing.assert_array_equal(lm.generate(prompt[None, :], NEW_TOKENS)[0], expected)
    with CausalLM.from_hf(llama, num_ranks=2, stages=2, max_length=32,
                          compile_cache=cache_dir) as again:
        assert again.cached_bundle is not None  # started from the cache
        np.testing.assert_array_equal(again.generate(prompt[None, :], NEW_TOKENS)[0], expected)


def test_two_stages_of_two_ranks_split_each_stage_and_give_the_same_logits(llama):
    prompt = prompt_ids(7, seed=3)
    with CausalLM.from_hf(llama, num_ranks=4, stages=[1, 3], max_length=32,
                          compile_cache=False) as lm:
        np.testing.assert_array_equal(lm.generate(prompt[None, :], NEW_TOKENS)[0],
                                      greedy(llama, prompt, NEW_TOKENS))
        held = lm.weight_bytes_per_rank
        assert held[0] == held[1] and held[2] == held[3] and held[0] < held[2]
        cache = lm.cache
        logits, *_ = lm.exe.run(prompt[None, :], np.arange(7), *cache.zeros(),
                                params=lm.weights, function="prefill", backend="mpi")
    with torch.no_grad():
        expected = llama(torch.from_numpy(prompt[None, :])).logits[0, -1].numpy()
    np.testing.assert_allclose(logits[0, -1], expected, rtol=1e-4, atol=1e-4)


def test_a_family_with_other_names_runs_in_stages():
    model = build("qwen2", layers=2)
    prompt = prompt_ids(5, seed=6)
    with CausalLM.from_hf(model, num_ranks=2, stages=2, max_length=24,
                          compile_cache=False) as lm:
        np.testing.assert_array_equal(lm.generate(prompt[None, :], NEW_TOKENS)[0],
                                      greedy(model, prompt, NEW_TOKENS))


def test_stages_that_do_not_fit_the_ranks_are_refused_before_the_export(llama):
    with pytest.raises(ArgumentError, match=r"stages=3\): 3 stages cannot share 2 ranks") as err:
        CausalLM.from_hf(llama, num_ranks=2, stages=3, compile_cache=False)
    assert "a rank count that is a multiple of 3" in err.value.hint
