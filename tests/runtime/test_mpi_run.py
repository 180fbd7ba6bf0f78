"""Real ranks under mpiexec: results equal to numpy, and failures that stop cleanly.

Every run here is ``mpiexec -n 2`` or ``-n 4`` with one Python process per rank
(oversubscribing the CI machine's 2 cores is fine).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax.distributed import DeviceMesh, Placement

import tvm_distx as td
from tvm_distx import ShardingRule
from tvm_distx.passes import AnnotateSharding
from tvm_distx.runtime.backends import launch
from tvm_distx.runtime.kernel_times import read_times

from reference import mlp_twice  # noqa: E402
from proc_tools import parents  # noqa: E402
from locations import TESTS_DIR

DATA = TESTS_DIR / "data"



@pytest.fixture(scope="module")
def weights():
    rng = np.random.default_rng(17)
    return [(0.1 * rng.standard_normal((128, 128))).astype("float32") for _ in range(3)]


@pytest.fixture(scope="module")
def tensor_parallel():
    mod = td.load_module(DATA / "seed_tensor_parallel.py")
    rules = [ShardingRule(param="A", result="S[1]", function="mlp"),
             ShardingRule(param="B", result="S[0]", function="mlp")]
    return td.compile(AnnotateSharding(rules)(mod))


def test_tensor_parallel_mlp_on_two_mpi_ranks_equals_numpy_and_the_emulator(tensor_parallel,
                                                                              weights):
    x, A, B = weights
    out = tensor_parallel.run(x, params={"A": A, "B": B}, backend="mpi")
    np.testing.assert_allclose(out, mlp_twice(x, A, B), rtol=1e-5, atol=1e-5)
    emulated = tensor_parallel.run(x, params={"A": A, "B": B}, backend="emulate")
    np.testing.assert_array_equal(out, emulated)


def test_2x2_data_by_model_mesh_on_four_ranks(weights):
    mod = td.load_module(DATA / "seed_mesh2x2.py")
    rule = ShardingRule(callee="mlp", args={0: "S[0]R", 1: "RS[1]", 2: "RS[0]"})
    exe = td.compile(AnnotateSharding([rule])(mod))
    assert exe.num_ranks == 4
    np.testing.assert_allclose(exe.run(*weights, backend="mpi"), mlp_twice(*weights),
                               rtol=1e-5, atol=1e-5)


def test_seed_pipeline_stages_on_two_ranks_send_and_receive(weights):
    mod = td.load_module(DATA / "seed_pipeline.py")
    rule = ShardingRule(callee="mlp", args={0: "R"}, meshes=["mesh[0]", "mesh[1]"])
    exe = td.compile(AnnotateSharding([rule])(mod))
    np.testing.assert_allclose(exe.run(*weights, backend="mpi"), mlp_twice(*weights),
                               rtol=1e-5, atol=1e-5)


SHAPE = (8, 12, 4)


def moved(src: str, src_mesh, dst: str, dst_mesh) -> tvm.IRModule:
    """x annotated src, then dst (a redistribute), then relu."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(SHAPE, "float32"))
    with bb.function("main", [x]):
        x1 = bb.emit(relax.op.distributed.annotate_sharding(x, src_mesh,
                                                            Placement.from_text(src)))
        y = bb.emit(relax.op.distributed.annotate_sharding(x1, dst_mesh,
                                                           Placement.from_text(dst)))
        bb.emit_func_output(bb.emit(relax.op.nn.relu(y)))
    mod = bb.get()
    meshes = [src_mesh] if dst_mesh is src_mesh else [src_mesh, dst_mesh]
    mod.update_global_info("mesh", meshes)
    return mod


MESH_2X2 = DeviceMesh([2, 2], tvm.ir.Range(0, 4))
MOVES = [
    # one mesh: all-to-all then all-gather, and a point-to-point swap, on 2x2
    ("S[2]S[1]", MESH_2X2, "S[0]R", MESH_2X2),
    ("S[0]S[1]", MESH_2X2, "S[1]S[0]", MESH_2X2),
    # between meshes: disjoint stages, and overlapping meshes
    ("S[0]", DeviceMesh([2], tvm.ir.Range(0, 2)), "S[1]", DeviceMesh([2], tvm.ir.Range(2, 4))),
    ("R", DeviceMesh([2], tvm.ir.Range(0, 2)), "RS[2]", MESH_2X2),
    # a local slice along the second mesh axis
    ("RR", MESH_2X2, "RS[1]", MESH_2X2),
]


@pytest.mark.parametrize("src,src_mesh,dst,dst_mesh", MOVES,
                         ids=["alltoall+allgather", "send_recv", "disjoint-stages", "overlap", "local_slice"])
def test_redistributions_on_four_mpi_ranks_equal_numpy(src, src_mesh, dst, dst_mesh):
    exe = td.compile(moved(src, src_mesh, dst, dst_mesh), schedule=False)
    x = np.random.default_rng(8).standard_normal(SHAPE).astype("float32")
    np.testing.assert_array_equal(exe.run(x, backend="mpi"), np.maximum(x, 0))


