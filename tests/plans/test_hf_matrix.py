"""Every family, both plans, 2 and 4 MPI ranks and disco: logits equal transformers'.

For each family ``presets.tensor_parallel()`` is compiled once per rank count and
run on MPI (and on disco with 2 ranks; the later families on 2 MPI ranks and 4
emulated ones, see :data:`EVERY_BACKEND`); ``presets.from_hf(model)`` must give the
same annotated module on 2 and 4 ranks where transformers ships a plan (GPT-2
and OPT ship none, and ``from_hf`` says so; on 4 ranks both keep the 2 key/value
heads whole, where transformers' own plan would split them). Token embeddings
are vocabulary parallel in both (transformers' implicit ``embed_tokens:
embedding_rowwise``); a table tied to the LM head is split on the vocabulary
once, for its lookups and the head.
Each compile is also checked for its collectives: one all-reduce per attention
block and one per MLP or MoE layer, one for the embedding's lookup, nothing
else. The maximum errors are recorded as test properties
(``--junitxml``) for the README's table.
"""

from __future__ import annotations

import logging
import sys
from fnmatch import fnmatchcase as fnmatch
from pathlib import Path

import numpy as np
import pytest
import tvm

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import tvm_distx as td  # noqa: E402
from tvm_distx.plans import presets  # noqa: E402
from tvm_distx.errors import RuleError  # noqa: E402
from tvm_distx.plans.moe_dispatch import experts_calls  # noqa: E402
from tvm_distx.compiler.pipeline import run_stages  # noqa: E402

from hf_tiny import build, logits, tokens  # noqa: E402

FAMILIES = ["llama", "qwen2", "mistral", "gpt2", "mixtral", "qwen2_moe", "phi3", "gemma",
            "qwen3", "opt", "deepseek_v3"]
#: Families run on every backend: 2 and 4 MPI ranks and disco. The others run on 2 MPI
#: ranks and 4 emulated ones (the same rank programs, in threads): the backends are the
#: same code for every family, and each launch costs seconds on a 2-core test machine.
EVERY_BACKEND = ("llama", "qwen2", "mistral", "gpt2", "mixtral", "qwen2_moe")
#: Families with a sparse MLP: planned expert parallel, with the sparse expert dispatch.
MOE = ("mixtral", "qwen2_moe", "deepseek_v3")
#: Families whose config ships no ``base_model_tp_plan``.
NO_HF_PLAN = ("gpt2", "opt")
#: Every family's token embedding is vocabulary parallel (128 rows >= 2 x 8 tokens): 1/p
#: of the table per rank, and one all-reduce more, of the lookup. GPT-2, Gemma and OPT tie
#: it to the LM head: the one table is split on the vocabulary for both.


#: Weights every rank holds whole by design, per family (globs over parameter names),
#: beside vectors (norms, row-parallel biases) and position tables.
_WHOLE = {
    # routers, and Qwen2-MoE's one-output shared-expert gate
    "mixtral": ("*mlp_gate_weight",),
    "qwen2_moe": ("*mlp_gate_weight", "*shared_expert_gate_weight"),
    # multi-head latent attention: the low-rank down projections of the queries and of
    # the keys/values (with the rotary key shared by every head) are read whole by
    # norms and by every head; the router
    "deepseek_v3": ("*q_a_proj_weight*", "*kv_a_proj_with_mqa_weight*", "*mlp_gate_weight"),
}
#: On 4 ranks, the 2 key/value heads stay whole (each rank slices the one it needs).
_WHOLE_ON_4 = {"llama": ("*k_proj_weight", "*v_proj_weight", "*k_proj_bias", "*v_proj_bias"),
               "phi3": ("*qkv_proj_weight_seg1", "*qkv_proj_weight_seg2")}
for _name in ("qwen2", "mistral", "mixtral", "qwen2_moe", "gemma", "qwen3"):
    _WHOLE_ON_4[_name] = _WHOLE_ON_4["llama"]


