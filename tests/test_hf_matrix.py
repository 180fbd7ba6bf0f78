"""Every family, both plans, 2 and 4 MPI ranks and disco: logits equal transformers'.

For each family ``presets.tensor_parallel()`` is compiled once per rank count and
run on MPI (and on disco with 2 ranks); ``presets.from_hf(model)`` must give the
same annotated module on 2 and 4 ranks where transformers ships a plan (GPT-2
ships none, and ``from_hf`` says so; on 4 ranks both keep the 2 key/value heads
whole, where transformers' own plan would split them). Each compile is also checked for its collectives: one
all-reduce per attention block and one per MLP or MoE layer, nothing else.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import tvm

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import tvm_distx as td  # noqa: E402
from tvm_distx import presets  # noqa: E402
from tvm_distx.errors import RuleError  # noqa: E402
from tvm_distx.pipeline import run_stages  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent / "models"))
from hf_tiny import build, logits, tokens  # noqa: E402

FAMILIES = ["llama", "qwen2", "mistral", "gpt2", "mixtral", "qwen2_moe"]


def _replicated_by_design(name: str, value: np.ndarray, family: str, ranks: int) -> bool:
    """Weights every rank holds whole, by design: vectors (norms, row-parallel biases),
    embeddings, MoE routers and Qwen2-MoE's one-output shared-expert gate, GPT-2's tied
    head, and the 2 key/value heads on 4 ranks."""
    return (value.ndim == 1 or "embed" in name or name.endswith(("wte_weight", "wpe_weight"))
            or name.endswith(("mlp_gate_weight", "shared_expert_gate_weight"))
            or (family == "gpt2" and name.endswith("lm_head_weight"))
            or (ranks == 4 and ("k_proj" in name or "v_proj" in name)))


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
def test_tensor_parallel_and_the_hf_plan_run_equal_to_transformers(family, ranks):
    name, model, mod, weights = family
    meshed = presets.with_meshes(mod, [(ranks,)])
    annotated = presets.tensor_parallel().apply(meshed)
    if name == "gpt2":
        with pytest.raises(RuleError, match="no base_model_tp_plan"):
            presets.from_hf(model)
    else:  # on 4 ranks both keep the 2 key/value heads whole
        hf_plan = presets.from_hf(model)
        if name == "qwen2_moe":  # transformers' plan leaves the shared expert whole; ours splits it
            hf_plan = hf_plan.override({"*shared_expert_gate_proj_weight": "S[0]",
                                        "*shared_expert_up_proj_weight": "S[0]",
                                        "*shared_expert_down_proj_weight": "S[1]"})
        tvm.ir.assert_structural_equal(hf_plan.apply(meshed), annotated)
    rows = td.comm_report(run_stages(annotated)["local_view"]).rows
    assert [r.collective for r in rows if r.collective != "local_slice"] == ["all_reduce"] * 2
    exe = td.compile(annotated)
    _check_weight_bytes(name, exe, weights, ranks)
    ids = tokens(8, seed=ranks)
    want = logits(model, ids)
    np.testing.assert_allclose(exe.run(ids, params=weights, backend="mpi"), want, atol=1e-4,
                               rtol=0, err_msg=f"{name} on {ranks} MPI ranks")
    if ranks == 2:
        np.testing.assert_allclose(exe.run(ids, params=weights, backend="disco"), want,
                                   atol=1e-4, rtol=0, err_msg=f"{name} on disco")
