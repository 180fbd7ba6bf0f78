"""A two-stage pipeline MLP: our plan is at least as good as TVM's, and runs right.

Each stage lives on its own 2-device mesh; annotations split the hidden
activations of both stages, and the hand-over between the stages is replicated.
Nothing annotates the weights: propagation must find that each stage's first
weight is split on its output features and its second on its input features.
TVM's ``PropagateSharding`` is the oracle for the plan; ours must move no more
bytes and keep no more weight bytes on any device, and the numbers on 4 MPI
ranks (two meshes of two) must equal numpy's.
"""

from __future__ import annotations

import numpy as np
import pytest
from tvm import relax
from tvm.relax.distributed.transform import PropagateSharding as TVMPropagateSharding
from tvm.script import ir as I
from tvm.script import relax as R

import tvm_distx as td
from tvm_distx.layout import TensorSharding
from tvm_distx.legalize import LowerGlobalViewToLocalView
from tvm_distx.compiler.pipeline import legalize_ops, run_stages


@I.ir_module
class TwoStages:
    I.module_attrs({"device_num": 4})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2)),
                                    R.dist.device_mesh((2,), I.Range(2, 4))]})

    @R.function
    def main(x: R.Tensor((16, 32), "float32"), up1: R.Tensor((32, 64), "float32"),
             down1: R.Tensor((64, 32), "float32"), up2: R.Tensor((32, 48), "float32"),
             down2: R.Tensor((48, 32), "float32")) -> R.Tensor((16, 32), "float32"):
        h = R.matmul(x, up1)
        a = R.nn.relu(h)
        a_split = R.dist.annotate_sharding(a, device_mesh="mesh[0]", placement="S[1]")
        y = R.matmul(a_split, down1)
        y_next = R.dist.annotate_sharding(y, device_mesh="mesh[1]", placement="R")
        h2 = R.matmul(y_next, up2)
        a2 = R.nn.silu(h2)
        a2_split = R.dist.annotate_sharding(a2, device_mesh="mesh[1]", placement="S[1]")
        out = R.matmul(a2_split, down2)
        return out


@pytest.fixture(scope="module")
def plans():
    ours = run_stages(TwoStages)
    theirs = LowerGlobalViewToLocalView()(TVMPropagateSharding()(legalize_ops(TwoStages)))
    return ours, theirs


def _param_shardings(mod):
    return {p.name: TensorSharding.from_type(p.ty) for p in mod["main"].params}


def _weight_bytes_per_device(mod) -> dict[int, int]:
    held: dict[int, int] = {}
    for param in mod["main"].params[1:]:
        sharding = TensorSharding.from_type(param.ty)
        local = sharding.local_shape([int(d) for d in param.ty.tensor_ty.shape])
        size = int(np.prod(local)) * 4
        for device in sharding.mesh.device_range:
            held[device] = held.get(device, 0) + size
    return held


def test_every_stage_weight_is_split_as_tvm_splits_it(plans):
    ours, theirs = plans
    mine = _param_shardings(ours["propagate_sharding"])
    assert mine == _param_shardings(theirs)
    assert {name: str(s.placement) for name, s in mine.items()} == {
        "x": "R", "up1": "S[1]", "down1": "S[0]", "up2": "S[1]", "down2": "S[0]"}
    for stage in ours.values():
            relax.analysis.well_formed(stage)  # raises on an ill-formed module


def test_no_more_bytes_moved_nor_weight_bytes_held_than_tvm(plans):
    ours, theirs = plans
    mine, tvms = td.comm_report(ours["local_view"]), td.comm_report(theirs)
    assert mine.total_bytes_per_rank <= tvms.total_bytes_per_rank
    assert [r.collective for r in mine.rows] == ["all_reduce", "send_recv", "all_reduce"]
    held, tvm_held = _weight_bytes_per_device(ours["local_view"]), _weight_bytes_per_device(theirs)
    assert all(held[d] <= tvm_held[d] for d in tvm_held)
    assert max(held.values()) == (32 * 64 + 64 * 32) * 4 // 2


def test_pipeline_runs_equal_to_numpy_on_four_mpi_ranks():
    rng = np.random.default_rng(7)
    x, up1, down1, up2, down2 = (0.3 * rng.standard_normal(shape, dtype=np.float32) for shape in
                                 [(16, 32), (32, 64), (64, 32), (32, 48), (48, 32)])
    hidden = np.maximum(x @ up1, 0) @ down1
    gate = hidden @ up2
    want = (gate / (1 + np.exp(-gate))) @ down2
    got = td.compile(TwoStages).run(x, up1, down1, up2, down2, backend="mpi")
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)
