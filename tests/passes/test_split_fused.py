"""SplitFusedProjections: a fused projection becomes one weight per segment, split per segment.

The rewrite is checked as exact IR on small TVMScript modules; the derivation
of the new parameters from the user's weights, on real multi-rank runs against
PyTorch and transformers (a fused gate|up MLP, fused 3-D expert tensors, and a
tiny GPT2LMHeadModel imported directly), through ``run``, bundles and the CLI.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

import tvm_distx as td
from tvm_distx.layout.derived import DerivedParam, Derivations
from tvm_distx.passes import SplitFusedProjections, derivations_of


# --------------------------------------------------------------------------- exact IR
@I.ir_module
class GateUp:
    @R.function
    def main(x: R.Tensor((2, 5, 16), "float32"), w: R.Tensor((64, 16), "float32"),
             b: R.Tensor((64,), "float32")) -> R.Tensor((2, 5, 32), "float32"):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            wt = R.permute_dims(w)
            y = R.matmul(x, wt, out_dtype="float32")
            yb = R.add(y, b)
            parts = R.split(yb, 2, axis=-1)
            gate = parts[0]
            up = parts[1]
            out = R.multiply(R.nn.silu(gate), up)
            R.output(out)
        return out


@I.ir_module
class GateUpExpected:
    @R.function
    def main(x: R.Tensor((2, 5, 16), "float32"), w_seg0: R.Tensor((32, 16), "float32"),
             w_seg1: R.Tensor((32, 16), "float32"), b_seg0: R.Tensor((32,), "float32"),
             b_seg1: R.Tensor((32,), "float32")) -> R.Tensor((2, 5, 32), "float32"):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            wt0 = R.permute_dims(w_seg0)
            y0 = R.matmul(x, wt0, out_dtype="float32")
            gate = R.add(y0, b_seg0)
            wt1 = R.permute_dims(w_seg1)
            y1 = R.matmul(x, wt1, out_dtype="float32")
            up = R.add(y1, b_seg1)
            out = R.multiply(R.nn.silu(gate), up)
            R.output(out)
        return out


@I.ir_module
class Qkv:
    """GPT-2's c_attn: a Conv1D weight stored (in, out), addmm then a view, split q|k|v.

    The segments differ in size (q 32, k and v 8 each, as with grouped-query heads).
    """

    @R.function
    def main(x: R.Tensor((2, 5, 16), "float32"), w: R.Tensor((16, 48), "float32"),
             b: R.Tensor((48,), "float32")) -> R.Tensor((2, 5, 8), "float32"):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            x2 = R.reshape(x, R.shape([10, 16]))
            y = R.matmul(x2, w, out_dtype="float32")
            yb = R.add(b, y)
            y3 = R.reshape(yb, R.shape([2, 5, 48]))
            qkv = R.split(y3, [32, 40], axis=2)
            q = qkv[0]
            k = qkv[1]
            v = qkv[2]
            out = R.add(R.sum(q, axis=[-1], keepdims=True), R.multiply(k, v))
            R.output(out)
        return out


@I.ir_module
class QkvExpected:
    @R.function
    def main(x: R.Tensor((2, 5, 16), "float32"), w_seg0: R.Tensor((16, 32), "float32"),
             w_seg1: R.Tensor((16, 8), "float32"), w_seg2: R.Tensor((16, 8), "float32"),
             b_seg0: R.Tensor((32,), "float32"), b_seg1: R.Tensor((8,), "float32"),
             b_seg2: R.Tensor((8,), "float32")) -> R.Tensor((2, 5, 8), "float32"):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            x2 = R.reshape(x, R.shape([10, 16]))
            y0 = R.matmul(x2, w_seg0, out_dtype="float32")
            yb0 = R.add(b_seg0, y0)
            q = R.reshape(yb0, R.shape([2, 5, 32]))
            y1 = R.matmul(x2, w_seg1, out_dtype="float32")
            yb1 = R.add(b_seg1, y1)
            k = R.reshape(yb1, R.shape([2, 5, 8]))
            y2 = R.matmul(x2, w_seg2, out_dtype="float32")
            yb2 = R.add(b_seg2, y2)
            v = R.reshape(yb2, R.shape([2, 5, 8]))
            out = R.add(R.sum(q, axis=[-1], keepdims=True), R.multiply(k, v))
            R.output(out)
        return out


@I.ir_module
class Sliced:
    """The segments cut with strided slices (as torch's decompositions write a split)."""

    @R.function
    def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 24), "float32")
             ) -> R.Tensor((4, 12), "float32"):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            y = R.matmul(x, w, out_dtype="float32")
            a = R.strided_slice(y, axes=[1], begin=[0], end=[12])
            c = R.strided_slice(y, axes=[1], begin=[12], end=[24])
            out = R.multiply(a, c)
            R.output(out)
        return out


