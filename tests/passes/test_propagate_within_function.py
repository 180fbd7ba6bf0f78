"""PropagateSharding inside one function: the operators, conflicts and values it decides, and what it refuses.

Where TVM has no rule (``silu``) no redistribute is added; annotations win over
other operands; nested splits, ``match_cast``, reshapes the split does not
divide and one value used as two operands keep the program correct. Unlegalized
operators (when asked), control flow, constants that would need sharding and
annotations that do not fit their mesh are refused with a named error.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

import tvm_distx as td
from propagation_tools import propagate
from tvm_distx.passes import PropagateSharding
from tvm_distx.errors import UnsupportedProgramError
from tvm_distx.layout import TensorSharding, replicated


# --------------------------------------------------------------------------- a superset of TVM
@I.ir_module
class SiluAfterSplit:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.Tensor((16, 32), "float32"), W: R.Tensor((32, 64), "float32")) -> R.Tensor((16, 64), "float32"):
        with R.dataflow():
            W1 = R.dist.annotate_sharding(W, device_mesh="mesh[0]", placement="S[1]")
            lv0 = R.matmul(x, W1)
            lv1 = R.nn.silu(lv0)
            R.output(lv1)
        return lv1


def test_no_spurious_redistribute_where_tvm_lacks_a_rule():
    theirs = relax.distributed.transform.PropagateSharding()(SiluAfterSplit)
    ours = propagate(SiluAfterSplit)
    assert "redistribute" in theirs.script()  # TVM all-gathers after silu
    assert "redistribute" not in ours.script()
    assert str(ours["main"].ty.ret.placement) == '"S[1]"'


# --------------------------------------------------------------------------- more errors
def test_require_legalized_refuses_high_level_ops_and_names_the_function():
    with pytest.raises(UnsupportedProgramError, match="LegalizeOps") as info:
        PropagateSharding(require_legalized=True)(SiluAfterSplit)
    assert (info.value.function, info.value.var) == ("main", "lv0")


def test_high_level_ops_are_flagged_in_the_log(caplog):
    with caplog.at_level("WARNING", logger="tvm_distx.passes.propagate_sharding"):
        propagate(SiluAfterSplit)
    assert "relax.nn.silu at 'lv1' in 'main'" in caplog.text


@I.ir_module
class LayerNormUnlegalized:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.Tensor((8, 32), "float32"), g: R.Tensor((32,), "float32"),
             b: R.Tensor((32,), "float32")) -> R.Tensor((8, 32), "float32"):
        x1 = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="S[0]")
        y = R.nn.layer_norm(x1, g, b, axes=[-1])
        return y


def test_operator_tvm_cannot_type_asks_for_legalize():
    with pytest.raises(UnsupportedProgramError, match="relax.nn.layer_norm") as info:
        PropagateSharding()(LayerNormUnlegalized)
    assert (info.value.function, info.value.var) == ("main", "y")
    assert "LegalizeOps" in info.value.hint


@I.ir_module
class WithBranch:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.Tensor((8, 8), "float32"), c: R.Tensor((), "bool")) -> R.Tensor((8, 8), "float32"):
        x1 = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="S[0]")
        if c:
            y = R.nn.relu(x1)
        else:
            y = R.negative(x1)
        return y


def test_control_flow_is_reported_not_crashed():
    with pytest.raises(UnsupportedProgramError, match="If") as info:
        PropagateSharding()(WithBranch)
    assert info.value.function == "main"


# --------------------------------------------------------------------------- nested splits
@I.ir_module
class DoubleSplit:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2, 2), I.Range(0, 4))]})

    @R.function
    def main(x: R.Tensor((8, 4), "float32")) -> R.Tensor((8, 4), "float32"):
        x1 = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="S[0]S[0]")
        y = R.nn.relu(x1)
        return y


def test_a_dimension_split_by_two_mesh_axes_is_kept():
    """TVM turns "S[0]S[0]" into "RS[0]" silently; we keep what was asked."""
    out = propagate(DoubleSplit)
    assert str(out["main"].params[0].ty.placement) == '"S[0], S[0]"'
    assert str(out["main"].ty.ret.placement) == '"S[0], S[0]"'


# --------------------------------------------------------------------------- conflicts resolved
@I.ir_module
class TwoAnnotatedOperands:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(a: R.Tensor((8, 8), "float32"), b: R.Tensor((8, 8), "float32")) -> R.Tensor((8, 8), "float32"):
        a1 = R.dist.annotate_sharding(a, device_mesh="mesh[0]", placement="S[0]")
        b1 = R.dist.annotate_sharding(b, device_mesh="mesh[0]", placement="S[1]")
        y = R.add(a1, b1)
        return y


@I.ir_module
class TwoAnnotatedOperandsPropagated:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(
        a: R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]"),
        b: R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[1]"),
    ) -> R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]"):
        b_redist = R.dist.redistribute(b, device_mesh="mesh[0]", placement="S[0]")
        y = R.add(a, b_redist)
        return y


def test_annotations_win_and_the_other_operand_is_redistributed():
    tvm.ir.assert_structural_equal(propagate(TwoAnnotatedOperands), TwoAnnotatedOperandsPropagated)


# --------------------------------------------------------------------------- match_cast
@I.ir_module
class WithMatchCast:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.Tensor(("n", 64), "float32"), W: R.Tensor((64, 32), "float32")) -> R.Tensor(("n", 32), "float32"):
        n = T.int64()
        W1 = R.dist.annotate_sharding(W, device_mesh="mesh[0]", placement="S[1]")
        y = R.matmul(x, W1)
        z = R.match_cast(y, R.Tensor((n, 32), "float32"))
        w = R.nn.relu(z)
        return w


def test_match_cast_keeps_the_cast_and_the_sharding():
    out = propagate(WithMatchCast)
    bindings = out["main"].body.blocks[0].bindings
    cast = [b for b in bindings if isinstance(b, relax.MatchCast)]
    assert len(cast) == 1 and str(cast[0].ty.placement) == '"S[1]"'
    assert str(out["main"].ty.ret.placement) == '"S[1]"'


def test_a_constant_that_a_use_splits_is_replicated_and_sliced_locally():
    # an HF attention mask, folded to a constant with a heads dimension, meets the
    # split heads: every rank holds the constant and reads its block (no collective)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((8, 8), "float32"))
    mesh = relax.distributed.DeviceMesh((2,), tvm.ir.Range(0, 2))
    bias = np.arange(64, dtype="float32").reshape(8, 8)
    with bb.function("main", [x]):
        x1 = bb.emit(relax.op.distributed.annotate_sharding(
            x, mesh, relax.distributed.Placement.from_text("S[1]")))
        y = bb.emit(relax.op.add(x1, relax.const(bias)), name_hint="y")
        bb.emit_func_output(y)
    mod = bb.get()
    mod.update_global_info("mesh", [mesh])
    out = PropagateSharding()(relax.transform.LegalizeOps()(mod))
    moves = [b for b in out["main"].body.blocks[0].bindings
             if isinstance(b.value, relax.Call) and b.value.op.name == "relax.dist.redistribute"]
    assert [(b.var.name, str(b.value.args[0].ty.placement), str(b.var.ty.placement))
            for b in moves] == [("y_const_redist", '"R"', '"S[1]"')]
    from tvm_distx.compiler.pipeline import run_stages

    rows = td.comm_report(run_stages(relax.transform.LegalizeOps()(mod))["local_view"]).rows
    assert [(r.collective, r.bytes_per_rank) for r in rows] == [("local_slice", 0)]
    data = np.random.default_rng(0).standard_normal((8, 8)).astype("float32")
    np.testing.assert_allclose(td.compile(mod).run(data, backend="emulate"), data + bias)


def test_an_annotation_written_in_the_ir_is_validated_against_its_mesh():
    """TVM accepts "S[2]" on a 2-D mesh; propagation names the mistake."""
    from tvm.relax.distributed import DeviceMesh, Placement

    mesh = DeviceMesh([2, 2], tvm.ir.Range(0, 4))
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((8, 12, 4), "float32"))
    with bb.function("main", [x]):
        y = bb.emit(relax.op.distributed.annotate_sharding(x, mesh, Placement.from_text("S[2]")),
                    name_hint="y")
        bb.emit_func_output(bb.emit(relax.op.nn.relu(y)))
    mod = bb.get()
    mod.update_global_info("mesh", [mesh])
    with pytest.raises(td.errors.PlacementRankError, match="placement has 1 entries") as info:
        PropagateSharding()(mod)
    assert (info.value.function, info.value.var) == ("main", "y")


def test_a_reshape_whose_result_the_split_does_not_divide_runs_replicated():
    # Found by the randomized tests. (4, 12) split 4 ways on dim 1 reshaped to
    # (4, 3, 4): the 12 maps to the 3, which 4 devices cannot split. The kernel must
    # take a replicated operand (an all-gather first); it was given the shard and
    # TVM's local-view pass stopped with an InternalError.
    mesh = relax.distributed.DeviceMesh([4], tvm.ir.Range(0, 4))
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 12), "float32"))
    with bb.function("main", [x]):
        x1 = bb.emit(relax.op.distributed.annotate_sharding(
            x, mesh, relax.distributed.Placement.from_text("S[1]")))
        bb.emit_func_output(bb.emit(relax.op.reshape(x1, (4, 3, 4))))
    mod = bb.get()
    mod.update_global_info("mesh", [mesh])
    out = propagate(relax.transform.LegalizeOps()(mod))
    kernel = next(b for block in out["main"].body.blocks for b in block.bindings
                  if isinstance(b.value, relax.Call) and "call_tir" in b.value.op.name)
    assert str(kernel.value.args[1].fields[0].ty.placement).strip('"') == "R"
    assert str(kernel.var.ty.placement).strip('"') == "R"
    value = np.arange(48, dtype="float32").reshape(4, 12)
    got = td.compile(mod, schedule=False).run(value, backend="emulate")
    np.testing.assert_array_equal(got, value.reshape(4, 3, 4))


@pytest.mark.parametrize("placement", ["S[1]", "S[0]"])
def test_one_value_as_two_operands_needing_different_shardings(placement):
    # Found by the randomized tests: x @ x with x split on one dimension. The left
    # operand and the right one need different splits of the same value; both
    # uses were replaced by one redistributed copy and lowering produced a
    # malformed module.
    mesh = relax.distributed.DeviceMesh([2], tvm.ir.Range(0, 2))
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((6, 6), "float32"))
    with bb.function("main", [x]):
        x1 = bb.emit(relax.op.distributed.annotate_sharding(
            x, mesh, relax.distributed.Placement.from_text(placement)))
        bb.emit_func_output(bb.emit(relax.op.matmul(x1, x1)))
    mod = bb.get()
    mod.update_global_info("mesh", [mesh])
    out = propagate(relax.transform.LegalizeOps()(mod))
    kernel = next(b for block in out["main"].body.blocks for b in block.bindings
                  if isinstance(b.value, relax.Call) and "call_tir" in b.value.op.name)
    lhs, rhs = (str(f.ty.placement).strip('"') for f in kernel.value.args[1].fields)
    assert lhs != rhs  # the contraction is split alike on both sides
    value = np.random.default_rng(4).standard_normal((6, 6), "float32")
    got = td.compile(mod, schedule=False).run(value, backend="emulate")
    np.testing.assert_allclose(got, value @ value, rtol=1e-5, atol=1e-5)


def test_a_variable_bound_to_a_constant_becomes_a_replicated_dtensor():
    # LegalizeOps folds arange (position ids) into a constant bound to a variable;
    # its users are DTensor computations, so it must be a DTensor on their mesh too
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 8), "float32"))
    mesh = relax.distributed.DeviceMesh((2,), tvm.ir.Range(0, 2))
    with bb.function("main", [x]):
        x1 = bb.emit(relax.op.distributed.annotate_sharding(
            x, mesh, relax.distributed.Placement.from_text("S[0]")))
        pos = bb.emit(relax.op.arange(0, 8, 1, "float32"), name_hint="pos")
        y = bb.emit(relax.op.add(x1, pos), name_hint="y")
        bb.emit_func_output(y)
    mod = bb.get()
    mod.update_global_info("mesh", [mesh])
    legal = relax.transform.LegalizeOps()(mod)
    bound = [b for b in legal["main"].body.blocks[0].bindings if b.var.name == "pos"]
    assert len(bound) == 1 and isinstance(bound[0].value, tvm.ir.Constant)
    out = PropagateSharding()(legal)
    pos_ty = [b.var.ty for b in out["main"].body.blocks[0].bindings if b.var.name == "pos"]
    assert len(pos_ty) == 1
    have = TensorSharding.from_type(pos_ty[0])
    assert have is not None, f"pos stayed a plain tensor: {pos_ty[0]}"
    assert have == replicated(TensorSharding.from_type(out["main"].ty.ret).mesh)
    data = np.random.default_rng(0).standard_normal((4, 8)).astype("float32")
    np.testing.assert_allclose(td.compile(mod).run(data, backend="emulate"),
                               data + np.arange(8, dtype="float32"))
