"""The board executor runs the VM's rank plan with numpy and ctypes only: the seed program,
its failures, and that nothing of it imports TVM."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import tvm

import tvm_distx as td
from tvm_distx import AnnotateSharding, ShardingRule
from tvm_distx.runtime.board.executor import BUILTINS, Executor, Kernels, PlanError, aligned
from tvm_distx.compiler.board_plan import build_board_runtime, lower_for_vm, rank_plan
from tvm_distx.errors import DistxError
from locations import TESTS_DIR



@pytest.fixture(scope="module")
def seed(tmp_path_factory):
    """The seed program's plan, and the VM executable's library exported for it."""
    mod = td.load_module(TESTS_DIR / "data" / "seed_tensor_parallel.py")
    rules = [ShardingRule(param="A", result="S[1]", function="mlp"),
             ShardingRule(param="B", result="S[0]", function="mlp")]
    exe = td.compile(AnnotateSharding(rules)(mod))
    final = lower_for_vm(exe.built, exe.target.target)
    folder = tmp_path_factory.mktemp("board")
    tvm.compile(final, target=exe.target.target, relax_pipeline=None).export_library(
        str(folder / "lib.so"))
    runtime = build_board_runtime(folder)
    plan = json.loads(json.dumps(rank_plan(final)))
    return plan, folder / "lib.so", runtime


@pytest.fixture(scope="module")
def kernels(seed):
    _, library, runtime = seed
    return Kernels(str(library), str(runtime))


@pytest.fixture(scope="module")
def python_kernels(seed, tmp_path_factory):
    """The same kernels with Python hooks: from a copy, since a file is loaded once."""
    import shutil

    _, library, _ = seed
    copy = tmp_path_factory.mktemp("copy") / "lib.so"
    shutil.copy(library, copy)
    return Kernels(str(copy))


def _data(seed: int):
    rng = np.random.default_rng(seed)
    return [0.1 * rng.standard_normal((128, 128), dtype="float32") for _ in range(3)]


def _mlp(x, A, B):
    layer = lambda v: np.maximum(v @ A, 0) @ B  # noqa: E731
    return layer(layer(x))


def _slices(A, B, rank):
    return np.ascontiguousarray(A[:, 64 * rank:64 * (rank + 1)]), B[64 * rank:64 * (rank + 1)]


@pytest.mark.parametrize("runtime", [True, False], ids=["c-runtime", "python-hooks"])
def test_two_ranks_of_the_seed_program_equal_numpy(seed, kernels, python_kernels, runtime):
    plan, _, _ = seed
    library = kernels if runtime else python_kernels
    x, A, B = _data(0)
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
        out[r] = Executor(plan, library, all_reduce(r)).run("main", x, *_slices(A, B, r))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    np.testing.assert_allclose(out[0], _mlp(x, A, B), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out[0], out[1])


def test_a_wrong_input_shape_is_the_executors_error_naming_the_function(seed, kernels):
    plan, _, _ = seed
    x, A, B = _data(0)
    executor = Executor(plan, kernels, lambda name, args: np.copyto(args[-1], args[0]))
    with pytest.raises(PlanError, match=r"function 'main'.*match_shape.*param=x.*dimension 1 "
                       r"is 64, expected 128") as caught:
        executor.run("main", x[:, :64].copy(), *_slices(A, B, 0))
    assert isinstance(caught.value, DistxError) and "hint:" in str(caught.value)
    with pytest.raises(PlanError, match="takes 3 arguments, got 2"):
        executor.run("main", x, A)
    with pytest.raises(PlanError, match=r"check_tensor_info.*param=x.*got float64"):
        executor.run("main", x.astype("float64"), *_slices(A, B, 0))
    with pytest.raises(PlanError, match="no function 'nope'"):
        executor.run("nope")


@pytest.mark.parametrize("runtime", [True, False], ids=["c-runtime", "python-hooks"])
def test_a_failing_kernel_raises_with_its_message_instead_of_ending_the_process(
        seed, kernels, python_kernels, runtime):
    """The kernel reports through TVM's error function, which is not loaded: redirected."""
    plan, _, _ = seed
    library = kernels if runtime else python_kernels
    assert library.reports_errors
    name = next(k for k in plan["kernels"] if k.startswith("matmul"))
    wrong = {"format": plan["format"], "version": plan["version"], "kernels": [name],
             "functions": {"f": {"params": [0, 1, 2], "registers": 4, "result": {"var": 3},
                                 "body": [{"dst": 3, "op": "kernel", "name": name,
                                           "args": [{"var": 0}, {"var": 1}, {"var": 2}]}]}}}
    executor = Executor(wrong, library, None)
    x, w, out = (aligned(np.ones(s, "float32")) for s in ((128, 64), (64, 128), (128, 128)))
    with pytest.raises(PlanError, match=rf"(?s)function 'f', instruction 0 \({name}\): kernel "
                       rf"{name} failed: ValueError: .*shape.*when calling.*{name}\("):
        executor.run("f", x, np.ones((3, 128), "float32"), out)
    with pytest.raises(PlanError, match=rf"(?s)kernel {name} failed: .*dtype"):
        executor.run("f", x, w.astype("int32"), out)
    executor.run("f", x, w, out)  # and it still runs (an aligned argument is not copied)
    np.testing.assert_array_equal(out, np.full((128, 128), 64, "float32"))


