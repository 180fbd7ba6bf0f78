"""presets.from_hf(): transformers' own tensor-parallel plans, as our placements."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import tvm_distx as td  # noqa: E402
from tvm_distx.plans import presets  # noqa: E402
from tvm_distx.errors import RuleError  # noqa: E402
from tvm_distx.plans.hf import HFPlan  # noqa: E402
from tvm_distx.compiler.pipeline import run_stages  # noqa: E402

from hf_tiny import build, logits, tokens  # noqa: E402


def _imported(family: str, layers: int = 1):
    model = build(family, layers=layers)
    mod, weights = td.from_torch(model, (torch.from_numpy(tokens(8)),))
    return model, presets.set_device_meshes(mod, [(2,)]), weights


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_the_hf_plan_gives_the_placements_the_graph_gives(family):
    model, meshed, _ = _imported(family)
    from_plan = presets.from_hf(model).placements(meshed)
    assert from_plan == presets.tensor_parallel().plan(meshed).placements()
    assert from_plan["p_model_layers_0_self_attn_o_proj_weight"] == "S[1]"  # rowwise
    assert from_plan["p_lm_head_weight"] == "S[0]"  # the class's colwise_gather_output


def test_a_config_alone_gives_the_base_model_plan():
    model, meshed, _ = _imported("llama")
    from_config = presets.from_hf(model.config).placements(meshed)
    from_model = presets.from_hf(model).placements(meshed)
    assert from_config == {k: v for k, v in from_model.items() if k != "p_lm_head_weight"}


def test_llama_from_its_hf_plan_runs_on_two_mpi_ranks():
    model, meshed, weights = _imported("llama", layers=2)
    annotated = presets.from_hf(model).apply(meshed)
    rows = td.comm_report(run_stages(annotated)["local_view"]).rows
    # the vocabulary-parallel embedding's lookup, then one per attention block and per MLP
    assert [r.collective for r in rows] == ["all_reduce"] * 5
    ids = tokens(8, seed=11)
    np.testing.assert_allclose(td.compile(annotated).run(ids, params=weights, backend="mpi"),
                               logits(model, ids), atol=1e-4, rtol=0)


def test_mixtral_from_its_hf_plan_splits_the_experts():
    model, meshed, weights = _imported("mixtral")
    annotated = presets.from_hf(model).apply(meshed)
    rows = td.comm_report(run_stages(annotated)["local_view"]).rows
    assert [r.collective for r in rows if r.collective != "local_slice"] == ["all_reduce"] * 3
    ids = tokens(8, seed=12)
    np.testing.assert_allclose(td.compile(annotated).run(ids, params=weights, backend="emulate"),
                               logits(model, ids), atol=1e-4, rtol=0)


def test_gpt2_has_no_hf_plan_and_the_error_says_what_to_use():
    with pytest.raises(RuleError, match="no base_model_tp_plan") as err:
        presets.from_hf(build("gpt2", layers=1))
    assert "presets.tensor_parallel()" in str(err.value)


def test_a_style_we_cannot_honour_is_named_with_its_module():
    with pytest.raises(RuleError, match="'sequence_parallel' of module 'model.norm'"):
        HFPlan((("model.norm", "sequence_parallel"),))
    with pytest.raises(RuleError, match="unknown parallel style 'diagonal'"):
        HFPlan((("model.layers.*.mlp.up_proj", "diagonal"),))
