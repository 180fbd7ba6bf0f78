"""auto_shard: placements chosen by an integer program, checked on the programs they produce.

Every plan is compiled up to the local view, and its collectives are compared with
the ones the solver predicted; the tensor-parallel plans run on 2 MPI ranks against
PyTorch and transformers.
"""

from __future__ import annotations

import re
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

import tvm_distx as td
from tvm_distx import ShardingRule
from tvm_distx.plans import presets
from tvm_distx.autoshard import CostProfile, auto_shard, measure_cost_profile, plan_cost
from tvm_distx.autoshard.graph import Node, ShardGraph
from tvm_distx.autoshard.ilp import solve
from tvm_distx.errors import MemoryBudgetError, RuleError
from tvm_distx.compiler.pipeline import run_stages

from transformer import Transformer  # noqa: E402

pytest.importorskip("transformers")
from hf_tiny import build, logits, tokens  # noqa: E402


def _weight_bytes(weights) -> int:
    return sum(np.asarray(v).nbytes for v in weights.values())


def _realized(annotated) -> Counter:
    """The collectives the compiled program runs (local slices left out)."""
    rows = td.comm_report(run_stages(annotated)["local_view"]).rows
    return Counter(r.collective for r in rows if r.collective != "local_slice")


_ABI = {"allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
        "alltoall": "all_to_all", "send_recv": "send_recv"}


def _lowered(exe) -> Counter:
    """The collectives in a compiled executable's rank program, by the planner's names."""
    found = re.findall(r'"tvm_distx\.ccl\.(\w+)"', exe.module.script())
    return Counter(_ABI[name] for name in found if name in _ABI)


def _one_reduction_per_block(collectives: Counter, blocks: int) -> bool:
    """Megatron's count (an all-reduce per block), or its sequence-parallel form.

    The sequence-parallel form completes each block with a reduce-scatter and
    gathers the tokens once before the next block (and once at the embedding).
    """
    if set(collectives) == {"all_reduce"}:
        return collectives["all_reduce"] == blocks
    return (set(collectives) <= {"reduce_scatter", "all_gather"}
            and collectives["reduce_scatter"] == blocks
            and collectives["all_gather"] <= blocks + 1)


# --------------------------------------------------------------------------- models
def _imported_transformer(batch: int):
    """The 2-layer test transformer imported for ``batch``: module, weights, input, torch's output."""
    torch.manual_seed(0)
    net = Transformer(layers=2).eval()
    x = torch.randn(batch, 16, 256)
    with torch.no_grad():
        want = net(x).numpy()
    mod, weights = td.from_torch(net, (x,))
    return mod, weights, x.numpy(), want


@pytest.fixture(scope="module")
def transformer():
    return _imported_transformer(1)


def _imported(family: str):
    """A tiny transformers model imported on 8 tokens: (module, weights, ids, its logits)."""
    model = build(family)
    ids = tokens(8)
    mod, weights = td.from_torch(model, (torch.from_numpy(ids),))
    return mod, weights, ids, logits(model, ids)


def _under_budget(imported):
    """``auto_shard`` on (2,) with 0.55 x the weights per rank."""
    mod, weights, _, _ = imported
    return auto_shard(mod, (2,), memory_per_rank=int(0.55 * _weight_bytes(weights)))


@pytest.fixture(scope="module")
def transformer_plan(transformer):
    return _under_budget(transformer)


@pytest.fixture(scope="module")
def llama():
    return _imported("llama")


@pytest.fixture(scope="module")
def llama_plan(llama):
    return _under_budget(llama)


@pytest.fixture(scope="module")
def gpt2():
    """Tiny GPT-2: Conv1D weights stored (in, out), q|k|v fused in ``c_attn``, tied LM head."""
    return _imported("gpt2")


@pytest.fixture(scope="module")
def gpt2_plan(gpt2):
    return _under_budget(gpt2)


