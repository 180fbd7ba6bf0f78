"""Greedy generation on 2 (and 4) MPI ranks equals transformers', token for token, per family.

Every family of the tensor-parallel matrix (``tests/plans/test_hf_matrix.py``) is served by
``CausalLM.from_hf`` under ``presets.tensor_parallel()`` on a persistent session, the
key-value caches kept on the ranks, and generates 32 new tokens; transformers'
``generate(do_sample=False)`` must give the same ones. One decoder layer per model
keeps the compile short; the plan and the cache are the same per layer.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import tvm

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tvm_distx.compiler.schedule import AS_WRITTEN, RULE_ATTR  # noqa: E402
from tvm_distx.layout.rules import pattern_entries  # noqa: E402
from tvm_distx.llm.causal_lm import CausalLM  # noqa: E402
from tvm_distx.plans import presets  # noqa: E402
from tvm_distx.plans.patterns import Preset  # noqa: E402

from hf_tiny import VOCAB, build  # noqa: E402

NEW_TOKENS = 32
PROMPT = 6
#: the experts' dispatch cannot move a symbolic prompt length yet: their prefill is static
STATIC_PROMPT = {"mixtral", "qwen2_moe", "deepseek_v3"}

CASES = [(family, 2) for family in ("llama", "qwen2", "mistral", "gpt2", "mixtral",
                                      "qwen2_moe", "phi3", "gemma", "qwen3", "opt",
                                      "deepseek_v3")]
CASES += [("qwen3", 4)]  # GPT-2 on 4 ranks: tests/frontend/test_decoder.py


@pytest.mark.parametrize("family, ranks", CASES, ids=[f"{f}-{r}" for f, r in CASES])
def test_greedy_tokens_equal_transformers(family, ranks):
    model = build(family, layers=1)
    prompt = np.random.default_rng(len(family)).integers(0, VOCAB, PROMPT, dtype=np.int64)
    with torch.no_grad():
        want = model.generate(torch.from_numpy(prompt[None, :]), max_new_tokens=NEW_TOKENS,
                              do_sample=False, eos_token_id=None, pad_token_id=0)[0].numpy()
    static = PROMPT if family in STATIC_PROMPT else None
    with CausalLM.from_hf(model, num_ranks=ranks, max_length=PROMPT + NEW_TOKENS,
                          prompt_length=static) as lm:
        # every kernel of prefill and decode runs one of our schedules, none TVM's default
        # (a router's top-k and scatter are library calls and loops, built as written)
        rules = {gv.name_hint: str(f.attrs[RULE_ATTR]) if f.attrs is not None
                 and RULE_ATTR in f.attrs else None
                 for gv, f in lm.exe.built.functions.items()
                 if isinstance(f, tvm.tirx.PrimFunc)}
        unscheduled = sorted(name for name, rule in rules.items() if rule is None)
        assert not unscheduled, unscheduled
        as_written = sorted(name for name, rule in rules.items() if rule == AS_WRITTEN)
        assert all(name.startswith(("topk", "scatter_elements")) for name in as_written), \
            as_written
        out = lm.generate(prompt, max_new_tokens=NEW_TOKENS)
        assert lm.stats.new_tokens == NEW_TOKENS - 1  # the first token comes from the prefill
    np.testing.assert_array_equal(out[0], want)


#: A hand-written plan in Megatron's placements for Llama's names: columns, then rows.
MEGATRON_BY_NAME = Preset(pattern_entries({
    "*_q_proj_weight": "S[0]", "*_k_proj_weight": "S[0]", "*_v_proj_weight": "S[0]",
    "*_o_proj_weight": "S[1]", "*_gate_proj_weight": "S[0]", "*_up_proj_weight": "S[0]",
    "*_down_proj_weight": "S[1]"}))


@pytest.mark.parametrize("plan", ["from_hf", "tensor_parallel", "by_name"])
def test_from_hf_takes_any_plan(plan):
    """transformers' own plan, ours by structure, and a preset by name give the same tokens."""
    model = build("llama", layers=1)
    preset = {"from_hf": lambda: presets.from_hf(model),
              "tensor_parallel": presets.tensor_parallel,
              "by_name": lambda: MEGATRON_BY_NAME}[plan]()
    prompt = np.random.default_rng(3).integers(0, VOCAB, PROMPT, dtype=np.int64)
    with torch.no_grad():
        want = model.generate(torch.from_numpy(prompt[None, :]), max_new_tokens=8,
                              do_sample=False, eos_token_id=None, pad_token_id=0)[0].numpy()
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    with CausalLM.from_hf(model, num_ranks=2, backend="emulate", max_length=PROMPT + 8,
                          plan=preset) as lm:
        out = lm.generate(prompt, max_new_tokens=8)
        # every plan splits the decoder's matrices: no rank holds three quarters of the model
        assert max(lm.weight_bytes_per_rank) < 0.75 * whole, (lm.weight_bytes_per_rank, whole)
    np.testing.assert_array_equal(out[0], want)
