"""td.quantize: weights stored as 16-bit floats or int8/int4 groups, decoded before each read.

The decode is Relax operators, so propagation shards it: a column-parallel weight
splits its scales by rows, a row-parallel one its groups. Numbers on emulated ranks
equal numpy on the decoded weights; the collectives are those of the float32 plan.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm.script import ir as I, relax as R

import tvm_distx as td
from tvm_distx import AnnotateSharding, ShardingRule
from tvm_distx.compiler.pipeline import run_stages
from tvm_distx.sources import formats
from tvm_distx.errors import ArgumentError, RuleError
from tvm_distx.passes.quantize import weight_formats
from tvm_distx.plans import presets


@I.ir_module
class Linear:
    @R.function
    def main(x: R.Tensor((1, 64), "float32"), w: R.Tensor((32, 64), "float32")):
        with R.dataflow():
            wt = R.permute_dims(w, axes=None)
            y = R.matmul(x, wt)
            R.output(y)
        return y


@I.ir_module
class LinearQ8:
    @R.function
    def main(x: R.Tensor((1, 64), "float32"), w: R.Tensor((32, 64), "int8"),
             w_scale: R.Tensor((32, 2), "float16")):
        with R.dataflow():
            values = R.reshape(R.astype(w, "float32"), R.shape([32, 2, 32]))
            scale = R.reshape(R.astype(w_scale, "float32"), R.shape([32, 2, 1]))
            w_decoded = R.reshape(R.multiply(values, scale), R.shape([32, 64]))
            wt = R.permute_dims(w_decoded, axes=None)
            y = R.matmul(x, wt)
            R.output(y)
        return y


@I.ir_module
class LinearBF16:
    @R.function
    def main(x: R.Tensor((1, 64), "float32"), w: R.Tensor((32, 64), "bfloat16")):
        with R.dataflow():
            w_decoded = R.astype(w, "float32")
            wt = R.permute_dims(w_decoded, axes=None)
            y = R.matmul(x, wt)
            R.output(y)
        return y


def _without_formats(mod: tvm.IRModule) -> tvm.IRModule:
    return tvm.IRModule(dict(mod.functions))


@pytest.mark.parametrize("fmt, expected", [("q8", LinearQ8), ("bf16", LinearBF16)])
def test_a_linear_weight_is_stored_in_the_format_and_decoded_before_its_matmul(fmt, expected):
    weight = np.ones((32, 64), "float32")
    mod, weights = td.quantize(Linear, {"w": weight}, fmt)
    tvm.ir.assert_structural_equal(_without_formats(mod), expected)
    assert weight_formats(mod) == {"w": fmt}
    assert sorted(weights) == (["w", "w_scale"] if fmt == "q8" else ["w"])
    parts = {part: np.asarray(weights[name]) for part, name in
             (("data", "w"), ("scale", "w_scale")) if name in weights}
    assert np.array_equal(parts["data"], formats.encode(weight, fmt)["data"])
    # the caller's module is left as it was
    assert Linear["main"].params[1].ty.dtype == "float32"


@I.ir_module
class MLP:
    """A column-parallel then a row-parallel linear, Megatron's MLP, and a tied table."""

    @R.function
    def main(ids: R.Tensor((1, 2), "int64"), table: R.Tensor((256, 128), "float32"),
             up: R.Tensor((256, 128), "float32"), down: R.Tensor((128, 256), "float32"),
             norm: R.Tensor((128,), "float32")):
        with R.dataflow():
            x = R.take(table, R.reshape(ids, R.shape([2])), axis=0)
            h = R.nn.relu(R.matmul(x, R.permute_dims(up, axes=None)))
            y = R.multiply(R.matmul(h, R.permute_dims(down, axes=None)), norm)
            logits = R.matmul(y, R.permute_dims(table, axes=None))
            R.output(logits)
        return logits


RULES = [ShardingRule(param="up", result="S[0]"), ShardingRule(param="down", result="S[1]")]


def _weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"table": rng.standard_normal((256, 128), dtype="float32"),
            "up": rng.standard_normal((256, 128), dtype="float32") * 0.1,
            "down": rng.standard_normal((128, 256), dtype="float32") * 0.1,
            "norm": rng.standard_normal(128, dtype="float32")}


def _decoded(weights: dict, name: str) -> np.ndarray:
    value = weights[name]
    if not isinstance(value, formats.EncodedPart):
        return np.asarray(value, dtype="float32")
    parts = {"data": np.asarray(value)}
    if value.fmt.quantized:
        parts["scale"] = np.asarray(weights[name + "_scale"])
    return formats.decode(parts, value.fmt)


