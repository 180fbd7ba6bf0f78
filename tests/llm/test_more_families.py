"""More transformers families on 2 MPI ranks (one of each kind on 4 as well): split by
structure, ideal collectives, same tokens.

Each family of :data:`hf_tiny.MORE` (post-norm blocks, softcapping, parallel attention and
MLP, partial rotary, latent attention, norms without weights, routed experts beside a
shared one, chunked attention...) with one decoder layer: ``presets.tensor_parallel()``
must split every decoder matrix that can be split (the latent-attention down-projections
and the routers stay whole by design), run the ideal collectives (one all-reduce per
attention block and one per MLP or MoE block, one for the vocabulary-parallel lookup;
a norm over split features adds its per-token statistics, counted apart), give
transformers' logits, and ``CausalLM.from_hf`` must generate transformers' greedy tokens.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import tvm_distx as td  # noqa: E402
from tvm_distx.llm.causal_lm import CausalLM  # noqa: E402
from tvm_distx.plans import presets  # noqa: E402

from hf_tiny import MORE, VOCAB, build, logits, tokens  # noqa: E402

#: Families tested with two layers: Gemma3 and GPT-OSS alternate sliding and full attention;
#: Llama 4's two MoE layers choose their expert plan per function.
LAYERS = {"gemma3_text": 2, "gpt_oss": 2, "llama4_text": 2}
#: Matrices each rank holds whole by design, per family (name fragments).
WHOLE_BY_DESIGN = {"minicpm3": ("q_a_proj", "kv_a_proj_with_mqa"),
                   "falcon_mqa": ("query_key_value_weight_seg1", "query_key_value_weight_seg2"),
                   "gpt_oss": ("router",),
                   "llama4_text": ("router",)}
#: Families whose attention and MLP outputs are summed before the residual add (no bias
#: between): one all-reduce serves both.
SHARED_ALL_REDUCE = {"falcon_mqa", "falcon_gqa"}
PROMPT, NEW_TOKENS = 8, 16


#: On 4 ranks, one family of each kind: (family, key/value matrices whole by design, as
#: they have fewer heads than ranks).
FOUR_RANKS = {
    "falcon_mqa": (),                       # multi-query: one key/value head, fused q|k|v
    "gemma2": ("k_proj", "v_proj"),         # grouped-query: 2 key/value heads
    "gpt_oss": ("k_proj", "v_proj"),        # mixture of experts, attention sinks
    "minicpm3": (),                         # latent attention
    "gpt_neox": (),                         # fused (heads, 3 * head_dim) q|k|v
}


@pytest.mark.parametrize("family", sorted(MORE))
def test_family_splits_ideally_and_equals_transformers(family):
    _splits_ideally_and_equals_transformers(family, 2)


@pytest.mark.parametrize("family", sorted(FOUR_RANKS))
def test_one_family_of_each_kind_on_four_ranks(family):
    _splits_ideally_and_equals_transformers(family, 4, FOUR_RANKS[family])


def _splits_ideally_and_equals_transformers(family: str, ranks: int, whole: tuple = ()):
    """The plan, the logits and the greedy tokens of ``family`` on ``ranks`` ranks; the
    matrices whose names hold a fragment of ``whole`` (or of :data:`WHOLE_BY_DESIGN`) stay
    whole."""
    layers = LAYERS.get(family, 1)
    model = build(family, layers=layers)
    ids = tokens(PROMPT, seed=5)
    mod, weights = td.from_torch(model, (torch.from_numpy(ids),))
    meshed = presets.set_device_meshes(mod, [(ranks,)])
    preset = presets.tensor_parallel()
    summary = preset.layers(meshed)
    by_design = WHOLE_BY_DESIGN.get(family, ()) + whole
    left = [name for layer in summary.layers for name, _ in layer.whole
            if not any(part in name for part in by_design)]
    assert not left, left
    assert summary.ideal, str(summary)
    # per decoder layer its attention and its MLP, and the embedding's lookup in the first
    names = [f"layer {i}" for i in range(layers)] + ["head"]
    assert [layer.name for layer in summary.layers] == names, str(summary)
    per_layer = 1 if family in SHARED_ALL_REDUCE else 2
    assert [layer.all_reduces for layer in summary.layers] == \
        [per_layer + 1] + [per_layer] * (layers - 1) + [0], str(summary)
    assert (summary.split_bytes == summary.matrix_bytes) == (not by_design), str(summary)
    got = td.compile(preset.apply(meshed)).run(ids, params=weights, backend="emulate")
    np.testing.assert_allclose(np.asarray(got), logits(model, ids), rtol=1e-4, atol=1e-4)

    prompt = np.random.default_rng(len(family)).integers(0, VOCAB, PROMPT, dtype=np.int64)
    with torch.no_grad():
        want = model.generate(torch.from_numpy(prompt[None, :]), max_new_tokens=NEW_TOKENS,
                              do_sample=False, eos_token_id=None, pad_token_id=0)[0].numpy()
    assert len(set(want[PROMPT:])) > 1  # a config whose greedy output is not one token
    with CausalLM.from_hf(model, num_ranks=ranks, max_length=PROMPT + NEW_TOKENS) as lm:
        out = lm.generate(prompt, max_new_tokens=NEW_TOKENS)
    np.testing.assert_array_equal(out[0], want)