def test_unaligned_arguments_are_copied_aligned_for_the_kernels(seed, kernels):
    plan, _, _ = seed
    x, A, B = _data(2)
    block = np.zeros(128 * 128 + 1, "float32")
    shifted = block[1:].reshape(128, 128)  # 4 bytes past an aligned start
    shifted[...] = x
    assert shifted.ctypes.data % 64 != 0 and aligned(shifted).ctypes.data % 64 == 0
    y = Executor(plan, kernels, lambda name, args: np.copyto(args[-1], 2 * args[0])).run(
        "main", shifted, *_slices(A, B, 0))
    columns, rows = _slices(A, B, 0)
    layer = lambda v: 2 * (np.maximum(v @ columns, 0) @ rows)  # noqa: E731
    np.testing.assert_allclose(y, layer(layer(x)), rtol=1e-5, atol=1e-5)


def test_plans_of_another_version_are_refused(seed, kernels):
    plan, _, _ = seed
    with pytest.raises(PlanError, match="version 1"):
        Executor({**plan, "version": 1}, kernels, None)
    bad = json.loads(json.dumps(plan))
    bad["functions"]["main"]["body"][0] = {"dst": 0, "op": "builtin", "name": "vm.builtin.nope",
                                           "args": []}
    with pytest.raises(PlanError, match="vm.builtin.nope is not run"):
        Executor(bad, kernels, None)


def test_every_builtin_the_plan_writer_accepts_is_one_the_executor_runs():
    from tvm_distx.runtime.board import executor

    assert BUILTINS == frozenset(executor._BUILTINS)
    assert {"vm.builtin.match_shape", "vm.builtin.make_shape", "vm.builtin.alloc_shape_heap",
            "vm.builtin.reshape", "vm.builtin.check_tensor_info"} <= BUILTINS


RANK = """
import json, sys
sys.modules["tvm"] = None  # the board has no TVM: importing it must fail
sys.modules["tvm_ffi"] = None
import numpy as np
from mpi4py import MPI
from tvm_distx.runtime.board.executor import Executor, Kernels
from tvm_distx.runtime.collectives import abi_functions
from tvm_distx.runtime.mpi_ccl import MpiCollectives
folder = sys.argv[1]
comm = MPI.COMM_WORLD
r = comm.Get_rank()
data = np.load(folder + "/data.npz")
functions = abi_functions(MpiCollectives(comm))
executor = Executor(json.load(open(folder + "/plan.json")),
                    Kernels(folder + "/lib.so", folder + "/board_runtime.so"),
                    lambda name, args: functions[name](*args))
y = executor.run("main", data["x"], np.ascontiguousarray(data["A"][:, 64 * r:64 * (r + 1)]),
                 np.ascontiguousarray(data["B"][64 * r:64 * (r + 1)]))
np.save(folder + f"/y{r}.npy", y)
"""


def test_two_mpi_ranks_run_the_plan_with_no_tvm_loaded(seed, tmp_path):
    import shutil
    import subprocess
    import sys

    from tvm_distx.runtime.mpi import mpiexec_path

    plan, library, runtime = seed
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    shutil.copy(library, tmp_path / "lib.so")
    shutil.copy(runtime, tmp_path / runtime.name)
    x, A, B = _data(1)
    np.savez(tmp_path / "data.npz", x=x, A=A, B=B)
    (tmp_path / "rank.py").write_text(RANK)
    done = subprocess.run([mpiexec_path(), "-n", "2", sys.executable, str(tmp_path / "rank.py"),
                           str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    for r in range(2):
        np.testing.assert_allclose(np.load(tmp_path / f"y{r}.npy"), _mlp(x, A, B), rtol=1e-5,
                                   atol=1e-5)