# --------------------------------------------------------------------------- (2,) mesh
def test_transformer_gets_megatron_under_a_budget_and_runs_on_mpi(transformer, transformer_plan):
    mod, weights, x, want = transformer
    annotated, report = transformer_plan
    placements = report.placements
    for layer in range(2):
        for name in ("attn_q_proj", "attn_k_proj", "attn_v_proj", "mlp_fc1"):
            assert placements[f"p_layers_{layer}_{name}_weight"] == "S[0]"  # column parallel
        for name in ("attn_out_proj", "mlp_fc2"):
            assert placements[f"p_layers_{layer}_{name}_weight"] == "S[1]"  # row parallel
    assert 0.5 <= report.weight_bytes_per_rank / _weight_bytes(weights) <= 0.52
    exe = td.compile(annotated)
    realized = _lowered(exe)
    assert realized == report.collectives()  # the program runs the plan that was costed
    assert _one_reduction_per_block(realized, blocks=4)
    assert report.solution.status == "optimal" and report.graph.layers == 2
    out = exe.run(x, params=weights, backend="mpi")
    np.testing.assert_allclose(out, want, atol=1e-4)


def test_tiny_llama_gets_megatron_under_a_budget_and_runs_on_mpi(llama, llama_plan):
    mod, weights, ids, want = llama
    annotated, report = llama_plan
    placements = report.placements
    for layer in range(2):
        prefix = f"p_model_layers_{layer}_"
        for name in ("self_attn_q_proj", "self_attn_k_proj", "self_attn_v_proj",
                     "mlp_gate_proj", "mlp_up_proj"):
            assert placements[f"{prefix}{name}_weight"] == "S[0]"
        for name in ("self_attn_o_proj", "mlp_down_proj"):
            assert placements[f"{prefix}{name}_weight"] == "S[1]"
    assert 0.5 <= report.weight_bytes_per_rank / _weight_bytes(weights) <= 0.53
    exe = td.compile(annotated)
    realized = _lowered(exe)
    assert realized == report.collectives()
    assert _one_reduction_per_block(realized, blocks=4)
    out = exe.run(ids, params=weights, backend="mpi")
    np.testing.assert_allclose(out, want, atol=1e-4)


def test_gpt2_fused_qkv_gets_megatron_per_segment_under_a_budget_and_runs_on_mpi(gpt2,
                                                                                gpt2_plan):
    """c_attn (q|k|v in one Conv1D weight) is cut per segment, each split by heads."""
    mod, weights, ids, want = gpt2
    annotated, report = gpt2_plan
    placements = report.placements
    for layer in range(2):
        prefix = f"p_transformer_h_{layer}_"
        for seg in range(3):  # a Conv1D weight is (in, out): column parallel is S[1]
            assert placements[f"{prefix}attn_c_attn_weight_seg{seg}"] == "S[1]"
        assert placements[f"{prefix}mlp_c_fc_weight"] == "S[1]"
        for name in ("attn_c_proj", "mlp_c_proj"):
            assert placements[f"{prefix}{name}_weight"] == "S[0]"  # row parallel
    assert 0.5 <= report.weight_bytes_per_rank / _weight_bytes(weights) <= 0.53
    exe = td.compile(annotated)
    realized = _lowered(exe)
    assert realized == report.collectives()
    assert _one_reduction_per_block(realized, blocks=4)
    out = exe.run(ids, params=weights, backend="mpi")  # the user's fused weights, cut on load
    np.testing.assert_allclose(out, want, atol=1e-4)