@I.ir_module
class SlicedExpected:
    @R.function
    def main(x: R.Tensor((4, 8), "float32"), w_seg0: R.Tensor((8, 12), "float32"),
             w_seg1: R.Tensor((8, 12), "float32")) -> R.Tensor((4, 12), "float32"):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            a = R.matmul(x, w_seg0, out_dtype="float32")
            c = R.matmul(x, w_seg1, out_dtype="float32")
            out = R.multiply(a, c)
            R.output(out)
        return out


@I.ir_module
class MultiQuery:
    """Falcon's multi-query q|k|v: the features read as 4 + 1 + 1 heads of 4, cut on the
    heads axis by a slice and two lists of one index (``[..., [-2], :]``), over a run-time
    number of tokens."""

    @R.function
    def main(x: R.Tensor(("n", 8), "float32"), w: R.Tensor((24, 8), "float32")
             ) -> R.Tensor(("n", 4, 4), "float32"):
        n = T.int64()
        R.func_attr({"num_input": 1})
        with R.dataflow():
            wt = R.permute_dims(w)
            y = R.matmul(x, wt, out_dtype="float32")
            heads = R.reshape(y, R.shape([n, 6, 4]))
            q = R.strided_slice(heads, axes=[1], begin=[0], end=[-2])
            k = R.take(heads, R.const([4], "int64"), axis=1)
            v = R.take(heads, R.const([5], "int64"), axis=1)
            out = R.add(R.multiply(q, k), v)
            R.output(out)
        return out


@I.ir_module
class MultiQueryExpected:
    @R.function
    def main(x: R.Tensor(("n", 8), "float32"), w_seg0: R.Tensor((16, 8), "float32"),
             w_seg1: R.Tensor((4, 8), "float32"), w_seg2: R.Tensor((4, 8), "float32")
             ) -> R.Tensor(("n", 4, 4), "float32"):
        n = T.int64()
        R.func_attr({"num_input": 1})
        with R.dataflow():
            wt0 = R.permute_dims(w_seg0)
            y0 = R.matmul(x, wt0, out_dtype="float32")
            q = R.reshape(y0, R.shape([n, 4, 4]))
            wt1 = R.permute_dims(w_seg1)
            y1 = R.matmul(x, wt1, out_dtype="float32")
            k = R.reshape(y1, R.shape([n, 1, 4]))
            wt2 = R.permute_dims(w_seg2)
            y2 = R.matmul(x, wt2, out_dtype="float32")
            v = R.reshape(y2, R.shape([n, 1, 4]))
            out = R.add(R.multiply(q, k), v)
            R.output(out)
        return out


@pytest.mark.parametrize("before, expected", [(GateUp, GateUpExpected), (Qkv, QkvExpected),
                                              (Sliced, SlicedExpected),
                                              (MultiQuery, MultiQueryExpected)],
                         ids=["gate_up", "qkv_conv1d", "strided_slices", "multi_query_heads"])
def test_a_fused_projection_becomes_one_matmul_per_segment(before, expected):
    after = SplitFusedProjections()(before)
    tvm.ir.assert_structural_equal(after["main"], expected["main"])
    assert [p.name for p in after["main"].params] == [p.name for p in expected["main"].params]
    assert relax_well_formed(after)
    # idempotent: nothing fused is left
    again = SplitFusedProjections()(after)
    tvm.ir.assert_structural_equal(again["main"], after["main"])
    assert derivations_of(again) == derivations_of(after)


def relax_well_formed(mod) -> bool:
    from tvm import relax

    return relax.analysis.check_well_formed(mod)


