"""run_disco: rank programs in disco worker processes (a disco session's workers, called once),
collectives over shared memory."""

from __future__ import annotations

import mmap
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax.distributed import DeviceMesh, Placement

import tvm_distx as td
from tvm_distx import ShardingRule
from tvm_distx.legalize.lower_distir import rank_entry
from tvm_distx.passes import AnnotateSharding
from tvm_distx.compiler.pipeline import run_stages
from tvm_distx.runtime import emulate, shard_array
from tvm_distx.runtime.disco import run_disco
from tvm_distx.runtime.disco_shm import Layout, ShmComm
from tvm_distx.layout import TensorSharding

from proc_tools import children  # tests/ is on the path
from locations import TESTS_DIR

DATA = TESTS_DIR / "data"
TARGET = tvm.target.Target({"kind": "llvm"})
SHAPE = (8, 12, 4)


def build(mod: tvm.IRModule, path: Path):
    """Compile the rank-local module and export it; returns the executable too."""
    executable = tvm.compile(mod, target=TARGET)
    executable.export_library(str(path))
    return executable


def shm_entries() -> set[str]:
    # MPI jobs of other users of this machine come and go in /dev/shm; ours
    # would be anything else.
    return {n for n in os.listdir("/dev/shm") if not n.startswith("mpich")}