def test_never_worse_than_the_hand_written_presets(transformer, transformer_plan, llama,
                                                   llama_plan, gpt2, gpt2_plan):
    """Each preset priced as the program it propagates to (plan_cost), with and without a budget.

    ``megatron()`` names the test transformer's layers; ``tensor_parallel()`` finds
    the plan in any graph.
    """
    tp = ("tensor_parallel()", presets.tensor_parallel())
    sp = ("megatron(sequence_parallel=True)", presets.megatron(sequence_parallel=True))
    for (mod, weights, _, _), (_, report), named in ((transformer, transformer_plan, (tp, sp)),
                                                     (llama, llama_plan, (tp,)),
                                                     (gpt2, gpt2_plan, (tp,))):
        _, free = auto_shard(mod, (2,), runner_ups=0, pin=False)
        for name, preset in named:
            try:
                fitted = plan_cost(mod, (2,), preset, memory_per_rank=report.memory_per_rank)
            except MemoryBudgetError:  # the preset does not even fit
                fitted = None
            if fitted is not None:
                assert report.solution.objective <= fitted.objective * (1 + 1e-9), name
            assert free.solution.objective <= plan_cost(mod, (2,), preset).objective * (
                1 + 1e-9), name


def test_the_report_gives_reasons_and_runner_ups(transformer_plan):
    _, report = transformer_plan
    text = str(report)
    assert "predicted:" in text and "2 identical layers solved once" in text
    reasons = dict((name, reason) for name, _, reason in report.reasons())
    assert reasons["p_layers_0_mlp_fc1_weight"].startswith("holds 524288 of 1048576 B")
    assert len(report.runner_ups) == 2
    for other, diff in report.runner_ups:
        assert diff and other.objective >= report.solution.objective * (1 - 1e-9)
    assert report.rules_data()[0] == {"param": "x", "result": report.placements["x"],
                                      "function": "main"}


# --------------------------------------------------------------------------- 2x2 mesh
@pytest.fixture(scope="module")
def batch8():
    return _imported_transformer(8)


def test_throughput_on_2x2_data_parallel_when_memory_allows(batch8):
    """Every weight whole, the batch over mesh axis 0, nothing moved along it.

    A kernel cannot run on a dimension split by both mesh axes (lowering runs it on
    the outer split), so the second axis is used inside the layers (heads, tokens)
    where that is cheaper than leaving it idle.
    """
    mod, weights, _, _ = batch8
    annotated, report = auto_shard(mod, (2, 2), objective="throughput",
                                   memory_per_rank=4 * _weight_bytes(weights), runner_ups=0)
    assert report.placements["x"] == "S[0]R"
    assert all(not p.startswith("S") for name, p in report.placements.items() if name != "x")
    rows = td.comm_report(run_stages(annotated)["local_view"]).rows
    assert all(r.mesh_axis == 1 for r in rows)  # the data axis never communicates
    data = plan_cost(mod, (2, 2), presets.data_parallel(mesh_ndim=2), objective="throughput")
    assert report.solution.objective <= data.objective


def test_throughput_on_2x2_data_and_model_parallel_under_a_budget(batch8):
    mod, weights, x, want = batch8
    total = _weight_bytes(weights)
    annotated, report = auto_shard(mod, (2, 2), objective="throughput",
                                   memory_per_rank=int(0.55 * total), runner_ups=0)
    data = report.placements["x"]
    assert data.count("S[0]") == 1 and "R" in data  # the batch split over one axis only
    big = [n for n, v in weights.items() if np.asarray(v).ndim == 2]
    assert all(report.placements[n].count("S") == 1 for n in big)  # weights over the other
    assert report.weight_bytes_per_rank <= 0.52 * total
    exe = td.compile(annotated)
    assert sum(_lowered(exe).values()) > 0
    np.testing.assert_allclose(exe.run(x, params=weights, backend="emulate"), want, atol=1e-4)
    # cut short, the solver returns the best plan so far with its gap (or says it has none)
    try:
        _, rushed = auto_shard(mod, (2, 2), objective="throughput", runner_ups=0, pin=False,
                               memory_per_rank=int(0.55 * total), time_limit=0.05)
    except td.errors.UnsupportedProgramError as err:
        assert "time limit" in str(err)
    else:
        assert rushed.solution.status in ("time limit", "optimal")
        assert rushed.solution.status == "optimal" or rushed.solution.gap >= 0


