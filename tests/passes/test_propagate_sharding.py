"""Interprocedural PropagateSharding across the call graph: Before/Expected modules compared structurally.

Shardings flow into and out of private functions, a function called with
several shardings gets one version per sharding, and call graphs the pass
cannot handle (recursion, a call on two meshes) are refused by name. Decisions
inside one function are in ``passes/test_propagate_within_function.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import tvm_distx as td
from propagation_tools import propagate
from tvm_distx import ShardingRule
from tvm_distx.passes import AnnotateSharding, PropagateSharding
from tvm_distx.errors import CallGraphError
from locations import TESTS_DIR

DATA = TESTS_DIR / "data"


# --------------------------------------------------------------------------- the seed pipeline
@I.ir_module
class SeedPipelinePropagated:
    I.module_attrs({"device_num": 2})
    I.module_global_infos(
        {"mesh": [R.dist.device_mesh((1,), I.Range(0, 1)), R.dist.device_mesh((1,), I.Range(1, 2))]}
    )

    @R.function(private=True)
    def mlp(
        x: R.dist.DTensor((128, 128), "float32", "mesh[0]", "R"),
        A: R.dist.DTensor((128, 128), "float32", "mesh[0]", "R"),
        B: R.dist.DTensor((128, 128), "float32", "mesh[0]", "R"),
    ) -> R.dist.DTensor((128, 128), "float32", "mesh[0]", "R"):
        with R.dataflow():
            lv0 = R.matmul(x, A)
            lv1 = R.nn.relu(lv0)
            lv2 = R.matmul(lv1, B)
            R.output(lv2)
        return lv2

    @R.function(private=True)
    def mlp_1(
        x: R.dist.DTensor((128, 128), "float32", "mesh[1]", "R"),
        A: R.dist.DTensor((128, 128), "float32", "mesh[1]", "R"),
        B: R.dist.DTensor((128, 128), "float32", "mesh[1]", "R"),
    ) -> R.dist.DTensor((128, 128), "float32", "mesh[1]", "R"):
        with R.dataflow():
            lv0 = R.matmul(x, A)
            lv1 = R.nn.relu(lv0)
            lv2 = R.matmul(lv1, B)
            R.output(lv2)
        return lv2

    @R.function
    def main(
        x: R.dist.DTensor((128, 128), "float32", "mesh[0]", "R"),
        A: R.dist.DTensor((128, 128), "float32", "mesh[0]", "R"),
        B: R.dist.DTensor((128, 128), "float32", "mesh[0]", "R"),
    ) -> R.dist.DTensor((128, 128), "float32", "mesh[1]", "R"):
        cls = SeedPipelinePropagated
        with R.dataflow():
            y = cls.mlp(x, A, B)
            y_ann = R.dist.redistribute(y, device_mesh="mesh[1]", placement="R")
            A_redist = R.dist.redistribute(A, device_mesh="mesh[1]", placement="R")
            B_redist = R.dist.redistribute(B, device_mesh="mesh[1]", placement="R")
            z = cls.mlp_1(y_ann, A_redist, B_redist)
            R.output(z)
        return z


def test_seed_pipeline_end_to_end():
    mod = td.load_module(DATA / "seed_pipeline.py")
    rule = ShardingRule(callee="mlp", args={0: "R"}, meshes=["mesh[0]", "mesh[1]"])
    out = propagate(AnnotateSharding([rule])(mod))
    tvm.ir.assert_structural_equal(out, SeedPipelinePropagated)


def test_plain_tvm_fails_on_the_seed_pipeline():
    """The bug we exist for: TVM's pass cannot type a call of a private function."""
    mod = td.load_module(DATA / "seed_pipeline.py")
    rule = ShardingRule(callee="mlp", args={0: "R"}, meshes="mesh[0]")
    annotated = AnnotateSharding([rule])(mod)
    with pytest.raises(Exception, match="Argument 0 type mismatch"):
        relax.distributed.transform.PropagateSharding()(annotated)
    out = propagate(annotated)  # ours handles it: one version of mlp on mesh[0]
    assert sorted(gv.name_hint for gv in out.get_global_vars()) == ["main", "mlp"]