def test_the_derivations_say_how_each_parameter_is_cut_from_the_users_weight():
    after = SplitFusedProjections()(Qkv)
    found = derivations_of(after)["main"]
    # plain data in a module attribute: it survives TVMScript and TVM's own passes
    assert derivations_of(tvm.script.from_source(after.script()))["main"] == found
    assert derivations_of(tvm.relax.transform.LegalizeOps()(after))["main"] == found
    assert found.params == (
        DerivedParam("w_seg0", "w", (16, 48), 1, 0, 32),
        DerivedParam("w_seg1", "w", (16, 48), 1, 32, 40),
        DerivedParam("w_seg2", "w", (16, 48), 1, 40, 48),
        DerivedParam("b_seg0", "b", (48,), 0, 0, 32),
        DerivedParam("b_seg1", "b", (48,), 0, 32, 40),
        DerivedParam("b_seg2", "b", (48,), 0, 40, 48),
    )
    w = np.arange(16 * 48, dtype="float32").reshape(16, 48)
    bound = found.bind({"w": w, "other": 1})
    np.testing.assert_array_equal(bound["w_seg1"], w[:, 32:40])
    assert bound["other"] == 1 and "w" not in bound
    # derived names pass through; a weight given twice or of another shape is refused
    assert found.bind({"w_seg0": w[:, :32]})["w_seg0"].shape == (16, 32)
    with pytest.raises(td.errors.ArgumentError, match="given both whole and as its segment"):
        found.bind({"w": w, "w_seg0": w[:, :32]})
    with pytest.raises(td.errors.ArgumentError, match=r"weight 'w' has shape \[16, 47\]"):
        found.bind({"w": w[:, :47]})
    assert Derivations.from_json(found.to_json()) == found
    # a segment of a segment is one slice of the user's weight
    again = found.merged([DerivedParam("w_seg0_a", "w_seg0", (16, 32), 1, 8, 24)])
    assert again.params[-1] == DerivedParam("w_seg0_a", "w", (16, 48), 1, 8, 24)
    assert "w_seg0" not in {p.name for p in again.params}
    with pytest.raises(td.errors.ArgumentError, match=r"\[4, 60\) is not a non-empty range"):
        DerivedParam("w_seg9", "w", (16, 48), 1, 4, 60)


@I.ir_module
class NotFused:
    """The fused result escapes whole (the tuple is returned): nothing to split."""

    @R.function
    def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 24), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            y = R.matmul(x, w, out_dtype="float32")
            parts = R.split(y, 2, axis=1)
            a = parts[0]
            R.output(a, parts)
        return (a, parts)


@I.ir_module
class SharedWeight:
    """The weight has another use: it must stay whole, so nothing is split."""

    @R.function
    def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 24), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            y = R.matmul(x, w, out_dtype="float32")
            parts = R.split(y, 2, axis=1)
            a = parts[0]
            c = parts[1]
            s = R.sum(w)
            R.output(a, c, s)
        return (a, c, s)


@pytest.mark.parametrize("mod", [NotFused, SharedWeight], ids=["tuple_escapes", "weight_shared"])
def test_what_cannot_be_split_per_segment_is_left_alone(mod):
    after = SplitFusedProjections()(mod)
    tvm.ir.assert_structural_equal(after, mod)
    assert derivations_of(after) == {}


def test_an_annotated_weight_is_left_whole():
    # a fused weight the user placed already keeps that placement (run the pass first)
    from tvm_distx.plans.presets import Preset, set_device_meshes

    annotated = Preset((("w", "S[0]", None),)).apply(set_device_meshes(GateUp, [(2,)]))
    tvm.ir.assert_structural_equal(SplitFusedProjections()(annotated), annotated)


@I.ir_module
class BatchedExperts:
    """Every expert at once: a batched matmul over the fused (E, 2I, H) tensor."""

    @R.function
    def main(x: R.Tensor((4, 6, 16), "float32"), w: R.Tensor((4, 48, 16), "float32")
             ) -> R.Tensor((4, 6, 24), "float32"):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            wt = R.permute_dims(w, axes=[0, 2, 1])
            y = R.matmul(x, wt, out_dtype="float32")
            parts = R.split(y, 2, axis=2)
            gate = parts[0]
            up = parts[1]
            out = R.multiply(R.nn.silu(gate), up)
            R.output(out)
        return out