def leftovers() -> list[str]:
    """Shared memory, worker processes and pipes this process still holds."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "memfd:" in target or target.startswith("/dev/shm"):
            found.append(target)
    found += [f"child process {pid}" for pid in sorted(children())]
    return found


@pytest.fixture()
def clean():
    """Check that a test leaves no shared memory, worker process or pipe behind."""
    before_shm = shm_entries()
    before_fds = set(os.listdir("/proc/self/fd"))
    yield
    assert shm_entries() - before_shm == set()
    assert leftovers() == []
    assert {fd for fd in set(os.listdir("/proc/self/fd")) - before_fds
            if os.path.exists(f"/proc/self/fd/{fd}")} == set()


# ---------------------------------------------------------------------- tensor parallel
@pytest.fixture(scope="module")
def tensor_parallel(tmp_path_factory):
    mod = td.load_module(DATA / "seed_tensor_parallel.py")
    rules = [ShardingRule(param="A", result="S[1]", function="mlp"),
             ShardingRule(param="B", result="S[0]", function="mlp"),
             ShardingRule(callee="mlp", result="S[0]", function="main")]
    stages = run_stages(AnnotateSharding(rules)(mod))
    library = tmp_path_factory.mktemp("tp") / "tp.so"
    executable = build(stages["lower_distir"], library)
    propagated = stages["propagate_sharding"]["main"]
    rng = np.random.default_rng(11)
    x, A, B = (0.1 * rng.standard_normal((128, 128), dtype="float32") for _ in range(3))
    shards = [[shard_array(v, TensorSharding.from_type(p.ty), d)
               for v, p in zip((x, A, B), propagated.params)] for d in (0, 1)]
    return library, executable, shards, (x, A, B), TensorSharding.from_type(propagated.ty.ret)


def test_tensor_parallel_on_two_workers_equals_numpy_and_the_emulator(tensor_parallel, clean):
    library, executable, shards, (x, A, B), out_sharding = tensor_parallel
    outs = run_disco(library, ["main", "main"], shards, timeout=60)

    def mlp(v):
        return np.maximum(v @ A, 0) @ B

    want = mlp(mlp(x))
    emulated = emulate(executable, shards, [0, 1])
    for device, (out, same) in enumerate(zip(outs, emulated)):
        np.testing.assert_allclose(out, shard_array(want, out_sharding, device), atol=1e-5)
        np.testing.assert_array_equal(out, same)  # the same kernels and reductions, bit for bit


def test_a_failing_rank_is_named_quickly_and_leaves_nothing_behind(tensor_parallel, clean):
    library, _, shards, _, _ = tensor_parallel
    bad = [shards[0], [s[:64] for s in shards[1]]]  # wrong shapes on rank 1
    start = time.monotonic()
    with pytest.raises(td.errors.LaunchError, match=r"rank 1 failed .*mismatch") as info:
        run_disco(library, ["main", "main"], bad, timeout=60)
    assert time.monotonic() - start < 10  # rank 0 stops waiting in its allreduce at once
    assert "Traceback" in str(info.value)


def test_a_killed_worker_is_named_and_the_run_stops(tensor_parallel, clean, monkeypatch):
    library, _, shards, _, _ = tensor_parallel
    monkeypatch.setenv("TVM_DISTX_FAULT", "1:kill")
    start = time.monotonic()
    with pytest.raises(td.errors.LaunchError, match=r"rank 1 .*exited with code -9") as info:
        run_disco(library, ["main", "main"], shards, timeout=60)
    assert info.value.rank == 1
    assert time.monotonic() - start < 15


def test_ranks_that_run_different_programs_get_an_error_not_garbage(tensor_parallel, clean):
    library, _, shards, _, _ = tensor_parallel
    # rank 0 reaches its allreduce while rank 1, which runs nothing, hands in its result
    with pytest.raises(RuntimeError, match="programs do not match"):
        run_disco(library, ["main", None], [shards[0], []], timeout=60)


def test_a_rank_that_waits_past_the_timeout_raises_timeout_error(tensor_parallel, clean):
    library, _, shards, _, _ = tensor_parallel
    # a worker process takes about a second to start: rank 0 gives up first
    start = time.monotonic()
    with pytest.raises(td.errors.LaunchError,
                       match=r"(?s)did not finish starting within 0.2 s.*rank 0 timed out "
                       "waiting for rank 1") as info:
        run_disco(library, ["main", "main"], shards, timeout=0.2)
    assert info.value.reason == "timeout"
    assert time.monotonic() - start < 10


# ---------------------------------------------------------------------- 2x2 mesh
def chain(placements: list[str], mesh_shape: tuple[int, ...]) -> tvm.IRModule:
    """x annotated with each placement in turn (a redistribute between each), then relu."""
    mesh = DeviceMesh(list(mesh_shape), tvm.ir.Range(0, int(np.prod(mesh_shape))))
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(SHAPE, "float32"))
    with bb.function("main", [x]):
        value = x
        for placement in placements:
            value = bb.emit(relax.op.distributed.annotate_sharding(
                value, mesh, Placement.from_text(placement)))
        bb.emit_func_output(bb.emit(relax.op.nn.relu(value)))
    mod = bb.get()
    mod.update_global_info("mesh", [mesh])
    return mod


def packed_calls(func) -> list[str]:
    """The packed functions ``func`` calls, destination-passing (``call_dps_packed``) or not."""
    names = []

    def visit(expr):
        if not isinstance(expr, relax.Call):
            return
        if isinstance(expr.op, relax.ExternFunc):
            names.append(str(expr.op.global_symbol))
        elif isinstance(expr.op, tvm.ir.Op) and expr.op.name == "relax.call_dps_packed":
            names.append(str(expr.args[0].global_symbol))

    relax.analysis.post_order_visit(func, visit)
    return names


def test_a_2x2_mesh_runs_alltoall_allgather_local_slice_and_send_recv(tmp_path, clean):
    stages = run_stages(chain(["S[1]S[2]", "S[0]R", "S[0]S[1]", "S[1]S[0]"], (2, 2)))
    assert packed_calls(stages["lower_distir"]["main"]) == [
        "tvm_distx.ccl.alltoall", "tvm_distx.ccl.allgather", "tvm_distx.ccl.local_slice",
        "tvm_distx.ccl.send_recv"]
    executable = build(stages["lower_distir"], tmp_path / "chain.so")
    propagated = stages["propagate_sharding"]["main"]
    x = np.random.default_rng(1).standard_normal(SHAPE).astype("float32")
    in_sharding = TensorSharding.from_type(propagated.params[0].ty)
    out_sharding = TensorSharding.from_type(propagated.ty.ret)
    devices = [0, 1, 2, 3]
    inputs = [[shard_array(x, in_sharding, d)] for d in devices]
    outs = run_disco(tmp_path / "chain.so", ["main"] * 4, inputs, timeout=60)
    emulated = emulate(executable, inputs, devices)
    for device, out, same in zip(devices, outs, emulated):
        np.testing.assert_array_equal(out, shard_array(np.maximum(x, 0), out_sharding, device))
        np.testing.assert_array_equal(out, same)


# ---------------------------------------------------------------------- pipeline stages
def test_pipeline_stages_run_their_own_entries_with_send_and_recv(tmp_path, clean):
    mod = td.load_module(DATA / "seed_pipeline.py")
    rule = ShardingRule(callee="mlp", args={0: "R"}, meshes=["mesh[0]", "mesh[1]"])
    ranks = td.lower_to_ranks(AnnotateSharding([rule])(mod))
    entries = [rank_entry(ranks, "main", d) for d in (0, 1)]
    calls = packed_calls(ranks["main_rank0"]) + packed_calls(ranks["main_rank1"])
    assert {"tvm_distx.ccl.send", "tvm_distx.ccl.recv"} <= set(calls)
    build(ranks, tmp_path / "pipe.so")
    rng = np.random.default_rng(5)
    x, A, B = (0.1 * rng.standard_normal((128, 128), dtype="float32") for _ in range(3))
    outs = run_disco(tmp_path / "pipe.so", entries, [[x, A, B], []], timeout=60)

    def mlp(v):
        return np.maximum(v @ A, 0) @ B

    assert outs[0] in ((), None)
    np.testing.assert_allclose(outs[1], mlp(mlp(x)), atol=1e-5)


def test_a_move_onto_an_overlapping_mesh_runs_send_recv_and_recv(tmp_path, clean):
    """R on devices 0-1, then S[0] on devices 0-3: 0 and 1 are on both sides, 2 and 3 receive."""
    src = DeviceMesh([2], tvm.ir.Range(0, 2))
    dst = DeviceMesh([4], tvm.ir.Range(0, 4))
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(SHAPE, "float32"))
    with bb.function("main", [x]):
        held = bb.emit(relax.op.distributed.annotate_sharding(x, src, Placement.from_text("R")))
        moved = bb.emit(relax.op.distributed.annotate_sharding(held, dst,
                                                               Placement.from_text("S[0]")))
        bb.emit_func_output(bb.emit(relax.op.nn.relu(moved)))
    mod = bb.get()
    mod.update_global_info("mesh", [src, dst])
    stages = run_stages(mod)
    ranks = stages["lower_distir"]
    devices = [0, 1, 2, 3]
    entries = [rank_entry(ranks, "main", d) for d in devices]
    assert packed_calls(ranks[entries[0]]) == ["tvm_distx.ccl.send_recv"]
    assert packed_calls(ranks[entries[3]]) == ["tvm_distx.ccl.recv"]
    executable = build(ranks, tmp_path / "overlap.so")
    out_sharding = TensorSharding.from_type(stages["propagate_sharding"]["main"].ty.ret)
    x = np.random.default_rng(4).standard_normal(SHAPE).astype("float32")
    inputs = [[x] if d < 2 else [] for d in devices]
    outs = run_disco(tmp_path / "overlap.so", entries, inputs, timeout=60)
    emulated = emulate(executable, inputs, devices, entry=entries)
    for device, out, same in zip(devices, outs, emulated):
        np.testing.assert_array_equal(out, shard_array(np.maximum(x, 0), out_sharding, device))
        np.testing.assert_array_equal(out, same)


def test_a_device_with_no_entry_returns_none(tmp_path, clean):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((3,), "float32"))
    with bb.function("main", [x]):
        bb.emit_func_output(relax.Tuple([x, bb.emit(relax.op.add(x, x))]))
    build(relax.transform.LegalizeOps()(bb.get()), tmp_path / "lone.so")
    one = np.arange(3, dtype="float32")
    outs = run_disco(tmp_path / "lone.so", ["main", None], [[one], []], timeout=60)
    assert outs[1] is None
    np.testing.assert_array_equal(outs[0][0], one)
    np.testing.assert_array_equal(outs[0][1], 2 * one)


# ---------------------------------------------------------------------- TVM's own builtins
def test_tvm_disco_builtins_run_over_the_same_shared_memory(tmp_path, clean):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 3), "float32"))
    with bb.function("main", [x]):
        total = bb.emit(relax.op.ccl.allreduce(x, "sum"))
        gathered = bb.emit(relax.op.ccl.allgather(total, 2))
        first = bb.emit(relax.op.ccl.broadcast_from_worker0(x))
        part = bb.emit(relax.op.ccl.scatter_from_worker0(gathered, 2))
        bb.emit_func_output(relax.Tuple([total, gathered, first, part]))
    build(relax.transform.LegalizeOps()(bb.get()), tmp_path / "builtins.so")
    xs = [np.arange(12, dtype="float32").reshape(4, 3) * (d + 1) for d in (0, 1)]
    outs = run_disco(tmp_path / "builtins.so", ["main", "main"], [[v] for v in xs], timeout=60)
    for device, (total, gathered, first, part) in enumerate(outs):
        np.testing.assert_array_equal(total, xs[0] + xs[1])
        np.testing.assert_array_equal(gathered, np.concatenate([total, total]))
        np.testing.assert_array_equal(first, xs[0])
        np.testing.assert_array_equal(part, np.split(gathered, 2)[device])


# ---------------------------------------------------------------------- the transport alone
def test_a_post_larger_than_a_slot_goes_in_rounds():
    """Three ranks as threads over one segment with 64-byte slots: posts of 0 to 1000 bytes."""
    layout = Layout(3, 64, 1)
    fd = os.memfd_create("test_disco")
    os.ftruncate(fd, layout.size)
    buf = mmap.mmap(fd, layout.size)
    posts = {0: np.arange(1000, dtype=np.uint8), 1: np.empty(0, np.uint8),
             2: np.arange(130, dtype=np.uint8)[::-1].copy()}
    got, errors = {}, []

    def rank(r: int) -> None:
        try:
            comm = ShmComm(buf, layout, r, time.time() + 30)
            for _ in range(3):  # meetings back to back reuse the slots
                got[r] = comm.meet("test", (0, 1, 2), posts[r], (0, 1, 2))
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    os.close(fd)
    assert not errors
    for r in range(3):
        for p in range(3):
            np.testing.assert_array_equal(got[r][p], posts[p])


def test_a_shutdown_that_blocks_on_a_stuck_worker_is_ended_by_killing_it(monkeypatch):
    """Disco's shutdown waits for its workers; one that never answers must not hang us."""
    import subprocess
    import sys

    from tvm_distx.runtime import disco

    monkeypatch.setattr(disco, "_GRACE", 0.5)
    pool = disco._Pool(-1)
    stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    ours, theirs = os.pipe()
    pool.procs[1], pool.pipes[1] = stuck, (ours, theirs)

    class Session:  # shutdown returns only once the worker is gone, like a pipe read
        def shutdown(self):
            stuck.wait()

    started = time.monotonic()
    disco._shutdown(Session(), pool)
    assert time.monotonic() - started < 5
    assert stuck.poll() is not None  # killed
    os.close(ours)
    os.close(theirs)
