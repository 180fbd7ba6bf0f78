"""Kernels built and emitted on every core (tvm_distx.compiler.parallel_build).

A module's kernels are dealt into one LLVM module per thread; the executable must
find every kernel (its results equal numpy's, in the VM and from the exported
library), and one job gives TVM's own single-module build back.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import relax as R

from tvm_distx.compiler import parallel_build
from tvm_distx.compiler.board_plan import lower_for_vm
from tvm_distx.compiler.schedule import x86_target

TARGET = x86_target(2)


@tvm.script.ir_module
class Chain:
    @R.function
    def main(x: R.Tensor((8, 16), "float32"), w: R.Tensor((16, 16), "float32")):
        with R.dataflow():
            a = R.matmul(x, w)
            b = R.nn.relu(a)
            c = R.exp(b)
            d = R.add(c, x)
            e = R.multiply(d, d)
            f = R.sum(e, axis=[1])
            R.output(f)
        return f


def _final() -> tvm.IRModule:
    legalized = relax.transform.LegalizeOps()(Chain)
    return lower_for_vm(legalized, TARGET)


def _expected(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    d = np.exp(np.maximum(x @ w, 0)) + x
    return (d * d).sum(axis=1)


def _run(executable, x, w) -> np.ndarray:
    vm = relax.VirtualMachine(executable, tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w)).numpy()


@pytest.fixture
def two_jobs(monkeypatch):
    """Every kernel count makes two groups (this module has only a few kernels)."""
    monkeypatch.setattr(parallel_build, "MIN_KERNELS_PER_JOB", 1)
    monkeypatch.setattr(parallel_build.os, "sched_getaffinity", lambda _pid: {0, 1})
    monkeypatch.delenv(parallel_build.ENVIRONMENT, raising=False)


def test_kernels_dealt_into_two_llvm_modules_run_as_one_library(two_jobs, tmp_path):
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((8, 16), dtype=np.float32), \
        rng.standard_normal((16, 16), dtype=np.float32) * 0.1
    executable = parallel_build.build_vm(_final(), TARGET)
    modules = executable.mod._collect_dso_modules()
    assert [m.kind for m in modules] == ["llvm", "llvm"]
    np.testing.assert_allclose(_run(executable, x, w), _expected(x, w), rtol=1e-5)

    path = tmp_path / "lib.so"
    parallel_build.export_library(executable, str(path))
    loaded = tvm.runtime.load_module(str(path))
    np.testing.assert_allclose(_run(loaded, x, w), _expected(x, w), rtol=1e-5)


def test_one_job_is_tvms_own_build(two_jobs, monkeypatch):
    monkeypatch.setenv(parallel_build.ENVIRONMENT, "1")
    executable = parallel_build.build_vm(_final(), TARGET)
    assert [m.kind for m in executable.mod._collect_dso_modules()] == ["llvm"]


def test_the_groups_hold_every_kernel_once_and_are_the_same_every_time(two_jobs):
    final = _final()
    kernels = {gv: f for gv, f in final.functions.items() if isinstance(f, tvm.tirx.PrimFunc)}
    groups = parallel_build._groups(kernels, 2)
    names = [sorted(gv.name_hint for gv in group) for group in groups]
    assert sorted(n for group in names for n in group) == sorted(g.name_hint for g in kernels)
    assert len(groups) == 2 and all(groups)
    assert names == [sorted(gv.name_hint for gv in group)
                     for group in parallel_build._groups(kernels, 2)]


def test_jobs_follow_the_cores_the_kernels_and_the_environment(monkeypatch):
    monkeypatch.setattr(parallel_build.os, "sched_getaffinity", lambda _pid: set(range(4)))
    monkeypatch.delenv(parallel_build.ENVIRONMENT, raising=False)
    per_job = parallel_build.MIN_KERNELS_PER_JOB
    assert parallel_build.build_jobs(100 * per_job) == 4
    assert parallel_build.build_jobs(2 * per_job) == 2
    assert parallel_build.build_jobs(per_job - 1) == 1
    monkeypatch.setenv(parallel_build.ENVIRONMENT, "3")
    assert parallel_build.build_jobs(100 * per_job) == 3
    monkeypatch.setenv(parallel_build.ENVIRONMENT, "not a number")
    assert parallel_build.build_jobs(100 * per_job) == 4