@I.ir_module
class BatchedExpertsExpected:
    @R.function
    def main(x: R.Tensor((4, 6, 16), "float32"), w_seg0: R.Tensor((4, 24, 16), "float32"),
             w_seg1: R.Tensor((4, 24, 16), "float32")) -> R.Tensor((4, 6, 24), "float32"):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            wt0 = R.permute_dims(w_seg0, axes=[0, 2, 1])
            gate = R.matmul(x, wt0, out_dtype="float32")
            wt1 = R.permute_dims(w_seg1, axes=[0, 2, 1])
            up = R.matmul(x, wt1, out_dtype="float32")
            out = R.multiply(R.nn.silu(gate), up)
            R.output(out)
        return out


def test_a_batched_expert_matmul_is_cut_on_the_fused_axis_of_the_3d_tensor():
    after = SplitFusedProjections()(BatchedExperts)
    tvm.ir.assert_structural_equal(after["main"], BatchedExpertsExpected["main"])
    assert derivations_of(after)["main"].params == (
        DerivedParam("w_seg0", "w", (4, 48, 16), 1, 0, 24),
        DerivedParam("w_seg1", "w", (4, 48, 16), 1, 24, 48))


# --------------------------------------------------------------------------- PyTorch models
torch = pytest.importorskip("torch")


def _column_per_segment(mod, column: dict[str, str], row: dict[str, str], parts: int):
    """``mod`` on a ``parts``-device mesh with the given column/row placements by glob."""
    from tvm_distx.plans.presets import Preset, set_device_meshes

    patterns = tuple((glob, placement, None) for glob, placement in {**column, **row}.items())
    return Preset(patterns).apply(set_device_meshes(mod, [(parts,)]))


def _collectives(annotated) -> list[str]:
    from tvm_distx.compiler.pipeline import run_stages

    return [r.collective for r in td.comm_report(run_stages(annotated)["local_view"]).rows]


class GatedMLP(torch.nn.Module):
    """A SwiGLU MLP whose gate and up projections are one fused Linear ((2I, H) weight)."""

    def __init__(self, hidden: int = 32, inner: int = 48) -> None:
        super().__init__()
        self.gate_up = torch.nn.Linear(hidden, 2 * inner)
        self.down = torch.nn.Linear(inner, hidden)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(torch.nn.functional.silu(gate) * up)


@pytest.fixture(scope="module")
def gated_mlp():
    from tvm_distx.frontend.pytorch import from_torch

    torch.manual_seed(0)
    net = GatedMLP().eval()
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        want = net(x).numpy()
    mod, weights = from_torch(net, (x,))
    split = SplitFusedProjections()(mod)
    annotated = _column_per_segment(split, {"*gate_up_weight_seg*": "S[0]",
                                            "*gate_up_bias_seg*": "S[0]"},
                                    {"*down_weight": "S[1]"}, 2)
    exe = td.compile(annotated)
    return annotated, exe, weights, x.numpy(), want


def test_a_fused_gate_up_runs_on_two_mpi_ranks_with_one_all_reduce(gated_mlp):
    annotated, exe, weights, x, want = gated_mlp
    # the user's own weights: the fused gate_up is cut per segment by the executable
    assert "p_gate_up_weight" in weights and "p_gate_up_weight_seg0" not in weights
    out = exe.run(x, params=weights, backend="mpi")
    np.testing.assert_allclose(out, want, atol=1e-5)
    # the row-parallel down projection's all-reduce, and nothing gathered for the chunk
    assert _collectives(annotated) == ["all_reduce"]
    specs = {p.name: p for p in exe.signatures["main"].params}
    for j in (0, 1):  # each rank holds half of each segment: rows [24j + 12r, 24j + 12r + 12)
        assert specs[f"p_gate_up_weight_seg{j}"].shape == (48, 32)
        assert specs[f"p_gate_up_weight_seg{j}"].local_shape == (24, 32)
        assert specs[f"p_gate_up_bias_seg{j}"].local_shape == (24,)


