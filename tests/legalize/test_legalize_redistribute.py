"""LegalizeRedistribute: planned collectives in the IR, run on emulated ranks."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax.distributed import DeviceMesh, Placement

import tvm_distx as td
from tvm_distx.legalize import LegalizeRedistribute, LowerDistIR, LowerGlobalViewToLocalView
from tvm_distx.legalize.legalize_redistribute import _plan_with_symbolic_extents
from tvm_distx.legalize.lower_distir import rank_entry
from tvm_distx.layout.mesh import DeviceMesh as DistMesh
from tvm_distx.passes import PropagateSharding
from tvm_distx.runtime import emulate, shard_array
from tvm_distx.layout import TensorSharding

from programs import SHAPE, moved

TARGET = tvm.target.Target({"kind": "llvm"})




def pipeline(mod):
    propagated = PropagateSharding(require_legalized=True)(relax.transform.LegalizeOps()(mod))
    local = LowerGlobalViewToLocalView()(propagated)
    legal = LegalizeRedistribute()(local)
    return propagated, legal, LowerDistIR()(legal)


def packed_calls(func) -> list[str]:
    names = []

    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and (
            expr.op.name == "relax.call_dps_packed"
        ):
            names.append(expr.args[0].global_symbol)

    relax.analysis.post_order_visit(func, visit)
    return names


CASES = [
    ("S[0]", "R", (2,), ["tvm_distx.ccl.allgather"]),
    ("R", "S[1]", (2,), ["tvm_distx.ccl.local_slice"]),
    ("S[0]", "S[1]", (4,), ["tvm_distx.ccl.alltoall"]),
    ("S[0]R", "S[0]S[2]", (2, 2), ["tvm_distx.ccl.local_slice"]),
    ("S[2]S[1]", "S[0]R", (2, 2), None),
    ("S[0]R", "RS[1]", (2, 2), None),
    ("RS[1]", "RR", (2, 2), ["tvm_distx.ccl.allgather"]),
]


@pytest.mark.parametrize("src,dst,mesh_shape,expected", CASES,
                         ids=[f"{s}->{d}@{m}" for s, d, m, _ in CASES])
def test_redistribute_runs_and_equals_numpy(src, dst, mesh_shape, expected):
    propagated, legal, lowered = pipeline(moved(src, dst, mesh_shape))
    calls = packed_calls(legal["main"])
    assert "relax.dist.redistribute" not in legal.script()
    if expected is not None:
        assert calls == expected
    devices = list(range(int(np.prod(mesh_shape))))
    x = np.random.default_rng(1).standard_normal(SHAPE).astype("float32")
    in_sharding = TensorSharding.from_type(propagated["main"].params[0].ty)
    out_sharding = TensorSharding.from_type(propagated["main"].ty.ret)
    assert str(out_sharding.placement) == dst
    inputs = [[shard_array(x, in_sharding, d)] for d in devices]
    outs = emulate(tvm.compile(lowered, target=TARGET), inputs, devices)
    for device, out in zip(devices, outs):
        np.testing.assert_array_equal(out, shard_array(np.maximum(x, 0), out_sharding, device))


def test_collectives_run_along_one_mesh_axis():
    from tvm_distx.legalize import CollectiveGroup

    _, legal, _ = pipeline(moved("RS[1]", "RR", (2, 2)))
    call = [b.value for b in legal["main"].body.blocks[0].bindings
            if isinstance(b.value, relax.Call) and b.value.op.name == "relax.call_dps_packed"][0]
    group = CollectiveGroup.decode(call.args[1].fields[1].values)
    assert group.axes == (1,)
    assert [int(v) for v in call.args[1].fields[2].values] == [1]  # gather dim


def moved_between(src: str, src_mesh: DeviceMesh, dst: str, dst_mesh: DeviceMesh):
    """x annotated src on one mesh, then dst on another (a move between stages), then relu."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(SHAPE, "float32"))
    with bb.function("main", [x]):
        x1 = bb.emit(relax.op.distributed.annotate_sharding(x, src_mesh,
                                                            Placement.from_text(src)))
        y = bb.emit(relax.op.distributed.annotate_sharding(x1, dst_mesh,
                                                           Placement.from_text(dst)),
                    name_hint="y")
        z = bb.emit(relax.op.nn.relu(y), name_hint="z")
        bb.emit_func_output(z)
    mod = bb.get()
    mod.update_global_info("mesh", [src_mesh, dst_mesh])
    return mod


def mesh(shape, first):
    return DeviceMesh(list(shape), tvm.ir.Range(first, first + int(np.prod(shape))))