# --------------------------------------------------------------------------- tensor parallel
@I.ir_module
class TensorParallelPropagated:
    I.module_attrs({"device_num": 2})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function(private=True)
    def mlp(
        x: R.dist.DTensor((128, 128), "float32", "mesh[0]", "R"),
        A: R.dist.DTensor((128, 128), "float32", "mesh[0]", "S[1]"),
        B: R.dist.DTensor((128, 128), "float32", "mesh[0]", "S[0]"),
    ) -> R.dist.DTensor((128, 128), "float32", "mesh[0]", "R"):
        with R.dataflow():
            lv0 = R.matmul(x, A)
            lv1 = R.nn.relu(lv0)
            lv2 = R.matmul(lv1, B)
            R.output(lv2)
        return lv2

    @R.function
    def main(
        x: R.dist.DTensor((128, 128), "float32", "mesh[0]", "R"),
        A: R.dist.DTensor((128, 128), "float32", "mesh[0]", "S[1]"),
        B: R.dist.DTensor((128, 128), "float32", "mesh[0]", "S[0]"),
    ) -> R.dist.DTensor((128, 128), "float32", "mesh[0]", "R"):
        cls = TensorParallelPropagated
        with R.dataflow():
            y = cls.mlp(x, A, B)
            z = cls.mlp(y, A, B)
            R.output(z)
        return z


def test_annotations_inside_a_callee_flow_out_to_the_caller():
    mod = td.load_module(DATA / "seed_tensor_parallel.py")
    rules = [
        ShardingRule(param="A", result="S[1]", function="mlp"),
        ShardingRule(param="B", result="S[0]", function="mlp"),
    ]
    out = propagate(AnnotateSharding(rules)(mod))
    # both calls have one signature: one version of mlp
    tvm.ir.assert_structural_equal(out, TensorParallelPropagated)


def test_tensor_parallel_from_call_site_annotations():
    mod = td.load_module(DATA / "seed_tensor_parallel.py")
    rule = ShardingRule(callee="mlp", args={1: "S[1]", 2: "S[0]"}, function="main")
    out = propagate(AnnotateSharding([rule])(mod))
    tvm.ir.assert_structural_equal(out, TensorParallelPropagated)


# --------------------------------------------------------------------------- 2x2 mesh
def test_2x2_mesh_data_and_model_parallel():
    mod = td.load_module(DATA / "seed_mesh2x2.py")
    rule = ShardingRule(callee="mlp", args={0: "S[0]R", 1: "RS[1]", 2: "RS[0]"})
    out = propagate(AnnotateSharding([rule])(mod))
    mlp = out["mlp"]
    got = [str(p.ty.placement) for p in mlp.params]
    assert got == ['"S[0], R"', '"R, S[1]"', '"R, S[0]"']
    body = mlp.body.blocks[0].bindings
    assert [str(b.var.ty.placement) for b in body] == ['"S[0], S[1]"', '"S[0], S[1]"', '"S[0], R"']
    assert list(out.get_global_vars()).__len__() == 2  # one mlp version, shared by both calls


# --------------------------------------------------------------------------- chains and nesting
def _chain_module(layers: int):
    bb = relax.BlockBuilder()
    mesh = relax.distributed.DeviceMesh((2,), tvm.ir.Range(0, 2))
    ty = relax.TensorType((64, 64), "float32")
    x, w1, w2 = relax.Var("x", ty), relax.Var("w1", ty), relax.Var("w2", ty)
    with bb.function("layer", [x, w1, w2], private=True):
        with bb.dataflow():
            h = bb.emit(relax.op.matmul(x, w1))
            h = bb.emit(relax.op.nn.relu(h))
            out = bb.emit_output(relax.op.matmul(h, w2))
        layer = bb.emit_func_output(out)
    params = [relax.Var("x", ty)] + [relax.Var(f"w{i}", ty) for i in range(2 * layers)]
    with bb.function("main", params):
        with bb.dataflow():
            h = params[0]
            for i in range(layers):
                h = bb.emit(relax.Call(layer, [h, params[1 + 2 * i], params[2 + 2 * i]]))
            out = bb.emit_output(h)
        bb.emit_func_output(out)
    mod = bb.get()
    mod.update_global_info("mesh", [mesh])
    return mod