def test_a_bundle_takes_the_fused_weight_at_export_and_at_launch(gated_mlp, tmp_path):
    from tvm_distx.bundle.manifest import read_manifest
    from tvm_distx.runtime.backends import launch

    _, exe, weights, x, want = gated_mlp
    stored = exe.export(tmp_path / "stored", params=weights)
    manifest = read_manifest(stored)
    assert "p_gate_up_weight_seg1" in manifest.weights["main"]
    rank1 = manifest.read_weight(1, "p_gate_up_weight_seg1")
    # rank 1's half of the up segment: rows 48 + 24 .. 96 of the user's weight
    np.testing.assert_array_equal(rank1, weights["p_gate_up_weight"][72:96])
    np.testing.assert_allclose(launch(stored, [x], backend="disco"), want, atol=1e-5)
    # weights given at launch time, fused, to a bundle that stores none
    bare = exe.export(tmp_path / "bare")
    assert [p.name for p in read_manifest(bare).derivations["main"].params][:2] == [
        "p_gate_up_weight_seg0", "p_gate_up_weight_seg1"]
    np.testing.assert_allclose(launch(bare, [x], params=weights, backend="disco"), want,
                               atol=1e-5)


class FusedExperts(torch.nn.Module):
    """transformers' fused expert layout: gate_up_proj (E, 2I, H), down_proj (E, H, I)."""

    def __init__(self, experts: int = 4, hidden: int = 16, inner: int = 24) -> None:
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(experts, 2 * inner, hidden) / 4)
        self.down_proj = torch.nn.Parameter(torch.randn(experts, hidden, inner) / 4)

    def forward(self, x):
        out = 0
        for e in (0, 2):  # two experts, as a router would pick them
            gate, up = torch.nn.functional.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
            out = out + torch.nn.functional.linear(torch.nn.functional.silu(gate) * up,
                                                   self.down_proj[e])
        return out


def test_fused_3d_expert_tensors_are_split_per_segment():
    from tvm_distx.frontend.pytorch import from_torch

    torch.manual_seed(1)
    net = FusedExperts().eval()
    x = torch.randn(1, 5, 16)
    with torch.no_grad():
        want = net(x).numpy()
    mod, weights = from_torch(net, (x,))
    split = SplitFusedProjections()(mod)
    # one fused tensor read by both experts' matmuls is cut once, on its 2I axis
    assert derivations_of(split)["main"].params == (
        DerivedParam("p_gate_up_proj_seg0", "p_gate_up_proj", (4, 48, 16), 1, 0, 24),
        DerivedParam("p_gate_up_proj_seg1", "p_gate_up_proj", (4, 48, 16), 1, 24, 48),
    )
    annotated = _column_per_segment(split, {"*gate_up_proj_seg*": "S[1]"},
                                    {"*down_proj": "S[2]"}, 2)
    exe = td.compile(annotated)
    np.testing.assert_allclose(exe.run(x.numpy(), params=weights, backend="emulate"), want,
                               atol=1e-5)
    # the experts' down projections are partial sums added together: one all-reduce for
    # both (MergeAllReduces); nothing gathered for the chunks
    assert _collectives(annotated) == ["all_reduce"]
    assert {p.name: p.local_shape for p in exe.signatures["main"].params
            if "seg" in p.name} == {"p_gate_up_proj_seg0": (4, 12, 16),
                                    "p_gate_up_proj_seg1": (4, 12, 16)}


# --------------------------------------------------------------------------- GPT-2
@pytest.fixture(scope="module")
def gpt2():
    transformers = pytest.importorskip("transformers")

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2,
                                     n_head=4, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 128, (1, 7))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits.numpy()
    mod, weights = td.from_torch(model, (ids,))  # input_ids -> logits
    return mod, weights, (ids.numpy(),), want


# GPT-2's Conv1D stores (in, out): column parallel splits dim 1, row parallel dim 0
_GPT2_COLUMN = {"*c_attn_weight_seg*": "S[1]", "*c_attn_bias_seg*": "S[0]",
                "*c_fc_weight": "S[1]", "*c_fc_bias": "S[0]"}
_GPT2_ROW = {"*c_proj_weight": "S[0]"}