BETWEEN = [
    # disjoint stages of equal and of different sizes
    ("S[0]", mesh((2,), 0), "S[1]", mesh((2,), 2)),
    ("R", mesh((2,), 0), "S[2]", mesh((4,), 2)),
    ("S[0]S[1]", mesh((2, 2), 0), "R", mesh((2,), 4)),
    # overlapping meshes: devices in both keep what they hold
    ("R", mesh((2,), 0), "S[0]", mesh((4,), 0)),
    ("S[1]", mesh((4,), 0), "S[1]R", mesh((2, 2), 0)),
    ("S[0]", mesh((4,), 0), "S[0]", mesh((2,), 2)),
]


@pytest.mark.parametrize("src,src_mesh,dst,dst_mesh", BETWEEN,
                         ids=[f"{s}@{a.shape}->{d}@{b.shape}" for s, a, d, b in BETWEEN])
def test_moves_between_meshes_run_and_equal_numpy(src, src_mesh, dst, dst_mesh):
    propagated, legal, lowered = pipeline(moved_between(src, src_mesh, dst, dst_mesh))
    assert packed_calls(legal["main"]) == ["tvm_distx.ccl.send_recv"]
    src_devices = td.DeviceMesh.from_tvm(src_mesh).device_range
    dst_devices = td.DeviceMesh.from_tvm(dst_mesh).device_range
    devices = list(range(max(src_devices.stop, dst_devices.stop)))
    entries = [rank_entry(lowered, "main", d) for d in devices]
    in_sharding = TensorSharding.from_type(propagated["main"].params[0].ty)
    out_sharding = TensorSharding.from_type(propagated["main"].ty.ret)
    x = np.random.default_rng(4).standard_normal(SHAPE).astype("float32")
    inputs = [[shard_array(x, in_sharding, d)] if d in src_devices else []
              for d in devices]
    outs = emulate(tvm.compile(lowered, target=TARGET), inputs, devices, entry=entries)
    for device, out in zip(devices, outs):
        if device in dst_devices:
            np.testing.assert_array_equal(out, shard_array(np.maximum(x, 0), out_sharding,
                                                           device))
        else:  # a device of the source stage only returns nothing
            assert out in ((), None)


def test_a_kernel_on_a_dimension_split_by_two_mesh_axes_runs_on_the_outer_split():
    """TVM's local view gets "S[0]S[0]" kernels wrong: relu runs on "S[0]R" instead,
    reached from "RR" by a local slice, and a second slice gives "S[0]S[0]" back."""
    _, legal, _ = pipeline(moved("RR", "S[0]S[0]", (2, 2)))
    assert packed_calls(legal["main"]) == ["tvm_distx.ccl.local_slice"] * 2


def test_every_transition_on_a_2x2_mesh_is_right():
    """Each of the 240 changes of placement of a rank-3 tensor on a 2x2 mesh, then a
    kernel, runs on emulated ranks equal to numpy (kernels on a dimension split by two
    mesh axes included: they run on the outer split)."""
    import itertools

    entries = ["R", "S[0]", "S[1]", "S[2]"]
    placements = ["".join(p) for p in itertools.product(entries, repeat=2)]
    x = np.random.default_rng(3).standard_normal(SHAPE).astype("float32")
    devices = [0, 1, 2, 3]
    ran = 0
    for src, dst in itertools.product(placements, placements):
        if src == dst:
            continue
        propagated, _, lowered = pipeline(moved(src, dst, (2, 2)))
        in_sharding = TensorSharding.from_type(propagated["main"].params[0].ty)
        out_sharding = TensorSharding.from_type(propagated["main"].ty.ret)
        outs = emulate(tvm.compile(lowered, target=TARGET),
                       [[shard_array(x, in_sharding, d)] for d in devices], devices)
        for device, out in zip(devices, outs):
            np.testing.assert_array_equal(out, shard_array(np.maximum(x, 0), out_sharding, device),
                                          err_msg=f"{src} -> {dst} on device {device}")
        ran += 1
    assert ran == 240


def test_a_relay_across_two_mesh_axes_is_one_send_recv_at_the_lower_bound():
    from tvm_distx.reports.comm_report import comm_report
    from tvm_distx.legalize import lower_bound_bytes

    propagated, legal, lowered = pipeline(moved("S[0]S[1]", "S[1]S[0]", (2, 2)))
    assert packed_calls(legal["main"]) == ["tvm_distx.ccl.send_recv"]
    report = comm_report(propagated)
    src = TensorSharding.from_type(propagated["main"].params[0].ty)
    dst = TensorSharding.from_type(propagated["main"].ty.ret)
    assert report.total_bytes_per_rank == lower_bound_bytes(src, dst, SHAPE, "float32") > 0
    x = np.random.default_rng(5).standard_normal(SHAPE).astype("float32")
    devices = [0, 1, 2, 3]
    outs = emulate(tvm.compile(lowered, target=TARGET),
                   [[shard_array(x, src, d)] for d in devices], devices)
    for device, out in zip(devices, outs):
        np.testing.assert_array_equal(out, shard_array(np.maximum(x, 0), dst, device))