@pytest.mark.parametrize("fmt, ranks", [("q8", 2), ("q4", 4), ("bf16", 2), ("f16", 4)])
def test_each_format_on_emulated_ranks_equals_numpy_on_the_decoded_weights(fmt, ranks):
    annotated = AnnotateSharding(RULES)(presets.set_device_meshes(MLP, [(ranks,)]))
    mod, weights = td.quantize(annotated, _weights(), fmt)
    quantized = fmt in ("q8", "q4")
    # the linears and the table (its rows are read whole) take the format; the norm, a
    # vector, keeps float32 under a quantization and takes a 16-bit format
    assert weight_formats(mod) == {"table": fmt, "up": fmt, "down": fmt,
                                   **({} if quantized else {"norm": fmt})}
    ids = np.array([[7, 200]])
    out = td.compile(mod).run(ids, params=weights, backend="emulate")
    table, up, down, norm = (_decoded(weights, n) for n in ("table", "up", "down", "norm"))
    want = ((np.maximum(table[ids[0]] @ up.T, 0) @ down.T) * norm) @ table.T
    assert np.abs(out - want).max() <= 1e-4 * np.abs(want).max()


def test_the_stored_parts_share_the_weights_placement_and_the_plan_moves_the_same_bytes():
    annotated = AnnotateSharding(RULES)(presets.set_device_meshes(MLP, [(2,)]))
    mod, _ = td.quantize(annotated, _weights(), "q4")
    report = td.explain(tvm.relax.transform.LegalizeOps()(mod))
    placement = {r.value: r.placement for r in report.for_function("main")}
    assert placement["up"] == placement["up_scale"] == "S[0]"       # rows: scales by rows
    assert placement["down"] == placement["down_scale"] == "S[1]"   # groups split
    assert placement["table"] == placement["table_scale"] == "R"

    def collectives(module):
        report = td.comm_report(run_stages(module)["local_view"])
        return sorted((r.collective, r.src, r.dst, r.bytes_per_rank) for r in report.rows)

    # one all-reduce of the row-parallel linear's (2, 128) float32 result, as in float32
    assert collectives(mod) == collectives(annotated) == [("all_reduce", "P", "R", 1024)]


@I.ir_module
class Residual:
    """Megatron's MLP block on a residual stream, then an untied head."""

    @R.function
    def main(x: R.Tensor((2, 128), "float32"), up: R.Tensor((256, 128), "float32"),
             down: R.Tensor((128, 256), "float32"), head: R.Tensor((64, 128), "float32")):
        with R.dataflow():
            h = R.nn.relu(R.matmul(x, R.permute_dims(up, axes=None)))
            y = R.add(x, R.matmul(h, R.permute_dims(down, axes=None)))
            logits = R.matmul(y, R.permute_dims(head, axes=None))
            R.output(logits)
        return logits


def test_tensor_parallel_plans_before_quantize_and_refuses_a_module_quantized_already():
    meshed = presets.set_device_meshes(Residual, [(2,)])
    preset = presets.tensor_parallel()
    weights = {name: value for name, value in _weights(1).items() if name in ("up", "down")}
    weights["head"] = np.random.default_rng(2).standard_normal((64, 128), dtype="float32")
    quantized, _ = td.quantize(meshed, weights, "q8")
    with pytest.raises(RuleError, match="stored quantized already") as err:
        preset.apply(quantized)
    assert "td.quantize(annotated, weights, fmt)" in err.value.hint
    # the order the hint gives: the plan's placements move onto the stored parts
    assert [preset.plan(meshed).role(n).role for n in ("up", "down")] == ["column", "row"]
    mod, stored = td.quantize(preset.apply(meshed), weights, "q8")
    report = td.explain(tvm.relax.transform.LegalizeOps()(mod))
    placement = {r.value: r.placement for r in report.for_function("main")}
    assert placement["up"] == placement["up_scale"] == "S[0]"
    assert placement["down"] == placement["down_scale"] == "S[1]"
    x = np.random.default_rng(3).standard_normal((2, 128), dtype="float32")
    out = td.compile(mod).run(x, params=stored, backend="emulate")
    up, down, head = (_decoded(stored, n) for n in ("up", "down", "head"))
    want = (x + np.maximum(x @ up.T, 0) @ down.T) @ head.T
    assert np.abs(out - want).max() <= 1e-4 * np.abs(want).max()


@I.ir_module
class Calls:
    """One linear, a private function called with two weights (Megatron's pair)."""

    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function(private=True)
    def linear(x: R.Tensor((2, 64), "float32"), w: R.Tensor((64, 64), "float32")):
        with R.dataflow():
            y = R.matmul(x, R.permute_dims(w, axes=None))
            R.output(y)
        return y

    @R.function
    def main(x: R.Tensor((2, 64), "float32"), up: R.Tensor((64, 64), "float32"),
             down: R.Tensor((64, 64), "float32")):
        cls = Calls
        with R.dataflow():
            up_ann = R.dist.annotate_sharding(up, device_mesh="mesh[0]", placement="S[0]")
            down_ann = R.dist.annotate_sharding(down, device_mesh="mesh[0]", placement="S[1]")
            h = R.nn.relu(cls.linear(x, up_ann))
            y = cls.linear(h, down_ann)
            R.output(y)
        return y