def test_24_layer_chain_gives_exactly_one_specialised_version():
    mod = _chain_module(24)
    rules = [
        ShardingRule(param="w1", result="S[1]", function="layer"),
        ShardingRule(param="w2", result="S[0]", function="layer"),
    ]
    out = propagate(AnnotateSharding(rules)(mod))
    names = sorted(gv.name_hint for gv in out.get_global_vars())
    assert names == ["layer", "main"]
    main = out["main"]
    assert all(str(p.ty.placement) == '"S[1]"' for p in main.params[1::2])
    assert all(str(p.ty.placement) == '"S[0]"' for p in main.params[2::2])
    calls = [b.value for b in main.body.blocks[0].bindings if isinstance(b.value, relax.Call)]
    assert len(calls) == 24 and all(c.op.name_hint == "layer" for c in calls)


@I.ir_module
class Nested:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function(private=True)
    def inner(a: R.Tensor((8, 8), "float32"), w: R.Tensor((8, 8), "float32")) -> R.Tensor((8, 8), "float32"):
        w_ann = R.dist.annotate_sharding(w, device_mesh="mesh[0]", placement="S[1]")
        y = R.matmul(a, w_ann)
        return y

    @R.function(private=True)
    def middle(a: R.Tensor((8, 8), "float32"), w: R.Tensor((8, 8), "float32")) -> R.Tensor((8, 8), "float32"):
        cls = Nested
        y = cls.inner(a, w)
        z = R.nn.relu(y)
        return z

    @R.function
    def main(a: R.Tensor((8, 8), "float32"), w: R.Tensor((8, 8), "float32")) -> R.Tensor((8, 8), "float32"):
        cls = Nested
        z = cls.middle(a, w)
        return z


@I.ir_module
class NestedPropagated:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function(private=True)
    def inner(
        a: R.dist.DTensor((8, 8), "float32", "mesh[0]", "R"),
        w: R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[1]"),
    ) -> R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[1]"):
        y = R.matmul(a, w)
        return y

    @R.function(private=True)
    def middle(
        a: R.dist.DTensor((8, 8), "float32", "mesh[0]", "R"),
        w: R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[1]"),
    ) -> R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[1]"):
        cls = NestedPropagated
        y = cls.inner(a, w)
        z = R.nn.relu(y)
        return z

    @R.function
    def main(
        a: R.dist.DTensor((8, 8), "float32", "mesh[0]", "R"),
        w: R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[1]"),
    ) -> R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[1]"):
        cls = NestedPropagated
        z = cls.middle(a, w)
        return z


def test_nested_calls_propagate_both_ways():
    tvm.ir.assert_structural_equal(propagate(Nested), NestedPropagated)


def test_pass_is_a_fixed_point():
    once = propagate(Nested)
    tvm.ir.assert_structural_equal(propagate(once), once)


# --------------------------------------------------------------------------- mixed use
@I.ir_module
class CalledBothWays:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function(private=True)
    def f(a: R.Tensor((8, 8), "float32")) -> R.Tensor((8, 8), "float32"):
        y = R.nn.relu(a)
        return y

    @R.function
    def sharded(a: R.Tensor((8, 8), "float32")) -> R.Tensor((8, 8), "float32"):
        cls = CalledBothWays
        a1 = R.dist.annotate_sharding(a, device_mesh="mesh[0]", placement="S[0]")
        y = cls.f(a1)
        return y

    @R.function
    def plain(a: R.Tensor((8, 8), "float32")) -> R.Tensor((8, 8), "float32"):
        cls = CalledBothWays
        y = cls.f(a)
        return y