# --------------------------------------------------------------------------- scale, rules
def _relax_transformer(layers: int, seq: int = 16, dim: int = 256, heads: int = 4,
                       hidden: int = 1024):
    """tests/models/transformer.py's model written directly in Relax (no torch.export)."""
    from tvm import relax
    from tvm.relax.op import add, matmul, nn, permute_dims, reshape

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, seq, dim), "float32"))
    params, layer_params = [x], []
    shapes = [("ln1_weight", (dim,)), ("ln1_bias", (dim,))]
    shapes += [(f"attn_{n}_proj_{w}", (dim, dim) if w == "weight" else (dim,))
               for n in ("q", "k", "v", "out") for w in ("weight", "bias")]
    shapes += [("ln2_weight", (dim,)), ("ln2_bias", (dim,)), ("mlp_fc1_weight", (hidden, dim)),
               ("mlp_fc1_bias", (hidden,)), ("mlp_fc2_weight", (dim, hidden)),
               ("mlp_fc2_bias", (dim,))]
    for i in range(layers):
        named = {k: relax.Var(f"p_layers_{i}_{k}", relax.TensorType(s, "float32"))
                 for k, s in shapes}
        params += list(named.values())
        layer_params.append(named)
    with bb.function("main", params, attrs={"num_input": 1}):
        with bb.dataflow():
            h = x
            for w in layer_params:
                def linear(v, name, w=w):
                    t = bb.emit(permute_dims(w[name + "_weight"]))
                    return bb.emit(add(bb.emit(matmul(v, t)), w[name + "_bias"]))

                def split_heads(v):
                    v = bb.emit(reshape(v, (1, seq, heads, dim // heads)))
                    return bb.emit(permute_dims(v, [0, 2, 1, 3]))

                n = bb.emit(nn.layer_norm(h, w["ln1_weight"], w["ln1_bias"], axes=[-1]))
                q, k, v = (split_heads(linear(n, f"attn_{c}_proj")) for c in "qkv")
                scores = bb.emit(matmul(q, bb.emit(permute_dims(k, [0, 1, 3, 2]))))
                probs = bb.emit(nn.softmax(scores, axis=-1))
                o = bb.emit(permute_dims(bb.emit(matmul(probs, v)), [0, 2, 1, 3]))
                o = bb.emit(reshape(o, (1, seq, dim)))
                h = bb.emit(add(h, linear(o, "attn_out_proj")))
                n = bb.emit(nn.layer_norm(h, w["ln2_weight"], w["ln2_bias"], axes=[-1]))
                h = bb.emit(add(h, linear(bb.emit(nn.relu(linear(n, "mlp_fc1"))), "mlp_fc2")))
            out = bb.emit_output(h)
        bb.emit_func_output(out)
    return bb.get(), sum(4 * int(np.prod(s)) for _, s in shapes) * layers


def test_a_32_layer_model_solves_in_under_10_s():
    mod, weight_bytes = _relax_transformer(32)
    start = time.perf_counter()
    _, report = auto_shard(mod, (2,), memory_per_rank=int(0.55 * weight_bytes), runner_ups=0,
                           pin=False)
    assert time.perf_counter() - start < 10
    assert report.graph.layers == 32 and report.solution.status == "optimal"
    assert report.placements["p_layers_31_mlp_fc2_weight"] == "S[1]"
    assert report.placements["p_layers_0_attn_q_proj_weight"] == "S[0]"


def test_rules_are_hard_constraints(transformer):
    mod, weights, _, _ = transformer
    keep = ShardingRule(param="p_layers_0_mlp_fc1_weight", result="R")
    _, report = auto_shard(mod, (2,), rules=[keep], runner_ups=0, pin=False)
    assert report.placements["p_layers_0_mlp_fc1_weight"] == "R"
    assert report.graph.layers == 0  # a rule for one layer: the layers are solved apart
    with pytest.raises(RuleError, match="parameter rules only"):
        auto_shard(mod, (2,), rules=[ShardingRule(op="relax.matmul", result="R")])
    with pytest.raises(RuleError, match="cannot be"):
        auto_shard(mod, (2,), rules=[ShardingRule(param="x", result="S[0]")], runner_ups=0)
    with pytest.raises(MemoryBudgetError, match="no plan fits"):
        auto_shard(mod, (2,), memory_per_rank=_weight_bytes(weights) // 4, runner_ups=0)


def test_the_ilp_alone_on_a_two_layer_mlp():
    """No TVM in the problem: x(64, 64) @ w1(64, 1024), relu, @ w2(1024, 64), relu."""
    nodes = [Node("x", (64, 64), "float32", "input"),
             Node("w1", (64, 1024), "float32", "param"),
             Node("h", (64, 1024), "float32", "op", "matmul", (0, 1),
                  (("m", "k"), ("k", "n")), ("m", "n")),
             Node("r", (64, 1024), "float32", "op", "relu", (2,), (("m", "n"),), ("m", "n")),
             Node("w2", (1024, 64), "float32", "param"),
             Node("y", (64, 64), "float32", "op", "matmul", (3, 4),
                  (("m", "k"), ("k", "n")), ("m", "n")),
             Node("z", (64, 64), "float32", "op", "relu", (5,), (("m", "n"),), ("m", "n"))]
    graph = ShardGraph(nodes, (6,), (2,))
    weights = 2 * 64 * 1024 * 4
    sol = solve(graph, memory_per_rank=int(0.6 * weights) + 64 * 1024 * 4)
    chosen = {n.name: graph.strategies[i][sol.choice[i]].out for i, n in enumerate(nodes)}
    assert chosen["w1"] == "S[1]" and chosen["w2"] == "S[0]" and chosen["y"] == "P"
    # the partial sums completed once: an all-reduce, or a reduce-scatter when the relu
    # after it may run on half the rows (the sequence-parallel form, half the bytes)
    assert [(m[1], m[5]) for m in sol.moves] == [("P", (("reduce_scatter", 2),))]
    assert sol.comm_bytes == 64 * 64 * 4 // 2
    assert sol.weight_bytes == weights // 2


def test_the_cli_writes_the_rules_it_chose(tmp_path, capsys):
    import yaml

    from tvm_distx.cli.main import main

    mod, weight_bytes = _relax_transformer(2)
    (tmp_path / "model.py").write_text(mod.script())
    out = tmp_path / "rules.yaml"
    assert main(["autoshard", str(tmp_path / "model.py"), "--mesh", "2", "--memory",
                 f"{0.55 * weight_bytes / 2**20:.3f}MiB", "-o", str(out)]) == 0
    assert "predicted:" in capsys.readouterr().err
    rules = {r["param"]: r["result"] for r in yaml.safe_load(out.read_text())}
    assert rules["p_layers_1_mlp_fc1_weight"] == "S[0]"
    assert rules["p_layers_1_mlp_fc2_weight"] == "S[1]"
    assert main(["autoshard", str(tmp_path / "model.py"), "--mesh", "2", "--memory",
                 "1KiB"]) == 2
    assert "raise --memory" in capsys.readouterr().err


def test_a_profile_round_trips_through_json(tmp_path):
    profile = CostProfile(3e10, 2e9, 5e-6, name="measured")
    profile.save(tmp_path / "p.json")
    assert CostProfile.load(tmp_path / "p.json") == profile
    (tmp_path / "bad.json").write_text('{"flops": 1}')
    with pytest.raises(td.errors.ArgumentError, match="not a cost profile"):
        CostProfile.load(tmp_path / "bad.json")
    measured = measure_cost_profile(1, backend="local")  # the arithmetic rate of this process
    assert measured.flops_per_s > 1e6 and measured.name == "measured local"
