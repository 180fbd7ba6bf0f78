"""The board executor (prototype, issue 31) runs the VM's rank plan with numpy and ctypes only."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import tvm

import tvm_distx as td
from tvm_distx import AnnotateSharding, ShardingRule
from tvm_distx.board.executor import Executor, Kernels
from tvm_distx.build.board_plan import lower_for_vm, rank_plan
from locations import TESTS_DIR


@pytest.fixture(scope="module")
def seed(tmp_path_factory):
    mod = td.load_module(TESTS_DIR / "data" / "seed_tensor_parallel.py")
    rules = [ShardingRule(param="A", result="S[1]", function="mlp"),
             ShardingRule(param="B", result="S[0]", function="mlp")]
    exe = td.compile(AnnotateSharding(rules)(mod))
    final = lower_for_vm(exe.built, tvm.target.Target("llvm"))
    prims = tvm.IRModule({gv: f for gv, f in final.functions.items()
                          if isinstance(f, tvm.tirx.PrimFunc)})
    path = tmp_path_factory.mktemp("board") / "kernels.so"
    tvm.tirx.build(prims, target=tvm.target.Target("llvm")).export_library(str(path))
    return rank_plan(final), Kernels(str(path))


def test_two_ranks_of_the_seed_program_equal_numpy(seed):
    plan, kernels = seed
    rng = np.random.default_rng(0)
    x, A, B = (0.1 * rng.standard_normal((128, 128), dtype="float32") for _ in range(3))
    barrier, slots, out = threading.Barrier(2), [None, None], [None, None]

    def all_reduce(rank):
        def call(name, args):
            assert name == "tvm_distx.ccl.allreduce"
            source, _kind, _group, destination = args
            slots[rank] = source.copy()
            barrier.wait()
            destination[...] = slots[0] + slots[1]
            barrier.wait()
        return call

    def rank(r):
        columns, rows = np.ascontiguousarray(A[:, 64 * r:64 * (r + 1)]), B[64 * r:64 * (r + 1)]
        out[r] = Executor(plan, kernels, all_reduce(r)).run("main", x, columns, rows)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    mlp = lambda v: np.maximum(v @ A, 0) @ B  # noqa: E731
    np.testing.assert_allclose(out[0], mlp(mlp(x)), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out[0], out[1])


RANK = """
import json, sys
sys.modules["tvm"] = None  # the board has no TVM: importing it must fail
sys.modules["tvm_ffi"] = None
import numpy as np
from mpi4py import MPI
from tvm_distx.board.executor import Executor, Kernels
from tvm_distx.runtime.collectives import abi_functions
from tvm_distx.runtime.mpi_ccl import MpiCollectives
folder = sys.argv[1]
comm = MPI.COMM_WORLD
r = comm.Get_rank()
data = np.load(folder + "/data.npz")
functions = abi_functions(MpiCollectives(comm))
executor = Executor(json.load(open(folder + "/plan.json")), Kernels(folder + "/kernels.so"),
                    lambda name, args: functions[name](*args))
y = executor.run("main", data["x"], np.ascontiguousarray(data["A"][:, 64 * r:64 * (r + 1)]),
                 np.ascontiguousarray(data["B"][64 * r:64 * (r + 1)]))
np.save(folder + f"/y{r}.npy", y)
"""


def test_two_mpi_ranks_run_the_plan_with_no_tvm_loaded(seed, tmp_path):
    import json
    import subprocess
    import sys

    from tvm_distx.runtime.mpi import mpiexec_path

    plan, kernels = seed
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    (tmp_path / "kernels.so").write_bytes(open(kernels.lib._name, "rb").read())
    rng = np.random.default_rng(1)
    x, A, B = (0.1 * rng.standard_normal((128, 128), dtype="float32") for _ in range(3))
    np.savez(tmp_path / "data.npz", x=x, A=A, B=B)
    (tmp_path / "rank.py").write_text(RANK)
    done = subprocess.run([mpiexec_path(), "-n", "2", sys.executable, str(tmp_path / "rank.py"),
                           str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    mlp = lambda v: np.maximum(v @ A, 0) @ B  # noqa: E731
    for r in range(2):
        np.testing.assert_allclose(np.load(tmp_path / f"y{r}.npy"), mlp(mlp(x)), rtol=1e-5,
                                   atol=1e-5)