@I.ir_module
class CalledBothWaysPropagated:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function(private=True)
    def f(a: R.Tensor((8, 8), "float32")) -> R.Tensor((8, 8), "float32"):
        y = R.nn.relu(a)
        return y

    @R.function(private=True)
    def f_1(
        a: R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]"),
    ) -> R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]"):
        y = R.nn.relu(a)
        return y

    @R.function
    def sharded(
        a: R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]"),
    ) -> R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]"):
        cls = CalledBothWaysPropagated
        y = cls.f_1(a)
        return y

    @R.function
    def plain(a: R.Tensor((8, 8), "float32")) -> R.Tensor((8, 8), "float32"):
        cls = CalledBothWaysPropagated
        y = cls.f(a)
        return y


def test_function_called_with_and_without_sharding_is_specialised():
    tvm.ir.assert_structural_equal(propagate(CalledBothWays), CalledBothWaysPropagated)


# --------------------------------------------------------------------------- errors
@I.ir_module
class Recursive:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function(private=True)
    def f(a: R.Tensor((8, 8), "float32")) -> R.Tensor((8, 8), "float32"):
        cls = Recursive
        y = cls.g(a)
        return y

    @R.function(private=True)
    def g(a: R.Tensor((8, 8), "float32")) -> R.Tensor((8, 8), "float32"):
        cls = Recursive
        y = cls.f(a)
        return y

    @R.function
    def main(a: R.Tensor((8, 8), "float32")) -> R.Tensor((8, 8), "float32"):
        cls = Recursive
        a1 = R.dist.annotate_sharding(a, device_mesh="mesh[0]", placement="S[0]")
        y = cls.f(a1)
        return y


def test_mutual_recursion_is_rejected_with_the_cycle():
    with pytest.raises(CallGraphError, match="f -> g -> f") as info:
        PropagateSharding()(Recursive)
    assert info.value.function == "g"
    assert isinstance(info.value, td.errors.ShardingError)


@I.ir_module
class TwoHomes:
    I.module_global_infos(
        {"mesh": [R.dist.device_mesh((2,), I.Range(0, 2)), R.dist.device_mesh((2,), I.Range(2, 4))]}
    )

    @R.function(private=True)
    def f(a: R.Tensor((8, 8), "float32"), b: R.Tensor((8, 8), "float32")) -> R.Tensor((8, 8), "float32"):
        y = R.add(a, b)
        return y

    @R.function
    def main(a: R.Tensor((8, 8), "float32"), b: R.Tensor((8, 8), "float32")) -> R.Tensor((8, 8), "float32"):
        cls = TwoHomes
        a1 = R.dist.annotate_sharding(a, device_mesh="mesh[0]", placement="S[0]")
        b1 = R.dist.annotate_sharding(b, device_mesh="mesh[1]", placement="R")
        y = cls.f(a1, b1)
        return y


def test_call_with_annotated_arguments_on_two_meshes_is_ambiguous():
    with pytest.raises(td.errors.ShardingConflictError) as info:
        PropagateSharding()(TwoHomes)
    text = str(info.value)
    assert info.value.function == "main"
    assert "the call of 'f' at 'y'" in text and '"S[0]" on mesh[0]' in text
    assert '"R" on mesh[1]' in text


# --------------------------------------------------------------------------- tuples
@I.ir_module
class TupleCallee:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function(private=True)
    def f(
        a: R.Tensor((8, 8), "float32"), w: R.Tensor((8, 8), "float32")
    ) -> R.Tuple(R.Tensor((8, 8), "float32"), R.Tensor((8, 8), "float32")):
        y = R.matmul(a, w)
        z = R.nn.relu(y)
        return (y, z)

    @R.function
    def main(a: R.Tensor((8, 8), "float32"), w: R.Tensor((8, 8), "float32")) -> R.Tensor((8, 8), "float32"):
        cls = TupleCallee
        a1 = R.dist.annotate_sharding(a, device_mesh="mesh[0]", placement="S[0]")
        t = cls.f(a1, w)
        t0 = t[0]
        t1 = t[1]
        out = R.add(t0, t1)
        return out


