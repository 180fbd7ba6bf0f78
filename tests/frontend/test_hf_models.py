"""Hugging Face causal LMs (tiny random configs) imported directly, sharded, run on ranks.

Each model is built from a config in code (no download), imported with
``tvm_distx.from_torch(model, (input_ids,))`` with no wrapper, sharded with
explicit rules (the structure-found plans have tests of their own), compiled
once per module, and its logits compared with transformers' float32 ones.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import tvm_distx as td  # noqa: E402
from tvm_distx.plans import presets  # noqa: E402
from tvm_distx.frontend.pytorch import relax_name  # noqa: E402
from tvm_distx.compiler.pipeline import run_stages  # noqa: E402

from hf_tiny import VOCAB, build, logits, tokens  # noqa: E402
from reference_llama import ReferenceLlama  # noqa: E402

#: Megatron placements for the Llama family's layer names (biases only in Qwen2).
LLAMA_TP = presets.megatron(
    column=("*q_proj_weight", "*k_proj_weight", "*v_proj_weight", "*gate_proj_weight",
            "*up_proj_weight", "*lm_head_weight"),
    column_bias=("*q_proj_bias", "*k_proj_bias", "*v_proj_bias"),
    row=("*o_proj_weight", "*down_proj_weight"))


@pytest.fixture(scope="module")
def imported():
    """Every family, imported once: name -> (model, module, weights)."""
    out = {}
    for family in ("llama", "qwen2", "mistral", "gpt2"):
        model = build(family)
        mod, weights = td.from_torch(model, (torch.from_numpy(tokens(8)),))
        out[family] = (model, mod, weights)
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gpt2"])
def test_a_hf_model_imports_with_no_wrapper_and_keeps_its_parameter_names(imported, family):
    model, mod, weights = imported[family]
    params = [p.name for p in mod["main"].params]
    assert params[0] == "input_ids"
    want = {relax_name(name) for name in model.state_dict()}
    assert set(params[1:]) <= want and set(weights) == set(params[1:])
    # the program returns the logits alone: no key-value cache object
    assert [int(d) for d in mod["main"].ret_ty.shape] == [1, 8, VOCAB]
    for name, value in model.state_dict().items():
        if relax_name(name) in weights:
            np.testing.assert_array_equal(weights[relax_name(name)], value.numpy())


@pytest.fixture(scope="module")
def llama_tp(imported):
    """The Llama, Megatron tensor parallel on 2 ranks, compiled once."""
    _, mod, weights = imported["llama"]
    annotated = LLAMA_TP.apply(presets.set_device_meshes(mod, [(2,)]))
    return annotated, td.compile(annotated)


def test_llama_tensor_parallel_has_one_all_reduce_per_attention_and_per_mlp(llama_tp):
    annotated, _ = llama_tp
    report = td.comm_report(run_stages(annotated)["local_view"])
    assert [row.collective for row in report.rows] == ["all_reduce"] * 4  # 2 layers


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_llama_like_families_run_tensor_parallel_on_two_mpi_ranks(imported, family):
    model, mod, weights = imported[family]
    exe = td.compile(LLAMA_TP.apply(presets.set_device_meshes(mod, [(2,)])))
    ids = tokens(8, seed=1)
    out = exe.run(ids, params=weights, backend="mpi")
    np.testing.assert_allclose(out, logits(model, ids), atol=1e-4, rtol=0)


def test_llama_runs_tensor_parallel_on_two_mpi_ranks_and_on_disco(imported, llama_tp):
    model, _, weights = imported["llama"]
    _, exe = llama_tp
    ids = tokens(8, seed=2)
    want = logits(model, ids)
    for backend in ("mpi", "disco"):
        out = exe.run(ids, params=weights, backend=backend)
        np.testing.assert_allclose(out, want, atol=1e-4, rtol=0, err_msg=backend)


def test_llama_on_four_ranks_with_fewer_kv_heads_than_ranks(imported):
    """2 KV heads on 4 ranks: the key/value projections stay replicated, queries split."""
    model, mod, weights = imported["llama"]
    preset = LLAMA_TP.override({"*k_proj_weight": "R", "*v_proj_weight": "R"})
    exe = td.compile(preset.apply(presets.set_device_meshes(mod, [(4,)])))
    ids = tokens(8, seed=3)
    out = exe.run(ids, params=weights, backend="mpi")
    np.testing.assert_allclose(out, logits(model, ids), atol=1e-4, rtol=0)


def test_one_import_and_one_compile_serve_every_sequence_length():
    model = build("llama", layers=1)
    seq = torch.export.Dim("seq", min=1, max=64)
    mod, weights = td.from_torch(model, (torch.from_numpy(tokens(8)),),
                                 dynamic_shapes=({1: seq},))
    assert not isinstance(mod["main"].params[0].ty.shape[1], int)  # symbolic
    annotated = LLAMA_TP.apply(presets.set_device_meshes(mod, [(2,)]))
    report = td.comm_report(run_stages(annotated)["local_view"])
    assert [row.collective for row in report.rows] == ["all_reduce"] * 2  # as when static
    # each all-reduce moves (p-1)/p of the hidden state twice (ring), per token
    token = str(mod["main"].params[0].ty.shape[1])
    assert [(row.per, row.bytes_per_rank) for row in report.rows] == [((token,), 64 * 4)] * 2
    exe = td.compile(annotated)
    for length in (1, 7, 32):
        ids = tokens(length, seed=length)
        out = exe.run(ids, params=weights, backend="emulate")
        np.testing.assert_allclose(out, logits(model, ids), atol=1e-4, rtol=0,
                                   err_msg=f"sequence {length}")
    ids = tokens(7, seed=4)
    np.testing.assert_allclose(exe.run(ids, params=weights, backend="mpi"),
                               logits(model, ids), atol=1e-4, rtol=0)


def test_reference_style_llama_compiles_with_schedules_and_runs_on_two_ranks():
    """repeat_interleave for the KV heads and a torch.full(-inf) causal mask."""
    torch.manual_seed(0)
    model = ReferenceLlama().eval()
    ids = tokens(8, seed=5)
    mod, weights = td.from_torch(model, (torch.from_numpy(ids),))
    preset = presets.megatron(column=("*wq_weight", "*wk_weight", "*wv_weight", "*w1_weight",
                                      "*w3_weight", "*output_weight"),
                              row=("*wo_weight", "*w2_weight"))
    annotated = preset.apply(presets.set_device_meshes(mod, [(2,)]))
    report = td.comm_report(run_stages(annotated)["local_view"])
    assert [row.collective for row in report.rows] == ["all_reduce"] * 4
    exe = td.compile(annotated, schedule=True)
    with torch.no_grad():
        want = model(torch.from_numpy(ids)).numpy()
    np.testing.assert_allclose(exe.run(ids, params=weights, backend="mpi"), want, atol=1e-4,
                               rtol=0)


# ------------------------------------------------------------------------- failures
def _mlp_module():
    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(16, 32)
            self.fc2 = torch.nn.Linear(32, 16)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))

    torch.manual_seed(0)
    net = MLP().eval()
    x = torch.randn(4, 16)
    mod, weights = td.from_torch(net, (x,))
    annotated = presets.megatron().apply(presets.set_device_meshes(mod, [(2,)]))
    with torch.no_grad():
        return annotated, weights, x.numpy(), net(x).numpy()


def test_a_tvm_failure_inside_a_stage_is_a_compiler_stage_error(monkeypatch):
    from tvm_distx.compiler import pipeline

    annotated, *_ = _mlp_module()

    def broken(mod):
        raise KeyError("key is not in Map")

    stages = pipeline._stages()
    stages[2] = (stages[2][0], broken)
    monkeypatch.setattr(pipeline, "_stages", lambda: stages)
    with pytest.raises(td.errors.CompilerStageError, match="stage 'local_view'.*KeyError") as info:
        td.compile(annotated)
    assert "dump_dir" in str(info.value)


def test_a_scheduled_kernel_that_does_not_build_falls_back_to_tvm_lowering(monkeypatch,
                                                                            caplog):
    """The build retries with TVM's lowering for exactly the kernels that fail alone."""
    import tvm

    from tvm_distx.compiler import pipeline
    from tvm_distx.compiler.schedule import RULE_ATTR

    annotated, weights, x, want = _mlp_module()
    real = tvm.compile

    def compile_refusing_matmul_schedules(mod, target=None, **kwargs):
        for func in mod.functions.values():
            if isinstance(func, tvm.tirx.PrimFunc) and func.attrs is not None and \
                    str(func.attrs.get(RULE_ATTR, "")) in ("matmul", "matvec"):
                raise tvm.error.InternalError("Buffer x is used before its definition")
        return real(mod, target=target, **kwargs)

    monkeypatch.setattr(pipeline.tvm, "compile", compile_refusing_matmul_schedules)
    with caplog.at_level(logging.WARNING, logger="tvm_distx.compiler.pipeline"):
        exe = td.compile(annotated)
    monkeypatch.undo()
    assert "does not build" in caplog.text and "matmul" in caplog.text  # the kernel's name
    scheduled = [str(f.attrs.get(RULE_ATTR)) for f in exe.built.functions.values()
                 if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None
                 and f.attrs.get(RULE_ATTR) is not None]
    assert scheduled and not {"matmul", "matvec"} & set(scheduled)
    np.testing.assert_allclose(exe.run(x, params=weights, backend="emulate"), want, atol=1e-5)
