"""PyTorch models through from_torch and the presets, run on ranks and compared with PyTorch."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import tvm_distx as td
from tvm_distx.compiler.pipeline import run_stages
from tvm_distx.frontend.pytorch import from_torch, relax_name
from tvm_distx.passes import AnnotateSharding
from tvm_distx.plans.presets import (data_and_tensor_parallel, data_parallel, megatron, pipeline_stages,
                               set_device_meshes)

from transformer import Transformer  # noqa: E402


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    net = Transformer(layers=2).eval()
    x = torch.randn(2, 16, 256)
    with torch.no_grad():
        want = net(x).numpy()
    mod, weights = from_torch(net, (x,))
    return mod, weights, x.numpy(), want


def test_weights_keep_their_pytorch_names(model):
    mod, weights, _, _ = model
    assert relax_name("layers.0.mlp.fc1.weight") == "p_layers_0_mlp_fc1_weight"
    assert weights["p_layers_0_mlp_fc1_weight"].shape == (1024, 256)
    assert [p.name for p in mod["main"].params][:2] == ["x", "p_layers_0_ln1_weight"]
    assert len(weights) == 2 * 16  # per block: 2 layer norms, 4 projections, 2 linears


@pytest.fixture(scope="module")
def tensor_parallel(model):
    mod, _, _, _ = model
    return td.compile(megatron().apply(set_device_meshes(mod, [(2,)])))


def test_megatron_transformer_on_two_mpi_ranks_equals_pytorch(model, tensor_parallel):
    _, weights, x, want = model
    out = tensor_parallel.run(x, params=weights, backend="mpi")
    np.testing.assert_allclose(out, want, atol=1e-4)


def test_megatron_holds_half_of_each_split_weight_and_all_reduces_per_block(model):
    mod, weights, x, want = model
    from tvm import relax

    annotated = megatron().apply(set_device_meshes(mod, [(2,)]))
    # TVM types layer_norm on DTensors only after LegalizeOps
    report = td.explain(relax.transform.LegalizeOps()(annotated))
    assert report.row("main", "p_layers_0_mlp_fc1_weight").local_shape == (512, 256)
    assert report.row("main", "p_layers_1_attn_out_proj_weight").local_shape == (256, 128)
    from tvm_distx.compiler.pipeline import run_stages

    rows = td.comm_report(run_stages(annotated)["local_view"]).rows
    # one all-reduce completes each row-parallel layer: 2 per block, 2 blocks; the heads
    # stay split through attention, so nothing is gathered
    assert [r.collective for r in rows] == ["all_reduce"] * 4
    np.testing.assert_allclose(td.compile(annotated).run(x, params=weights, backend="emulate"),
                               want, atol=1e-4)


def test_data_parallel_and_an_override(model):
    mod, weights, x, want = model
    exe = td.compile(data_parallel().apply(set_device_meshes(mod, [(2,)])))
    assert exe.signatures["main"].params[0].sharding.placement.entries[0].is_shard()
    np.testing.assert_allclose(exe.run(x, params=weights, backend="emulate"), want, atol=1e-4)
    # an override: keep the MLP's second layer replicated
    preset = megatron().override({"*fc2_weight": "R"})
    placements = preset.placements(list(weights))
    assert placements["p_layers_0_mlp_fc2_weight"] == ("R", None)
    assert placements["p_layers_0_mlp_fc1_weight"] == ("S[0]", None)


def test_a_preset_for_another_model_is_refused(model):
    mod, _, _, _ = model
    with pytest.raises(td.errors.RuleError, match="no parameter of 'main' matches"):
        megatron(column=("*wq",), column_bias=(), row=("*wo",)).rules(mod)


def test_from_torch_errors_name_the_cause():
    class DataDependent(torch.nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # not traceable
                return x
            return -x

    with pytest.raises(td.errors.ArgumentError, match="torch.export could not trace DataDependent"):
        from_torch(DataDependent(), (torch.randn(3),))


def test_a_guard_torch_cannot_prove_over_a_symbolic_length_is_exported_again():
    """Llama 4's experts: ``bmm(...).view(-1, h)`` then ``reshape(experts, -1, h)``.

    torch gives the merged view the stride ``min(8, 8 * n)`` and guards the split's
    contiguity, ``n * min(8, 8 * n) == 8 * n``: true for every ``n >= 1``, which
    torch cannot prove ("Constraints violated"). The import exports again with
    size-oblivious reasoning; one compile then serves every length, 1 included.
    """
    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(4, 8, 8))

        def forward(self, x):
            routed = x.reshape(-1, 8).repeat(4, 1).view(4, -1, 8)
            out = torch.bmm(routed, self.weight).view(-1, 8)
            return out.reshape(4, -1, 8).sum(dim=0)

    torch.manual_seed(5)
    module = Experts().eval()
    seq = torch.export.Dim("seq", min=1, max=16)
    with pytest.raises(torch._dynamo.exc.UserError, match="Constraints violated"):
        torch.export.export(module, (torch.randn(1, 4, 8),), dynamic_shapes=({1: seq},))
    mod, weights = from_torch(module, (torch.randn(1, 4, 8),), dynamic_shapes=({1: seq},))
    # each rank runs two experts: the split runs through the reshapes of the run-time length
    rules = [td.ShardingRule(param="x", result="R"),
             td.ShardingRule(param=relax_name("weight"), result="S[0]")]
    annotated = AnnotateSharding(rules)(set_device_meshes(mod, [(2,)]))
    report = td.comm_report(run_stages(annotated)["local_view"])
    assert [row.collective for row in report.rows] == ["local_slice", "all_reduce"], str(report)
    exe = td.compile(annotated)
    for length in (1, 3, 16):
        x = torch.randn(1, length, 8)
        with torch.no_grad():
            want = module(x).numpy()
        got = exe.run(x.numpy(), params=weights, backend="emulate")
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"length {length}")


def test_data_and_model_on_a_2x2_mesh(model):
    mod, weights, x, want = model
    exe = td.compile(data_and_tensor_parallel().apply(set_device_meshes(mod, [(2, 2)])))
    assert exe.num_ranks == 4
    np.testing.assert_allclose(exe.run(x, params=weights, backend="emulate"), want, atol=1e-4)


def test_pipeline_stages_run_one_layer_per_rank_on_mpi(model):
    mod, weights, x, want = model
    preset = pipeline_stages(2, ["mesh[0]", "mesh[1]"])
    exe = td.compile(preset.apply(set_device_meshes(mod, [(1,), (1,)])))
    assert exe.entries["main"] == ["main_rank0", "main_rank1"]
    # each stage program takes only its own layer's weights
    assert all("layers_1" not in p.name for p in exe.module["main_rank0"].params)
    assert all("layers_0" not in p.name for p in exe.module["main_rank1"].params)
    np.testing.assert_allclose(exe.run(x, params=weights, backend="mpi"), want, atol=1e-4)


@pytest.fixture(scope="module")
def sequence_parallel(model):
    mod, _, _, _ = model
    annotated = megatron(sequence_parallel=True).apply(set_device_meshes(mod, [(2,)]))
    return annotated, td.compile(annotated)


def test_sequence_parallel_gathers_before_and_reduce_scatters_after_each_parallel_layer(
        model, sequence_parallel):
    from tvm import relax
    from tvm_distx.compiler.pipeline import run_stages

    annotated, exe = sequence_parallel
    report = td.explain(relax.transform.LegalizeOps()(annotated))
    assert report.row("main", "x").placement == "S[1]"
    assert report.row("main", "x").local_shape == (2, 8, 256)
    partial = [r for r in report.rows if r.placement == "P"]
    # the out_proj and fc2 matmuls of both blocks leave partial sums
    assert len(partial) == 4 and all("partial sum" in r.reason for r in partial)
    rows = td.comm_report(run_stages(annotated)["local_view"]).rows
    # per block: tokens gathered before q/k/v and fc1, the partial sums of out_proj and
    # fc2 reduce-scattered back onto the tokens; never an all-reduce
    assert [(r.collective, r.src, r.dst) for r in rows] == [
        ("all_gather", "S[1]", "R"), ("reduce_scatter", "P", "S[1]")] * 4
    activations = 2 * 16 * 256 * 4
    assert all(r.bytes_per_rank == activations // 2 for r in rows)
    lowered = exe.module.script()
    assert "tvm_distx.ccl.reducescatter" in lowered and "tvm_distx.ccl.allreduce" not in lowered


def test_sequence_parallel_transformer_equals_pytorch_on_two_mpi_ranks_and_emulated(
        model, sequence_parallel):
    _, weights, x, want = model
    _, exe = sequence_parallel
    np.testing.assert_allclose(exe.run(x, params=weights, backend="mpi"), want, atol=1e-4)
    np.testing.assert_allclose(exe.run(x, params=weights, backend="emulate"), want, atol=1e-4)