@I.ir_module
class TupleCalleePropagated:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function(private=True)
    def f(
        a: R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]"),
        w: R.dist.DTensor((8, 8), "float32", "mesh[0]", "R"),
    ) -> R.Tuple(
        R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]"),
        R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]"),
    ):
        y = R.matmul(a, w)
        z = R.nn.relu(y)
        return (y, z)

    @R.function
    def main(
        a: R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]"),
        w: R.dist.DTensor((8, 8), "float32", "mesh[0]", "R"),
    ) -> R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]"):
        cls = TupleCalleePropagated
        t = cls.f(a, w)
        t0 = t[0]
        t1 = t[1]
        out = R.add(t0, t1)
        return out


def test_tuple_returning_callee():
    tvm.ir.assert_structural_equal(propagate(TupleCallee), TupleCalleePropagated)


# --------------------------------------------------------------------------- explain
def test_explain_reports_mesh_placement_local_shape_and_reason():
    mod = td.load_module(DATA / "seed_tensor_parallel.py")
    rules = [
        ShardingRule(param="A", result="S[1]", function="mlp"),
        ShardingRule(param="B", result="S[0]", function="mlp"),
    ]
    report = td.explain(AnnotateSharding(rules)(mod))
    row = report.row("mlp", "lv0")
    assert (row.mesh, row.placement, row.global_shape, row.local_shape) == (
        "mesh[0]", "S[1]", (128, 128), (128, 64))
    assert row.reason == "result of relax.matmul at 'lv0'"
    assert report.row("mlp", "A_ann").reason == "annotate_sharding \"S[1]\" on mesh[0] in 'mlp'"
    assert report.row("main", "B").reason == "parameter of 'mlp' called at 'y'"
    assert report.row("main", "B").local_shape == (64, 128)
    text = str(report)
    assert text.startswith("function mlp\n")
    assert "function main" in text and "local shape" in text


# --------------------------------------------------------------------------- decoder layers
def _decoder_module():
    """main calls a private decoder layer (attention with heads, MLP, residuals) twice."""
    layer = td.load_module(DATA / "dropin" / "decoder_layer.py")["main"]
    layer = layer.without_attr("global_symbol")
    bb = relax.BlockBuilder()
    gv = bb.add_func(layer, "layer")
    ty = lambda *s: relax.TensorType(s, "float32")  # noqa: E731
    names = ["Wq", "Wk", "Wv", "Wo", "W1", "W2"]
    shapes = [(64, 64)] * 4 + [(64, 256), (256, 64)]
    x = relax.Var("x", ty(16, 64))
    weights = [[relax.Var(f"{n}_{i}", ty(*s)) for n, s in zip(names, shapes)] for i in range(2)]
    with bb.function("main", [x] + weights[0] + weights[1]):
        with bb.dataflow():
            h = bb.emit(relax.Call(gv, [x] + weights[0]))
            h = bb.emit(relax.Call(gv, [h] + weights[1]))
            out = bb.emit_output(h)
        bb.emit_func_output(out)
    mod = bb.get()
    mod.update_global_info("mesh", [relax.distributed.DeviceMesh((2,), tvm.ir.Range(0, 2))])
    return mod


def test_decoder_layers_with_heads_split_share_one_version():
    out = propagate(_decoder_module())
    assert sorted(gv.name_hint for gv in out.get_global_vars()) == ["layer", "main"]
    main = out["main"]
    placements = [str(p.ty.placement) for p in main.params]
    assert placements == ['"R"'] + ['"S[1]"', '"S[1]"', '"S[1]"', '"S[0]"', '"S[1]"', '"S[0]"'] * 2
    layer = {b.var.name: str(b.var.ty.placement)
             for b in out["layer"].body.blocks[0].bindings}
    # heads are split: the per-head tensors are sharded on the head axis
    assert layer["qh"] == layer["s"] == layer["p"] == layer["o"] == '"S[0]"'
    # the row-parallel projections reduce to replicated results, residuals stay replicated
    assert layer["attn"] == layer["h"] == layer["out"] == '"R"'
    assert not any("redistribute" in str(b.value) for b in out["layer"].body.blocks[0].bindings)


