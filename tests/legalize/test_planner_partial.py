"""The planner on partial sums: all-reduce, reduce-scatter, their order on N-D meshes, the bound.

Every plan runs on numpy (``tests/planner_sim.py``): each device starts from
its box of one integer-valued addend (a different one per coordinate along the
partial axes, together summing to the tensor), and after the plan every device
must hold exactly its block of the sum, as ``np.split`` cuts it.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from planner_sim import simulate, split_into_addends  # tests/ is on the path

from tvm_distx.errors import PlacementSyntaxError, ShardingError
from tvm_distx.layout import (
    DeviceMesh,
    Partial,
    Placement,
    SendRecvSpec,
    Shard,
    TensorSharding,
    send_recv_transfers,
)
from tvm_distx.legalize.planner import Collective, lower_bound_bytes, plan_redistribute

SHAPE = (8, 16, 24)
DTYPE = "float32"
ITEM = 4
N = math.prod(SHAPE)
T = N * ITEM
ARRAY = np.arange(N, dtype=np.float64).reshape(SHAPE)  # integers: sums are exact
ENTRIES = ("R", "P", "S[0]", "S[1]", "S[2]")


def mesh(shape, first: int = 0) -> DeviceMesh:
    return DeviceMesh(shape, range(first, first + math.prod(shape)))


def ts(m: DeviceMesh, text: str) -> TensorSharding:
    return TensorSharding(m, Placement.parse(text))


def ref_block(sharding: TensorSharding, device: int) -> np.ndarray:
    """Nested np.split of the whole tensor, major mesh axis first."""
    coord = np.unravel_index(device - sharding.mesh.device_range.start, sharding.mesh.shape)
    block = ARRAY
    for axis, entry in enumerate(sharding.placement.entries):
        if isinstance(entry, Shard):
            block = np.split(block, sharding.mesh.shape[axis], axis=entry.dim)[coord[axis]]
    return block


def run(plan, seed: int = 0) -> None:
    """Simulate ``plan`` from random addends; every device ends with its block of the sum."""
    addends = split_into_addends(plan.src, ARRAY, np.random.default_rng(seed))
    assert len(addends) == math.prod(plan.src.mesh.shape[a]
                                     for a in plan.src.placement.partial_axes())
    out = simulate(plan, ARRAY, addends)
    if plan.dst.placement.has_partial():  # P -> P axes keep their addends
        return
    for device, block in out.items():
        np.testing.assert_array_equal(block, ref_block(plan.dst, device),
                                      err_msg=f"{plan.src} -> {plan.dst} on device {device}")


def check_steps(plan) -> None:
    """Each step changes its own mesh axis only, as its kind says, at the ring's cost."""
    for step in plan.steps:
        a, p = step.mesh_axis, step.src.mesh.shape[step.mesh_axis]
        before, after = step.src.placement.entries, step.dst.placement.entries
        assert before[:a] + before[a + 1:] == after[:a] + after[a + 1:]
        s = ITEM * math.prod(step.src.local_shape(SHAPE))
        if step.collective is Collective.ALL_REDUCE:
            assert (before[a], after[a], step.tensor_axes) == (Partial(), Placement.parse("R")
                                                               .entries[0], ())
            assert step.bytes_received == step.bytes_sent == 2 * s * (p - 1) // p
        elif step.collective is Collective.REDUCE_SCATTER:
            assert before[a] == Partial() and after[a] == Shard(step.tensor_axes[0])
            assert step.bytes_received == step.bytes_sent == s * (p - 1) // p
        else:
            assert not before[a].is_partial() and not after[a].is_partial()
    assert plan.bytes_received == sum(s.bytes_received for s in plan.steps)


@pytest.mark.parametrize("p", [2, 4])
def test_partial_to_replicate_is_one_all_reduce_at_the_bound(p):
    plan = plan_redistribute(ts(mesh((p,)), "P"), ts(mesh((p,)), "R"), SHAPE, DTYPE)
    [step] = plan.steps
    assert (step.collective, step.mesh_axis, step.tensor_axes) == (Collective.ALL_REDUCE, 0, ())
    assert plan.bytes_received == plan.lower_bound == 2 * T * (p - 1) // p
    check_steps(plan)
    run(plan)


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("dim", [0, 1, 2])
def test_partial_to_shard_is_one_reduce_scatter_at_the_bound(p, dim):
    plan = plan_redistribute(ts(mesh((p,)), "P"), ts(mesh((p,)), f"S[{dim}]"), SHAPE, DTYPE)
    [step] = plan.steps
    assert (step.collective, step.mesh_axis, step.tensor_axes) == (
        Collective.REDUCE_SCATTER, 0, (dim,))
    assert plan.bytes_received == plan.lower_bound == T * (p - 1) // p
    # half the all-reduce's bytes: the reason to keep a partial sum until its consumer
    all_reduce = plan_redistribute(ts(mesh((p,)), "P"), ts(mesh((p,)), "R"), SHAPE, DTYPE)
    assert 2 * plan.bytes_received == all_reduce.bytes_received
    check_steps(plan)
    run(plan)


def test_partial_to_partial_is_nothing():
    m = mesh((2, 2))
    plan = plan_redistribute(ts(m, "PS[1]"), ts(m, "PS[1]"), SHAPE, DTYPE)
    assert plan.steps == () and plan.bytes_received == plan.lower_bound == 0
    # P -> P on one axis, the other axis moves on its own
    kept = plan_redistribute(ts(m, "PS[1]"), ts(m, "PR"), SHAPE, DTYPE)
    assert [(s.collective, s.mesh_axis) for s in kept.steps] == [(Collective.ALL_GATHER, 1)]
    run(kept)