@pytest.mark.parametrize("fmt", ["q8", "bf16"])
def test_a_weight_passed_to_a_private_function_is_passed_stored_and_decoded_where_read(fmt):
    rng = np.random.default_rng(4)
    weights = {n: rng.standard_normal((64, 64), dtype="float32") for n in ("up", "down")}
    mod, stored = td.quantize(Calls, weights, fmt)
    # the callee takes the stored parts; the caller passes them on and decodes nothing
    params = [(p.name, str(p.ty.dtype)) for p in mod["linear"].params]
    assert params == [("x", "float32"), ("w", "int8"), ("w_scale", "float16")] if fmt == "q8" \
        else params == [("x", "float32"), ("w", "bfloat16")]
    assert "astype" not in mod["main"].script()
    x = rng.standard_normal((2, 64), dtype="float32")
    out = td.compile(mod).run(x, params=stored, backend="emulate")
    up, down = (_decoded(stored, n) for n in ("up", "down"))
    want = np.maximum(x @ up.T, 0) @ down.T
    assert np.abs(out - want).max() <= 1e-4 * np.abs(want).max()


def test_a_private_function_given_weights_of_two_formats_in_one_place_is_refused():
    rng = np.random.default_rng(4)
    weights = {n: rng.standard_normal((64, 64), dtype="float32") for n in ("up", "down")}
    with pytest.raises(ArgumentError, match="'linear' takes weights of two formats") as err:
        td.quantize(Calls, weights, {"up": "q8", "down": "q4"})
    assert "quantize(mod, weights, {" in err.value.hint


def test_a_tied_table_is_decoded_once_per_read():
    mod, _ = td.quantize(MLP, _weights(), "q8")
    text = mod["main"].script()
    # the lookup and the LM head each decode the table for themselves, so each decode is
    # fused into its own kernel and no float copy of the table is made
    assert text.count('R.astype(table, dtype="float32")') == 2


def test_a_split_that_cuts_a_group_is_refused_naming_weight_group_and_ranks():
    annotated = AnnotateSharding(RULES)(presets.set_device_meshes(MLP, [(16,)]))
    with pytest.raises(ArgumentError) as err:  # down: 256 inputs are 8 groups of 32
        td.quantize(annotated, _weights(), "q8")
    message = str(err.value)
    assert "'down'" in message and "groups of 32" in message and "16 ranks" in message
    assert "S[0]" in err.value.hint


def test_weights_that_are_not_read_along_their_last_axis_keep_their_dtype_or_take_dtype():
    @I.ir_module
    class Conv1D:  # GPT-2's layout: x @ W with W (in, out), summed over its first axis
        @R.function
        def main(x: R.Tensor((1, 64), "float32"), w: R.Tensor((64, 64), "float32")):
            with R.dataflow():
                y = R.matmul(x, w)
                R.output(y)
            return y

    mod, weights = td.quantize(Conv1D, {"w": np.ones((64, 64), "float32")}, "q8")
    assert weight_formats(mod) == {} and mod["main"].params[1].ty.dtype == "float32"
    mod, weights = td.quantize(Conv1D, {"w": np.ones((64, 64), "float32")}, "q8",
                               dtype="bf16")
    assert weight_formats(mod) == {"w": "bf16"}
    assert weights["w"].dtype == formats.bfloat16()


@pytest.mark.parametrize("call, message", [
    (lambda: td.quantize(Linear, {"w": np.ones((32, 64))}, "q3"), "'q3' is not a weight format"),
    (lambda: td.quantize(Linear, {"w": np.ones((32, 64))}, "q4", dtype="q8"),
     "take a float format"),
    (lambda: td.quantize(Linear, {"w": np.ones((32, 64))}, {"w": "q8", "x": "q4"}),
     None),
])
def test_bad_formats_are_refused_with_the_choices(call, message):
    if message is None:  # an explicit mapping may name inputs that are not weights
        mod, _ = call()
        assert weight_formats(mod) == {"w": "q8"}
        return
    with pytest.raises(ArgumentError, match=message):
        call()


def test_explain_counts_each_ranks_parameter_bytes_in_their_stored_dtype():
    legalize = tvm.relax.transform.LegalizeOps()
    annotated = AnnotateSharding(RULES)(presets.set_device_meshes(MLP, [(2,)]))
    mod, _ = td.quantize(annotated, _weights(), "q4")
    # float32: the table whole (128 KiB), half of up and of down (64 KiB each), the norm, ids
    (f32,) = td.explain(legalize(annotated)).weights
    assert (f32.label, f32.per_rank, f32.total) == (
        "parameters", 131072 + 2 * 65536 + 512 + 16, 3 * 131072 + 512 + 16)
    # q4: half a byte per value and a float16 scale per 32: 1/7.1 of the float32 bytes
    (q4,) = td.explain(legalize(mod)).weights
    assert q4.per_rank == (16384 + 2048) + 2 * (8192 + 1024) + 512 + 16
    assert "parameters per rank: 36.52 KiB of 54.52 KiB" in str(td.explain(legalize(mod)))