def test_decoder_layers_after_legalize_keep_the_head_split():
    out = propagate(relax.transform.LegalizeOps()(_decoder_module()))
    layer = out["layer"]
    types = {b.var.name: b.var.ty for b in layer.body.blocks[0].bindings}
    assert str(types["s"].placement) == '"S[0]"'
    assert str(types["f2"].placement) == '"S[1]"'
    assert str(types["out"].placement) == '"R"'


# --------------------------------------------------------------------------- call_tir callees
def test_call_tir_callee_after_legalize():
    mod = td.load_module(DATA / "seed_tensor_parallel.py")
    rules = [
        ShardingRule(param="A", result="S[1]", function="mlp"),
        ShardingRule(param="B", result="S[0]", function="mlp"),
    ]
    legal = relax.transform.LegalizeOps()(AnnotateSharding(rules)(mod))
    out = PropagateSharding(require_legalized=True)(legal)
    relax.analysis.well_formed(out)
    mlp = out["mlp"]
    calls = [b.value for b in mlp.body.blocks[-1].bindings]
    assert [c.op.name for c in calls] == ["relax.call_tir"] * 3
    assert [str(c.ty_args[0].placement) for c in calls] == ['"S[1]"', '"S[1]"', '"R"']
    assert [str(p.ty.placement) for p in out["main"].params] == ['"R"', '"S[1]"', '"S[0]"']


# --------------------------------------------------------------------------- callees and callers
@I.ir_module
class CalleeOverridesCaller:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function(private=True)
    def f(a: R.Tensor((8, 8), "float32")) -> R.Tensor((8, 8), "float32"):
        a1 = R.dist.annotate_sharding(a, device_mesh="mesh[0]", placement="R")
        y = R.nn.softmax(a1, axis=0)
        return y

    @R.function
    def main(a: R.Tensor((8, 8), "float32")) -> R.Tensor((8, 8), "float32"):
        cls = CalleeOverridesCaller
        a1 = R.dist.annotate_sharding(a, device_mesh="mesh[0]", placement="S[0]")
        y = cls.f(a1)
        return y


@I.ir_module
class CalleeOverridesCallerPropagated:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function(private=True)
    def f(
        a: R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]"),
    ) -> R.dist.DTensor((8, 8), "float32", "mesh[0]", "R"):
        a1 = R.dist.redistribute(a, device_mesh="mesh[0]", placement="R")
        y = R.nn.softmax(a1, axis=0)
        return y

    @R.function
    def main(
        a: R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]"),
    ) -> R.dist.DTensor((8, 8), "float32", "mesh[0]", "R"):
        cls = CalleeOverridesCallerPropagated
        y = cls.f(a)
        return y


def test_an_annotation_inside_the_callee_wins_over_the_callers_sharding():
    tvm.ir.assert_structural_equal(propagate(CalleeOverridesCaller), CalleeOverridesCallerPropagated)


@I.ir_module
class PublicCalledWithAnotherSharding:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def helper(a: R.Tensor((8, 8), "float32")) -> R.Tensor((8, 8), "float32"):
        a1 = R.dist.annotate_sharding(a, device_mesh="mesh[0]", placement="S[0]")
        y = R.nn.relu(a1)
        return y

    @R.function
    def main(a: R.Tensor((8, 8), "float32")) -> R.Tensor((8, 8), "float32"):
        cls = PublicCalledWithAnotherSharding
        a1 = R.dist.annotate_sharding(a, device_mesh="mesh[0]", placement="S[1]")
        y = cls.helper(a1)
        return y


def test_a_public_function_keeps_its_name_beside_a_version_for_another_signature():
    out = propagate(PublicCalledWithAnotherSharding)
    assert sorted(gv.name_hint for gv in out.get_global_vars()) == ["helper", "helper_1", "main"]
    assert str(out["helper"].params[0].ty.placement) == '"S[0]"'
    assert str(out["helper_1"].params[0].ty.placement) == '"S[1]"'
    call = out["main"].body.blocks[0].bindings[-1].value
    assert call.op.name_hint == "helper_1"
    assert "global_symbol" in out["helper"].attrs  # still public
    assert out["helper_1"].attrs is None or "global_symbol" not in out["helper_1"].attrs