# ------------------------------------------------------------------ bundles and the CLI
def test_cli_runs_a_bundle_whose_ranks_load_only_their_weight_shards(tensor_parallel, weights,
                                                                     tmp_path):
    x, A, B = weights
    bundle = tensor_parallel.export(tmp_path / "bundle", params={"A": A, "B": B})
    np.save(tmp_path / "x.npy", x)
    assert "`x` float32[128, 128]" in (bundle / "README.md").read_text()
    # the bundle's own launch script, which runs `tvm-distx run BUNDLE -n 2`
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    done = subprocess.run([str(bundle / "run.sh"), "-i", str(tmp_path / "x.npy"),
                           "-o", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    np.testing.assert_allclose(np.load(tmp_path / "out" / "out0.npy"), mlp_twice(x, A, B),
                               rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ failures
def worker_processes() -> list[str]:
    listing = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in listing.splitlines() if "tvm_distx.runtime.mpi_rank" in line
            and "ps -eo" not in line]


def descendants() -> int:
    """How many processes descend from this one (mpiexec, its proxies, the ranks)."""
    parent = parents()
    count = 0
    for pid in parent:
        up = parent.get(pid)
        while up and up != os.getpid():
            up = parent.get(up)
        count += up == os.getpid()
    return count


def leftovers() -> dict:
    """What a run could leave behind: processes, /dev/shm entries, job directories."""
    shm = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    # the sessions' directories (a run is a session called once) and the bundles they use
    jobs = {p for p in os.listdir(tempfile.gettempdir())
            if p.startswith(("tvm-distx-session-", "tvm-distx-run-"))}
    return {"processes": descendants(), "workers": len(worker_processes()),
            "/dev/shm entries": len(shm), "shm": shm, "job dirs": jobs}


def left_since(before: dict) -> dict:
    """What is there now that was not there ``before``: what a run left behind.

    Only additions count: an earlier test's executable may be collected meanwhile, and
    its cached run bundle (a ``tvm-distx-run-`` directory) goes with it.
    """
    now = leftovers()
    return {"processes": max(0, now["processes"] - before["processes"]),
            "workers": max(0, now["workers"] - before["workers"]),
            "shm": now["shm"] - before["shm"], "job dirs": now["job dirs"] - before["job dirs"]}


NOTHING = {"processes": 0, "workers": 0, "shm": set(), "job dirs": set()}


@pytest.fixture
def bundle(tensor_parallel, weights, tmp_path):
    _, A, B = weights
    return tensor_parallel.export(tmp_path / "bundle", params={"A": A, "B": B})


def test_each_rank_times_its_kernels_and_collectives(bundle, weights, tmp_path):
    """``TVM_DISTX_PROFILE``: one table per rank, every kernel and the all-reduces in it."""
    x, A, B = weights
    out = launch(bundle, [x], timeout=60, env={"TVM_DISTX_PROFILE": str(tmp_path / "prof")})
    np.testing.assert_allclose(out, mlp_twice(x, A, B), rtol=1e-5, atol=1e-5)
    for rank in (0, 1):
        times = read_times(tmp_path / "prof" / f"rank{rank}.tsv")
        # the MLP runs twice: each time its row block's partial sum is completed once
        assert times["tvm_distx.ccl.allreduce"][0] == 2, times
        matmuls = {name: v for name, v in times.items() if "matmul" in name}
        assert sum(calls for calls, _ in matmuls.values()) == 4, times
        assert all(seconds > 0 for _, seconds in times.values())


@pytest.fixture(scope="module")
def grid_bundle(weights, tmp_path_factory):
    """The seed on a 2x2 mesh: four ranks."""
    mod = td.load_module(DATA / "seed_mesh2x2.py")
    rule = ShardingRule(callee="mlp", args={0: "S[0]R", 1: "RS[1]", 2: "RS[0]"})
    _, A, B = weights
    return td.compile(AnnotateSharding([rule])(mod)).export(
        tmp_path_factory.mktemp("grid") / "bundle", params={"A": A, "B": B})


@pytest.mark.parametrize("ranks,fault,reason,message", [
    (2, "1:raise", "raised", "rank 1 failed running 'main': .*injected fault on rank 1"),
    (2, "1:kill", "killed", "rank 1 \\(pid \\d+\\) died with status 9 \\(SIGKILL\\)"),
    (2, "0:hang", "timeout", "rank 0 never reached the collective its peers wait in"),
    # mpiexec names whichever process it noticed; the launcher's watcher, the one
    # that died first
    (4, "3:kill", "killed", "rank 3 \\(pid \\d+\\) died"),
    (4, "2:hang", "timeout", "rank 2 never reached the collective its peers wait in"),
], ids=["raise", "kill", "hang", "kill-of-4", "hang-of-4"])
def test_a_failing_rank_stops_the_job_names_the_rank_and_leaves_nothing(
        request, weights, ranks, fault, reason, message):
    target = request.getfixturevalue("bundle" if ranks == 2 else "grid_bundle")
    before = leftovers()
    started = time.monotonic()
    with pytest.raises(td.errors.LaunchError, match=message) as info:
        launch(target, [weights[0]], timeout=15, env={"TVM_DISTX_FAULT": fault})
    elapsed = time.monotonic() - started
    assert info.value.reason == reason
    assert info.value.rank == int(fault[0])
    assert elapsed < 40, f"stopping took {elapsed:.1f} s"
    if reason == "raised":  # the traceback of the failing rank comes along
        assert "Traceback" in info.value.details
    deadline = time.monotonic() + 5  # the kernel reaps the last exits asynchronously
    while left_since(before) != NOTHING and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left_since(before) == NOTHING


def test_a_missing_weight_shard_is_refused_before_any_rank_starts(bundle, weights):
    (bundle / "weights" / "rank1.safetensors").unlink()
    before = leftovers()
    with pytest.raises(td.errors.BundleError, match="weight 'A' of rank 1 .* is missing"):
        launch(bundle, [weights[0]])
    assert left_since(before) == NOTHING