def test_hierarchical_all_reduce_on_2x2_meets_the_bound():
    m = mesh((2, 2))
    plan = plan_redistribute(ts(m, "PP"), ts(m, "RR"), SHAPE, DTYPE)
    # two all-reduces would receive 2 tensors; the bound is (G + B - 2) / n = 6/4
    assert plan.lower_bound == T * 3 // 2 == plan.bytes_received
    kinds = [s.collective for s in plan.steps]
    assert kinds == [Collective.REDUCE_SCATTER, Collective.ALL_REDUCE, Collective.ALL_GATHER]
    check_steps(plan)
    run(plan)


def test_slice_before_reducing():
    m = mesh((2, 2))
    plan = plan_redistribute(ts(m, "PR"), ts(m, "RS[0]"), SHAPE, DTYPE)
    assert [(s.collective, s.mesh_axis) for s in plan.steps] == [
        (Collective.LOCAL_SLICE, 1), (Collective.ALL_REDUCE, 0)]
    assert plan.bytes_received == plan.lower_bound == T // 2
    run(plan)


def test_reduce_scatter_respects_the_nested_split_rule():
    # axis 1 already splits dim 0, so a reduce-scatter on axis 0 cannot put the
    # outer split of dim 0; the plan scatters onto another dim and moves it
    m = mesh((2, 2))
    plan = plan_redistribute(ts(m, "PS[0]"), ts(m, "S[0]S[0]"), SHAPE, DTYPE)
    scatters = [s for s in plan.steps if s.collective is Collective.REDUCE_SCATTER]
    assert scatters
    for step in scatters:  # no higher-numbered axis splits the dim when it is scattered onto
        [dim] = step.tensor_axes
        assert all(a < step.mesh_axis for a in step.src.placement.mesh_axes_sharding(dim))
    check_steps(plan)
    run(plan)
    assert plan.bytes_received > plan.lower_bound  # collectives only: a partial sum has no send/recv


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2), (2, 4)],
                         ids=lambda s: "x".join(map(str, s)))
def test_every_partial_source_is_valid_and_never_below_the_bound(mesh_shape):
    m = mesh(mesh_shape)
    at_bound = total = 0
    for a in itertools.product(ENTRIES, repeat=len(mesh_shape)):
        if "P" not in a:
            continue
        for b in itertools.product(ENTRIES, repeat=len(mesh_shape)):
            if any(y == "P" and x != "P" for x, y in zip(a, b)):
                continue
            src, dst = ts(m, "".join(a)), ts(m, "".join(b))
            plan = plan_redistribute(src, dst, SHAPE, DTYPE)
            assert plan.lower_bound == lower_bound_bytes(src, dst, SHAPE, DTYPE)
            assert plan.bytes_received >= plan.lower_bound, (a, b)
            assert all(s.collective is not Collective.SEND_RECV for s in plan.steps)
            check_steps(plan)
            run(plan, seed=total)
            total += 1
            at_bound += plan.bytes_received == plan.lower_bound
    if len(mesh_shape) == 1:
        assert at_bound == total == 5  # P -> R, P -> S[0..2], P -> P
    else:
        assert total == 185 and at_bound == 125


def test_closed_form_bound_for_partial_sources():
    two = mesh((2, 4))
    # G = 8 addends to every rank (B = 8) of 8: (8 + 8 - 2) / 8
    assert lower_bound_bytes(ts(two, "PP"), ts(two, "RR"), SHAPE, DTYPE) == T * 14 // 8
    # reduced over axis 1 (G = 4), axis 0 keeps its addends (M = 2), B = 4
    assert lower_bound_bytes(ts(two, "PP"), ts(two, "PR"), SHAPE, DTYPE) == T * 2 * 6 // 8
    # both bounds at work: reducing axis 1 (G = 4, B = 1) needs N * 3 / 8 values per
    # rank; reading P as R, the S[1] -> S[0] move needs its own copies
    bound = lower_bound_bytes(ts(two, "S[1]P"), ts(two, "S[0]S[2]"), SHAPE, DTYPE)
    copies = lower_bound_bytes(ts(two, "S[1]R"), ts(two, "S[0]S[2]"), SHAPE, DTYPE)
    assert bound == max(copies, -(-N * 3 * ITEM // 8)) and bound > 0


def test_partial_sums_are_only_reduced_never_made():
    m = mesh((2,))
    for src in ("R", "S[0]"):
        with pytest.raises(ShardingError, match="only an operator"):
            plan_redistribute(ts(m, src), ts(m, "P"), SHAPE, DTYPE)
    with pytest.raises(ShardingError, match="within its mesh"):
        plan_redistribute(ts(m, "P"), ts(mesh((2,), 2), "R"), SHAPE, DTYPE)
    with pytest.raises(ShardingError, match="partial"):
        send_recv_transfers(ts(m, "P"), ts(m, "R"), SHAPE)
    with pytest.raises(ShardingError, match="partial"):
        SendRecvSpec(SHAPE, ts(m, "P"), ts(mesh((2,), 2), "R"))


def test_partial_placement_text_and_tvm():
    assert Partial() == Partial("sum") and str(Placement.parse("S[0]P")) == "S[0]P"
    with pytest.raises(PlacementSyntaxError, match="partial sum"):
        Placement.parse("PR").to_tvm()
