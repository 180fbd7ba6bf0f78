"""AnnotateSharding: Before/Expected modules compared structurally."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import tvm
from tvm import relax
from tvm.relax.distributed.transform import PropagateSharding
from tvm.script import ir as I
from tvm.script import relax as R

import tvm_distx as td
from tvm_distx import ShardingRule
from tvm_distx.passes import AnnotateSharding
from locations import TESTS_DIR

DATA = TESTS_DIR / "data"


def annotate(mod, *rules, **kwargs):
    out = AnnotateSharding(list(rules), **kwargs)(mod)
    relax.analysis.well_formed(out)  # raises on an ill-formed module
    return out


@pytest.fixture(scope="module")
def seed():
    return td.load_module(DATA / "seed_pipeline.py")


# --------------------------------------------------------------------------- callee matcher
@I.ir_module
class SeedPipelineAnnotated:
    I.module_attrs({"device_num": 2})
    I.module_global_infos(
        {"mesh": [R.dist.device_mesh((1,), I.Range(0, 1)), R.dist.device_mesh((1,), I.Range(1, 2))]}
    )

    @R.function(private=True)
    def mlp(
        x: R.Tensor((128, 128), "float32"),
        A: R.Tensor((128, 128), "float32"),
        B: R.Tensor((128, 128), "float32"),
    ) -> R.Tensor((128, 128), "float32"):
        with R.dataflow():
            lv0 = R.matmul(x, A)
            lv1 = R.nn.relu(lv0)
            lv2 = R.matmul(lv1, B)
            R.output(lv2)
        return lv2

    @R.function
    def main(
        x: R.Tensor((128, 128), "float32"),
        A: R.Tensor((128, 128), "float32"),
        B: R.Tensor((128, 128), "float32"),
    ) -> R.Tensor((128, 128), "float32"):
        cls = SeedPipelineAnnotated
        with R.dataflow():
            x_ann = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="R")
            y = cls.mlp(x_ann, A, B)
            y_ann = R.dist.annotate_sharding(y, device_mesh="mesh[1]", placement="R")
            z = cls.mlp(y_ann, A, B)
            R.output(z)
        return z


def test_seed_pipeline_cycles_meshes_over_calls(seed):
    rule = ShardingRule(callee="mlp", args={0: "R"}, meshes=["mesh[0]", "mesh[1]"])
    tvm.ir.assert_structural_equal(annotate(seed, rule), SeedPipelineAnnotated)


def test_pass_is_idempotent(seed):
    rule = ShardingRule(callee="mlp", args={0: "R"}, meshes=["mesh[0]", "mesh[1]"])
    once = annotate(seed, rule)
    tvm.ir.assert_structural_equal(annotate(once, rule), once)


def test_input_module_is_not_modified(seed):
    before = seed.script()
    annotate(seed, ShardingRule(callee="mlp", args={0: "R"}, meshes=["mesh[0]", "mesh[1]"]))
    assert seed.script() == before


def test_call_types_stay_valid(seed):
    out = annotate(seed, ShardingRule(callee="mlp", args={0: "R"}, meshes="mesh[1]"))
    for binding in out["main"].body.blocks[0].bindings:
        assert isinstance(binding.var.ty, relax.TensorType)
        tvm.ir.assert_structural_equal(binding.var.ty, relax.TensorType((128, 128), "float32"))


# --------------------------------------------------------------------------- 2x2 mesh
@I.ir_module
class Mesh2x2Annotated:
    I.module_attrs({"device_num": 4})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2, 2), I.Range(0, 4))]})

    @R.function(private=True)
    def mlp(
        x: R.Tensor((128, 128), "float32"),
        A: R.Tensor((128, 128), "float32"),
        B: R.Tensor((128, 128), "float32"),
    ) -> R.Tensor((128, 128), "float32"):
        with R.dataflow():
            lv0 = R.matmul(x, A)
            lv1 = R.nn.relu(lv0)
            lv2 = R.matmul(lv1, B)
            R.output(lv2)
        return lv2

    @R.function
    def main(
        x: R.Tensor((128, 128), "float32"),
        A: R.Tensor((128, 128), "float32"),
        B: R.Tensor((128, 128), "float32"),
    ) -> R.Tensor((128, 128), "float32"):
        cls = Mesh2x2Annotated
        with R.dataflow():
            x_ann = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="S[0]R")
            A_ann = R.dist.annotate_sharding(A, device_mesh="mesh[0]", placement="RS[1]")
            y = cls.mlp(x_ann, A_ann, B)
            y_ann = R.dist.annotate_sharding(y, device_mesh="mesh[0]", placement="S[0]R")
            z = cls.mlp(y_ann, A_ann, B)
            R.output(z)
        return z


def test_2x2_mesh_uses_the_only_mesh_by_default():
    mod = td.load_module(DATA / "seed_mesh2x2.py")
    rule = ShardingRule(callee="mlp", args={0: "S[0]R", 1: "RS[1]"})
    tvm.ir.assert_structural_equal(annotate(mod, rule), Mesh2x2Annotated)


# --------------------------------------------------------------------------- param matcher
@I.ir_module
class TensorParallelAnnotated:
    I.module_attrs({"device_num": 2})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function(private=True)
    def mlp(
        x: R.Tensor((128, 128), "float32"),
        A: R.Tensor((128, 128), "float32"),
        B: R.Tensor((128, 128), "float32"),
    ) -> R.Tensor((128, 128), "float32"):
        A_ann = R.dist.annotate_sharding(A, device_mesh="mesh[0]", placement="S[1]")
        B_ann = R.dist.annotate_sharding(B, device_mesh="mesh[0]", placement="S[0]")
        with R.dataflow():
            lv0 = R.matmul(x, A_ann)
            lv1 = R.nn.relu(lv0)
            lv2 = R.matmul(lv1, B_ann)
            R.output(lv2)
        return lv2

    @R.function
    def main(
        x: R.Tensor((128, 128), "float32"),
        A: R.Tensor((128, 128), "float32"),
        B: R.Tensor((128, 128), "float32"),
    ) -> R.Tensor((128, 128), "float32"):
        cls = TensorParallelAnnotated
        with R.dataflow():
            y = cls.mlp(x, A, B)
            z = cls.mlp(y, A, B)
            R.output(z)
        return z


TP_RULES = (
    ShardingRule(param="A", result="S[1]", function="mlp"),
    ShardingRule(param="B", result="S[0]", function="mlp"),
)


def test_tensor_parallel_params_annotated_at_function_start():
    mod = td.load_module(DATA / "seed_tensor_parallel.py")
    out = annotate(mod, *TP_RULES)
    tvm.ir.assert_structural_equal(out, TensorParallelAnnotated)
    tvm.ir.assert_structural_equal(annotate(out, *TP_RULES), out)


def test_param_rule_without_function_cycles_in_program_order(seed):
    # public functions come first: main's x gets mesh[0], mlp's x gets mesh[1]
    out = annotate(seed, ShardingRule(param="x", result="R", meshes=["mesh[0]", "mesh[1]"]))
    first = {}
    for name in ("main", "mlp"):
        value = out[name].body.blocks[0].bindings[0].value
        assert value.op.name == "relax.dist.annotate_sharding"
        first[name] = tuple(int(i) for i in value.attrs.device_mesh.device_ids)
    assert first == {"main": (0,), "mlp": (1,)}


# --------------------------------------------------------------------------- op matcher, results
@I.ir_module
class SingleMLP:
    I.module_attrs({"device_num": 2})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(
        x: R.Tensor((128, 128), "float32"),
        A: R.Tensor((128, 128), "float32"),
        B: R.Tensor((128, 128), "float32"),
    ) -> R.Tensor((128, 128), "float32"):
        with R.dataflow():
            lv0 = R.matmul(x, A)
            lv1 = R.nn.relu(lv0)
            lv2 = R.matmul(lv1, B)
            R.output(lv2)
        return lv2


@I.ir_module
class SingleMLPOpAnnotated:
    I.module_attrs({"device_num": 2})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(
        x: R.Tensor((128, 128), "float32"),
        A: R.Tensor((128, 128), "float32"),
        B: R.Tensor((128, 128), "float32"),
    ) -> R.Tensor((128, 128), "float32"):
        with R.dataflow():
            A_ann = R.dist.annotate_sharding(A, device_mesh="mesh[0]", placement="S[1]")
            lv0_raw = R.matmul(x, A_ann)
            lv0 = R.dist.annotate_sharding(lv0_raw, device_mesh="mesh[0]", placement="S[1]")
            lv1 = R.nn.relu(lv0)
            B_ann = R.dist.annotate_sharding(B, device_mesh="mesh[0]", placement="S[1]")
            lv2_raw = R.matmul(lv1, B_ann)
            lv2 = R.dist.annotate_sharding(lv2_raw, device_mesh="mesh[0]", placement="S[1]")
            R.output(lv2)
        return lv2


def test_op_matcher_annotates_args_and_results_including_dataflow_outputs():
    rule = ShardingRule(op="relax.matmul", args={1: "S[1]"}, result="S[1]")
    out = annotate(SingleMLP, rule)
    tvm.ir.assert_structural_equal(out, SingleMLPOpAnnotated)
    tvm.ir.assert_structural_equal(annotate(out, rule), out)


@I.ir_module
class NoDataflow:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.Tensor((4, 8), "float32")) -> R.Tensor((4, 8), "float32"):
        y = R.nn.relu(x)
        z = R.add(y, x)
        return z


@I.ir_module
class NoDataflowAnnotated:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.Tensor((4, 8), "float32")) -> R.Tensor((4, 8), "float32"):
        x_ann = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="S[0]")
        y = R.nn.relu(x_ann)
        z_raw = R.add(y, x)
        z = R.dist.annotate_sharding(z_raw, device_mesh="mesh[0]", placement="S[1]")
        return z


def test_works_outside_dataflow_blocks():
    out = annotate(
        NoDataflow,
        ShardingRule(op="relax.nn.relu", args={0: "S[0]"}),
        ShardingRule(op="relax.add", result="S[1]"),
    )
    tvm.ir.assert_structural_equal(out, NoDataflowAnnotated)


@I.ir_module
class SharedArgument:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.Tensor((4, 8), "float32")) -> R.Tensor((4, 8), "float32"):
        with R.dataflow():
            y = R.add(x, x)
            z = R.multiply(y, x)
            R.output(z)
        return z


@I.ir_module
class SharedArgumentAnnotated:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.Tensor((4, 8), "float32")) -> R.Tensor((4, 8), "float32"):
        with R.dataflow():
            x_ann = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="S[0]")
            y = R.add(x_ann, x_ann)
            z = R.multiply(y, x_ann)
            R.output(z)
        return z


def test_a_value_is_annotated_once_per_sharding():
    out = annotate(
        SharedArgument,
        ShardingRule(op="relax.add", args={0: "S[0]", 1: "S[0]"}),
        ShardingRule(op="relax.multiply", args={1: "S[0]"}),
    )
    tvm.ir.assert_structural_equal(out, SharedArgumentAnnotated)


def test_two_rules_agreeing_on_a_site_are_not_a_conflict(seed):
    a = ShardingRule(callee="mlp", args={0: "R"}, meshes=["mesh[0]", "mesh[1]"])
    b = ShardingRule(callee="mlp", args={0: "R"}, meshes=["mesh[0]", "mesh[1]"], function="main")
    tvm.ir.assert_structural_equal(annotate(seed, a, b), SeedPipelineAnnotated)


# --------------------------------------------------------------------------- TVM as oracle
@I.ir_module
class SingleMLPHandAnnotated:
    I.module_attrs({"device_num": 2})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(
        x: R.Tensor((128, 128), "float32"),
        A: R.Tensor((128, 128), "float32"),
        B: R.Tensor((128, 128), "float32"),
    ) -> R.Tensor((128, 128), "float32"):
        with R.dataflow():
            A1 = R.dist.annotate_sharding(A, device_mesh="mesh[0]", placement="S[1]")
            B1 = R.dist.annotate_sharding(B, device_mesh="mesh[0]", placement="S[0]")
            lv0 = R.matmul(x, A1)
            lv1 = R.nn.relu(lv0)
            lv2 = R.matmul(lv1, B1)
            R.output(lv2)
        return lv2


def test_tvm_propagation_agrees_with_hand_written_annotations():
    ours = annotate(
        SingleMLP,
        ShardingRule(param="A", result="S[1]"),
        ShardingRule(param="B", result="S[0]"),
    )
    tvm.ir.assert_structural_equal(
        PropagateSharding()(ours), PropagateSharding()(SingleMLPHandAnnotated)
    )


# --------------------------------------------------------------------------- conflicts
def test_conflicting_rules_raise_and_name_the_site(seed):
    with pytest.raises(td.errors.ShardingConflictError) as info:
        annotate(
            seed,
            ShardingRule(callee="mlp", args={0: "R"}, meshes="mesh[0]"),
            ShardingRule(op="relax.matmul", args={1: "R"}, meshes="mesh[0]"),
            ShardingRule(callee="mlp", args={0: "R"}, meshes="mesh[1]", function="main"),
        )
    text = str(info.value)
    assert info.value.function == "main" and info.value.var == "x"
    assert "function 'main'" in text and "variable 'x'" in text and "hint:" in text


def test_existing_annotation_with_another_sharding_is_a_conflict(seed):
    once = annotate(seed, ShardingRule(callee="mlp", args={0: "R"}, meshes="mesh[0]"))
    with pytest.raises(td.errors.ShardingConflictError, match="already annotated") as info:
        annotate(once, ShardingRule(callee="mlp", args={0: "R"}, meshes="mesh[1]"))
    assert info.value.var == "x_ann"


def test_existing_result_annotation_with_another_sharding_is_a_conflict():
    once = annotate(SingleMLP, ShardingRule(op="relax.nn.relu", result="S[0]"))
    with pytest.raises(td.errors.ShardingConflictError) as info:
        annotate(once, ShardingRule(op="relax.nn.relu", result="S[1]"))
    assert (info.value.function, info.value.var) == ("main", "lv1_raw")


@I.ir_module
class AlreadyDistributed:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(
        x: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[0]"),
    ) -> R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[0]"):
        y = R.nn.relu(x)
        return y


def test_dtensor_value_with_the_same_sharding_is_left_alone():
    out = annotate(AlreadyDistributed, ShardingRule(param="x", result="S[0]"))
    tvm.ir.assert_structural_equal(out, AlreadyDistributed)


def test_dtensor_value_with_another_sharding_asks_for_redistribute():
    with pytest.raises(td.errors.ShardingConflictError, match="redistribute") as info:
        annotate(AlreadyDistributed, ShardingRule(param="x", result="S[1]"))
    assert (info.value.function, info.value.var) == ("main", "x")


# --------------------------------------------------------------------------- bad input
def test_unknown_mesh_names_function_and_variable(seed):
    with pytest.raises(td.errors.UnknownMeshError) as info:
        annotate(seed, ShardingRule(callee="mlp", args={0: "R"}, meshes="mesh[7]"))
    assert (info.value.function, info.value.var) == ("main", "x")
    assert "mesh[0], mesh[1]" in str(info.value)


def test_missing_mesh_with_several_meshes_in_module(seed):
    with pytest.raises(td.errors.UnknownMeshError, match="names no mesh") as info:
        annotate(seed, ShardingRule(callee="mlp", args={0: "R"}))
    assert info.value.function == "main"


def test_placement_rank_mismatch_names_the_variable(seed):
    with pytest.raises(td.errors.PlacementRankError) as info:
        annotate(seed, ShardingRule(param="B", result="S[0]R", function="mlp", meshes="mesh[0]"))
    assert (info.value.function, info.value.var, info.value.placement) == ("mlp", "B", "S[0]R")


def test_sharded_dimension_out_of_range():
    with pytest.raises(td.errors.ShardDimError) as info:
        annotate(SingleMLP, ShardingRule(op="relax.nn.relu", args={0: "S[2]"}))
    assert (info.value.function, info.value.var) == ("main", "lv0")


@I.ir_module
class OddShape:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.Tensor((5, 8), "float32")) -> R.Tensor((5, 8), "float32"):
        y = R.nn.relu(x)
        return y


def test_indivisible_shape():
    with pytest.raises(td.errors.IndivisibleShardError, match="extent 5") as info:
        annotate(OddShape, ShardingRule(param="x", result="S[0]"))
    assert info.value.var == "x"
    # the other dimension divides
    annotate(OddShape, ShardingRule(param="x", result="S[1]"))


@I.ir_module
class WithShapeArgument:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.Tensor((4, 8), "float32")) -> R.Tensor((8, 4), "float32"):
        y = R.reshape(x, R.shape([8, 4]))
        return y


def test_non_tensor_argument_is_rejected():
    with pytest.raises(td.errors.UnsupportedValueError, match="only tensors") as info:
        annotate(WithShapeArgument, ShardingRule(op="relax.reshape", args={1: "R"}))
    assert info.value.function == "main"


def test_argument_index_out_of_range(seed):
    with pytest.raises(td.errors.ShardingError, match="has 3 arguments") as info:
        annotate(seed, ShardingRule(callee="mlp", args={3: "R"}, meshes="mesh[0]"))
    assert info.value.function == "main"


def test_unmatched_rule_is_an_error_in_strict_mode(seed):
    with pytest.raises(td.errors.UnmatchedRuleError, match="matched nothing") as info:
        annotate(seed, ShardingRule(callee="mlpp", args={0: "R"}, meshes="mesh[0]"))
    assert "main, mlp" in info.value.hint


def test_unmatched_rule_is_logged_when_not_strict(seed, caplog):
    with caplog.at_level(logging.WARNING, logger="tvm_distx.passes.annotate_sharding"):
        out = annotate(seed, ShardingRule(param="W", result="R", meshes="mesh[0]"), strict=False)
    tvm.ir.assert_structural_equal(out, seed)
    assert "matched nothing" in caplog.text


def test_rules_must_be_sharding_rules():
    with pytest.raises(TypeError, match="ShardingRule"):
        AnnotateSharding([{"callee": "mlp"}])


def test_error_type_and_fields_survive_a_sequential(seed):
    rule = ShardingRule(callee="mlp", args={0: "R"}, meshes="mesh[9]")
    with pytest.raises(td.errors.UnknownMeshError) as info:
        tvm.transform.Sequential([AnnotateSharding([rule])])(seed)
    assert "function 'main'" in str(info.value) and "mesh[9]" in str(info.value)


def test_conflict_message_names_the_existing_mesh(seed):
    once = annotate(seed, ShardingRule(callee="mlp", args={0: "R"}, meshes="mesh[0]"))
    with pytest.raises(td.errors.ShardingConflictError, match=r'already annotated "R" on mesh "mesh\[0\]"'):
        annotate(once, ShardingRule(callee="mlp", args={0: "R"}, meshes="mesh[1]"))