def _replicated_by_design(name: str, value: np.ndarray, family: str, ranks: int) -> bool:
    """Whether every rank holds ``name`` whole by design (see :data:`_WHOLE`)."""
    globs = _WHOLE.get(family, ()) + (_WHOLE_ON_4.get(family, ()) if ranks == 4 else ())
    return value.ndim == 1 or "wpe" in name or "position" in name \
        or any(fnmatch(name, g) for g in globs)


def _check_weight_bytes(family, exe, weights, ranks):
    """Each rank holds 1/p of every other weight, and whole copies of those above only."""
    from tvm_distx.runtime import shard_array

    specs = {s.name: s for s in exe.signatures["main"].params}
    bound = exe.derivations.get("main").bind(weights) if exe.derivations.get("main") else weights
    for rank in range(ranks):
        for name, value in bound.items():
            if name not in specs:
                continue
            held = shard_array(value, specs[name].sharding, rank).nbytes
            if _replicated_by_design(name, value, family, ranks):
                continue
            assert held * ranks == value.nbytes, f"{family}: rank {rank} holds {held} of " \
                f"{value.nbytes} bytes of {name}"


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    model = build(request.param, layers=1)
    mod, weights = td.from_torch(model, (torch.from_numpy(tokens(8)),))
    return request.param, model, mod, weights


@pytest.mark.parametrize("ranks", [2, 4])
def test_tensor_parallel_and_the_hf_plan_run_equal_to_transformers(family, ranks,
                                                                   record_property, caplog):
    name, model, mod, weights = family
    meshed = presets.set_device_meshes(mod, [(ranks,)])
    annotated = presets.tensor_parallel().apply(meshed)
    if name in NO_HF_PLAN:
        with pytest.raises(RuleError, match="no base_model_tp_plan"):
            presets.from_hf(model)
    else:  # on 4 ranks both keep the 2 key/value heads whole; both split a tied table once
        hf_plan = presets.from_hf(model)
        if name == "qwen2_moe":  # transformers' plan leaves the shared expert whole; ours splits it
            hf_plan = hf_plan.override({"*shared_expert_gate_proj_weight": "S[0]",
                                        "*shared_expert_up_proj_weight": "S[0]",
                                        "*shared_expert_down_proj_weight": "S[1]"})
        if name == "deepseek_v3":  # transformers' plan leaves the attention whole; ours
            # splits the heads (the up projections of the latent query and key/value)
            hf_plan = hf_plan.override({"*q_b_proj_weight": "S[0]", "*kv_b_proj_weight": "S[0]",
                                        "*self_attn_o_proj_weight": "S[1]"})
        tvm.ir.assert_structural_equal(hf_plan.apply(meshed), annotated)
    rows = td.comm_report(run_stages(annotated)["local_view"]).rows
    # the vocabulary-parallel embedding's lookup, then the attention's and the MLP's
    assert [r.collective for r in rows if r.collective != "local_slice"] == ["all_reduce"] * 3
    if name in MOE:  # expert parallel, each rank computing only the pairs routed to its experts
        assert [k.experts for _, _, k in experts_calls(annotated)] == [4], name
    with caplog.at_level(logging.WARNING, logger="tvm_distx"):
        exe = td.compile(annotated)
    # every kernel builds with our schedules (OPT's boolean causal mask once did not)
    assert "does not build" not in caplog.text and "crashed" not in caplog.text, caplog.text
    _check_weight_bytes(name, exe, weights, ranks)
    ids = tokens(8, seed=ranks)
    want = logits(model, ids)
    backend = "mpi" if ranks == 2 or name in EVERY_BACKEND else "emulate"
    got = exe.run(ids, params=weights, backend=backend)
    record_property(f"max_abs_error_{backend}", float(np.abs(got - want).max()))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0,
                               err_msg=f"{name} on {ranks} {backend} ranks")
    if ranks == 2 and name in EVERY_BACKEND:
        np.testing.assert_allclose(exe.run(ids, params=weights, backend="disco"), want,
                                   atol=1e-4, rtol=0, err_msg=f"{name} on disco")