@pytest.mark.parametrize("parts", [2, 4])
def test_gpt2_c_attn_is_split_per_segment_and_equals_transformers_on_mpi(gpt2, parts):
    imported, weights, inputs, want = gpt2
    mod = SplitFusedProjections()(imported)
    fused = "p_transformer_h_0_attn_c_attn_weight"
    assert weights[fused].shape == (64, 192) and f"{fused}_seg0" not in weights
    assert [d.stop - d.start for d in derivations_of(mod)["main"].params
            if d.source == fused] == [64, 64, 64]  # q | k | v, found from the split
    annotated = _column_per_segment(mod, _GPT2_COLUMN, _GPT2_ROW, parts)
    # per layer one all-reduce after attention and one after the MLP; nothing gathered
    assert _collectives(annotated) == ["all_reduce"] * 4
    exe = td.compile(annotated)
    specs = {p.name: p for p in exe.signatures["main"].params}
    held = sum(np.prod(specs[f"{fused}_seg{j}"].local_shape) for j in range(3))
    assert held * parts == weights[fused].size  # each rank holds 1/p of c_attn: 1/p of q, k, v
    out = exe.run(*inputs, params=weights, backend="mpi")
    np.testing.assert_allclose(out, want, atol=1e-4)



def test_gpt2_c_attn_split_evenly_instead_gathers_every_layer(gpt2):
    # what the pass avoids: an even split of the fused (64, 192) weight puts a rank
    # boundary inside k, and every layer all-gathers q|k|v to cut it
    imported, _, _, _ = gpt2
    column = {"*c_attn_weight": "S[1]", "*c_attn_bias": "S[0]",
              **{g: p for g, p in _GPT2_COLUMN.items() if "c_attn" not in g}}
    collectives = _collectives(_column_per_segment(imported, column, _GPT2_ROW, 2))
    moves = [c for c in collectives if c != "local_slice"]  # slices move nothing
    assert moves == ["all_gather", "all_reduce", "all_reduce"] * 2
    assert "local_slice" in collectives  # q, k and v cut again after the gather


_GATE_UP_SCRIPT = """
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class GateUpOnTwo:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.Tensor((8, 16), "float32"), w: R.Tensor((64, 16), "float32"),
             d: R.Tensor((32, 16), "float32")) -> R.Tensor((8, 16), "float32"):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            parts = R.split(R.matmul(x, R.permute_dims(w)), 2, axis=-1)
            gate = parts[0]
            up = parts[1]
            out = R.matmul(R.multiply(R.nn.silu(gate), up), d)
            R.output(out)
        return out
"""


def test_the_command_line_splits_fused_projections_and_takes_fused_weights(tmp_path):
    import json
    import subprocess
    import sys

    (tmp_path / "model.py").write_text(_GATE_UP_SCRIPT)
    (tmp_path / "rules.json").write_text(json.dumps(
        [{"param": "w_seg0", "result": "S[0]"}, {"param": "w_seg1", "result": "S[0]"},
         {"param": "d", "result": "S[0]"}]))
    rng = np.random.default_rng(3)
    x, w, d = (rng.standard_normal(s, dtype="float32") / 4 for s in [(8, 16), (64, 16),
                                                                     (32, 16)])
    np.savez(tmp_path / "w.npz", w=w, d=d)
    np.save(tmp_path / "x.npy", x)

    def cli(*argv):
        done = subprocess.run([sys.executable, "-m", "tvm_distx", *argv], capture_output=True,
                              text=True, timeout=300, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        return done.stdout

    cli("compile", "model.py", "--split-fused", "--rules", "rules.json", "--weights", "w.npz",
        "-o", "bundle")
    cli("run", "bundle", "-n", "2", "--backend", "disco", "-i", "x.npy", "-o", "out")
    gate, up = np.split(x @ w.T, 2, axis=-1)
    want = (gate / (1 + np.exp(-gate)) * up) @ d
    np.testing.assert_allclose(np.load(tmp_path / "out" / "out0.npy"), want, atol=1e-5)
    plan = cli("plan", "model.py", "--split-fused", "--rules", "rules.json")
    assert "all_reduce" in plan and "all_gather" not in plan