def test_a_redistributed_dataflow_output_stays_an_output():
    n = 2
    mesh = DeviceMesh([n], tvm.ir.Range(0, n))
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(SHAPE, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            x1 = bb.emit(relax.op.distributed.annotate_sharding(x, mesh, Placement.from_text("S[0]")))
            y = bb.emit(relax.op.nn.relu(x1))
            z = bb.emit_output(relax.op.distributed.annotate_sharding(
                y, mesh, Placement.from_text("S[1]")), name_hint="z")
        bb.emit_func_output(z)
    mod = bb.get()
    mod.update_global_info("mesh", [mesh])
    propagated, legal, lowered = pipeline(mod)
    relax.analysis.well_formed(legal)
    relax.analysis.well_formed(lowered)
    data = np.random.default_rng(2).standard_normal(SHAPE).astype("float32")
    src = TensorSharding.from_type(propagated["main"].params[0].ty)
    dst = TensorSharding.from_type(propagated["main"].ty.ret)
    outs = emulate(tvm.compile(lowered, target=TARGET), [[shard_array(data, src, d)] for d in (0, 1)],
                   [0, 1])
    for device, out in zip((0, 1), outs):
        np.testing.assert_array_equal(out, shard_array(np.maximum(data, 0), dst, device))


@pytest.mark.parametrize("mesh_shape", [(2, 2), (2, 4)])
def test_a_redistribute_after_a_partial_sum_plans_from_the_all_reduce_input_layout(mesh_shape):
    # Found by the randomized tests. x1 @ x2 with the contraction split along mesh
    # axis 0 and rows along axis 1 is all-reduced over axis 0 only: the result is
    # "R, S[0]", though TVM types it "R, R". Moving it to "S[1], R" needs a local
    # slice along axis 0 and an all-gather along axis 1; planning from the
    # all-reduce's type dropped the all-gather and each rank returned a wrong shape.
    n = int(np.prod(mesh_shape))
    mesh = DeviceMesh(list(mesh_shape), tvm.ir.Range(0, n))
    bb = relax.BlockBuilder()
    a = relax.Var("a", relax.TensorType((16, 16), "float32"))
    b = relax.Var("b", relax.TensorType((16, 12), "float32"))

    def annotate(value, placement):
        return relax.op.distributed.annotate_sharding(value, mesh, Placement.from_text(placement))

    with bb.function("main", [a, b]):
        a1 = bb.emit(annotate(a, "RS[0]"))
        b1 = bb.emit(annotate(b, "S[0]R"))
        c = bb.emit(relax.op.matmul(a1, b1))
        bb.emit_func_output(bb.emit(annotate(c, "S[1]R")))
    mod = bb.get()
    mod.update_global_info("mesh", [mesh])
    _, legal, _ = pipeline(mod)
    # (the first local slice moves a to "S[1], S[0]" for the matmul). The partial
    # sum "P, S[0]" reaches "S[1], R" by a reduce-scatter along axis 0 (the sum
    # split on dim 1, where an all-reduce and a local slice did the same with
    # twice the bytes) and the all-gather along axis 1, which must not be dropped
    assert packed_calls(legal["main"])[-2:] == ["tvm_distx.ccl.reducescatter",
                                                "tvm_distx.ccl.allgather"]
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((16, 16), "float32"), rng.standard_normal((16, 12), "float32")
    out = td.compile(mod, schedule=False).run(x, y, backend="emulate")
    np.testing.assert_allclose(out, x @ y, rtol=1e-5, atol=1e-4)


def test_a_partial_sum_passed_to_a_function_on_a_2x2_mesh():
    # Found by the randomized tests. sum over a dimension split along mesh axis 1
    # is all-reduced over that axis and stays "S[1], R"; TVM types the all-reduce
    # "R, R", and the call of f (parameter "S[1], R") failed TVM's type check.
    mesh = DeviceMesh([2, 2], tvm.ir.Range(0, 4))
    bb = relax.BlockBuilder()
    p = relax.Var("p", relax.TensorType((6, 4), "float32"))
    with bb.function("f", [p], private=True):
        bb.emit_func_output(bb.emit(relax.op.max(p, axis=[0])))
    f = bb.get().get_global_var("f")
    x = relax.Var("x", relax.TensorType((6, 4, 16), "float32"))
    with bb.function("main", [x]):
        x1 = bb.emit(relax.op.distributed.annotate_sharding(x, mesh,
                                                            Placement.from_text("S[1]S[2]")))
        s = bb.emit(relax.op.sum(x1, axis=[2]))
        bb.emit_func_output(bb.emit(relax.Call(f, [s])))
    mod = bb.get()
    mod.update_global_info("mesh", [mesh])
    value = np.random.default_rng(6).standard_normal((6, 4, 16), "float32")
    got = td.compile(mod, schedule=False).run(value, backend="emulate")
    np.testing.assert_allclose(got, value.sum(axis=2).max(axis=0), rtol=1e-5, atol=1e-5)


def _one_local_slice(mod: tvm.IRModule, mesh: DeviceMesh):
    """``mod`` on ``mesh``, its one redistribution lowered to a local slice (no collective);
    compiled."""
    mod.update_global_info("mesh", [mesh])
    mod = relax.transform.LegalizeOps()(mod)
    legal = LegalizeRedistribute()(LowerGlobalViewToLocalView()(PropagateSharding()(mod)))
    text = legal["main"].script()
    assert text.count("tvm_distx.ccl.local_slice") == 1 and "redistribute" not in text
    return td.compile(mod)


def test_a_local_slice_along_a_static_dimension_keeps_a_symbolic_one():
    # the routing weights of an expert-parallel MoE layer: (experts, tokens) replicated,
    # read split on the experts, with a run-time token count. Each rank cuts its block
    # from its own copy, so the symbolic extent needs no plan; one compile serves all.
    n = tvm.tirx.Var("n", "int64")
    mesh = DeviceMesh((2,), tvm.ir.Range(0, 2))
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n, 8), "float32"))
    w = relax.Var("w", relax.TensorType((n, 8), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            xr = bb.emit(relax.op.distributed.annotate_sharding(x, mesh, Placement.from_text("R")))
            ws = bb.emit(relax.op.distributed.annotate_sharding(
                w, mesh, Placement.from_text("S[1]")))
            y = bb.emit_output(relax.op.multiply(xr, ws))
        bb.emit_func_output(y)
    exe = _one_local_slice(bb.get(), mesh)
    rng = np.random.default_rng(0)
    for size in (1, 5):
        a, b = (rng.standard_normal((size, 8), dtype="float32") for _ in range(2))
        np.testing.assert_array_equal(exe.run(a, b, backend="emulate"), a * b)


def test_a_local_slice_cuts_a_symbolic_extent_its_parts_always_divide():
    # Llama 4's experts: the tokens repeated per expert, (4 * n, 8) replicated, scaled by
    # the routing weights split on the experts, summed over the experts: each rank cuts
    # its 2 * n rows from its copy, whatever n.
    n = tvm.tirx.Var("n", "int64")
    mesh = DeviceMesh((2,), tvm.ir.Range(0, 2))

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n, 8), "float32"))
    w = relax.Var("w", relax.TensorType((4, n), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            xr = bb.emit(relax.op.distributed.annotate_sharding(x, mesh, Placement.from_text("R")))
            ws = bb.emit(relax.op.distributed.annotate_sharding(
                w, mesh, Placement.from_text("S[0]")))
            tiled = bb.emit(relax.op.tile(xr, [4, 1]))
            routed = bb.emit(relax.op.multiply(tiled, relax.op.reshape(ws, (4 * n, 1))))
            y = bb.emit_output(relax.op.sum(relax.op.reshape(routed, (4, n, 8)), axis=[0]))
        bb.emit_func_output(y)
    exe = _one_local_slice(bb.get(), mesh)
    rng = np.random.default_rng(1)
    for size in (1, 3):
        a = rng.standard_normal((size, 8), dtype="float32")
        b = rng.standard_normal((4, size), dtype="float32")
        np.testing.assert_allclose(exe.run(a, b, backend="emulate"),
                                   (b[:, :, None] * a).sum(axis=0), rtol=1e-6, atol=1e-6)
    # the stage refuses a cut of an extent its parts may not divide (n + 1 in two)
    layouts = [TensorSharding(DistMesh((2,), range(0, 2)), text) for text in ("R", "S[0]")]
    assert _plan_with_symbolic_extents(*layouts, (None, 8), "float32", [4 * n, 8]) is not None
    assert _plan_with_symbolic_extents(*layouts, (None, 8), "float32", [n + 1, 8]) is None
