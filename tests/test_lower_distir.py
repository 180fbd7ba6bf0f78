"""LowerDistIR: rank-local programs, checked structurally and run on emulated ranks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax.distributed import transform as dist_transform

import tvm_distx as td
from tvm_distx import ShardingRule
from tvm_distx.legalize.lower_distir import CollectiveGroup, LowerDistIR
from tvm_distx.passes import AnnotateSharding, PropagateSharding
from tvm_distx.runtime import emulate, shard_array
from tvm_distx.spec import TensorSharding

DATA = Path(__file__).parent / "data"
TARGET = tvm.target.Target({"kind": "llvm"})


def lower(annotated: tvm.IRModule) -> tuple[tvm.IRModule, tvm.IRModule]:
    """The order the notes require: legalize, propagate, local view, lower."""
    legal = relax.transform.LegalizeOps()(annotated)
    propagated = PropagateSharding(require_legalized=True)(legal)
    local = dist_transform.LowerGlobalViewToLocalView()(propagated)
    return propagated, LowerDistIR()(local)


def run(propagated, lowered, arrays, devices):
    params = propagated["main"].params
    inputs = [[shard_array(a, TensorSharding.from_type(p.ty), d) for a, p in zip(arrays, params)]
              for d in devices]
    return emulate(tvm.compile(lowered, target=TARGET), inputs, devices)


def mlp_twice(x, A, B):
    def mlp(v):
        return np.maximum(v @ A, 0) @ B

    return mlp(mlp(x))


@pytest.fixture(scope="module")
def weights():
    rng = np.random.default_rng(7)
    return [(rng.standard_normal((128, 128)) * 0.1).astype("float32") for _ in range(3)]


def test_tensor_parallel_mlp_in_a_private_function_on_two_ranks(weights):
    mod = td.load_module(DATA / "seed_tensor_parallel.py")
    rules = [ShardingRule(param="A", result="S[1]", function="mlp"),
             ShardingRule(param="B", result="S[0]", function="mlp")]
    propagated, lowered = lower(AnnotateSharding(rules)(mod))
    # each rank holds its column block of A and row block of B
    assert [tuple(int(d) for d in p.ty.shape.values) for p in lowered["main"].params] == [
        (128, 128), (128, 64), (64, 128)]
    calls = [b.value for b in lowered["mlp"].body.blocks[0].bindings]
    reduce = calls[-1]
    assert reduce.args[0].global_symbol == "tvm_distx.ccl.allreduce"
    group = CollectiveGroup.decode(reduce.args[1].fields[2].values)
    assert group == CollectiveGroup((2,), 0, (0,))
    outs = run(propagated, lowered, weights, devices=[0, 1])
    want = mlp_twice(*weights)
    for out in outs:
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_2x2_mesh_reduces_over_the_model_axis_only(weights):
    """TVM's lowering all-reduces over all four workers here, and gets wrong numbers."""
    mod = td.load_module(DATA / "seed_mesh2x2.py")
    rule = ShardingRule(callee="mlp", args={0: "S[0]R", 1: "RS[1]", 2: "RS[0]"})
    propagated, lowered = lower(AnnotateSharding([rule])(mod))
    reduce = [b.value for b in lowered["mlp"].body.blocks[0].bindings][-1]
    group = CollectiveGroup.decode(reduce.args[1].fields[2].values)
    assert group.axes == (1,)
    assert group.members(0) == (0, 1) and group.members(2) == (2, 3)
    outs = run(propagated, lowered, weights, devices=[0, 1, 2, 3])
    want = mlp_twice(*weights)
    # rows are split over mesh axis 0: devices (0, 1) hold rows 0..63, (2, 3) rows 64..127
    for device, out in enumerate(outs):
        rows = slice(0, 64) if device < 2 else slice(64, 128)
        np.testing.assert_allclose(out, want[rows], rtol=1e-5, atol=1e-5)


def test_collective_group_members():
    group = CollectiveGroup((2, 4), 4, (1,))
    assert group.members(4) == (4, 5, 6, 7)
    assert group.members(9) == (8, 9, 10, 11)
    column = CollectiveGroup((2, 4), 4, (0,))
    assert column.members(6) == (6, 10)
    assert CollectiveGroup.decode(column.encode()) == column


def test_several_meshes_are_refused_for_now():
    mod = td.load_module(DATA / "seed_pipeline.py")
    rule = ShardingRule(callee="mlp", args={0: "R"}, meshes=["mesh[0]", "mesh[1]"])
    propagated = PropagateSharding()(AnnotateSharding([rule])(mod))
    with pytest.raises(td.UnsupportedProgramError, match="2 meshes"):
        LowerDistIR()(propagated)


def test_unlegalized_redistribute_is_refused_with_the_function_named():
    mod = td.load_module(DATA / "seed_tensor_parallel.py")
    rules = [ShardingRule(param="A", result="S[1]", function="mlp"),
             ShardingRule(param="B", result="S[0]", function="mlp"),
             ShardingRule(callee="mlp", result="S[0]", function="main")]
    legal = relax.transform.LegalizeOps()(AnnotateSharding(rules)(mod))
    propagated = PropagateSharding(require_legalized=True)(legal)
    local = dist_transform.LowerGlobalViewToLocalView()(propagated)
    with pytest.raises(td.UnsupportedProgramError, match="redistribute") as info:
        LowerDistIR()(local)
    # callees are lowered first: the version of mlp that takes a row-split x
    assert info.value.function == "mlp_1"
