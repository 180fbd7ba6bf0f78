"""The board backend on this machine: MPI ranks that run the bundle's plan, with no TVM.

``backend="board"`` runs each rank's program from ``plan.json`` (the VM's own program as data)
with numpy and ctypes; ``python -m tvm_distx.runtime.board run|generate`` is what a board's ``run.sh``
calls, here with MPICH's ``mpiexec``. Both must give what the VM gives, and every failure must
be one line.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tvm_distx as td
from tvm_distx import ShardingRule
from tvm_distx.runtime.board.payload import runtime_modules, write_board_runtime
from tvm_distx.passes import AnnotateSharding
from tvm_distx.runtime.mpi import mpiexec_path

from locations import TESTS_DIR
from reference import mlp_twice

RULES = [ShardingRule(param="A", result="S[1]", function="mlp"),
         ShardingRule(param="B", result="S[0]", function="mlp")]


@pytest.fixture(scope="module")
def seed():
    """The seed tensor-parallel program, its weights and input, and its numpy answer."""
    exe = td.compile(AnnotateSharding(RULES)(td.load_module(TESTS_DIR / "data" /
                                                             "seed_tensor_parallel.py")))
    rng = np.random.default_rng(5)
    x, A, B = (0.1 * rng.standard_normal((128, 128), dtype="float32") for _ in range(3))
    return exe, x, {"A": A, "B": B}, mlp_twice(x, A, B)


def test_board_ranks_equal_the_vm_and_numpy(seed):
    exe, x, weights, expected = seed
    assert exe.plan is not None and exe.plan_refusal is None
    board = exe.run(x, params=weights, backend="board")
    np.testing.assert_allclose(board, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(board, exe.run(x, params=weights, backend="mpi"))


@pytest.fixture
def bundle(seed, tmp_path):
    exe, x, weights, _ = seed
    np.save(tmp_path / "x.npy", x)
    return exe.export(tmp_path / "bundle", params=weights)


def _board(*argv: str, cwd: Path, path: Path | None = None) -> subprocess.CompletedProcess:
    """``python -m tvm_distx.runtime.board ARGV`` with this environment's mpiexec (MPICH's); ``path``
    goes first on the ranks' PYTHONPATH."""
    env = {**os.environ, "PATH": f"{Path(mpiexec_path()).parent}:{os.environ['PATH']}"}
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(path), *filter(None, [
            os.environ.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, "-m", "tvm_distx.runtime.board", *argv], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=300)


def test_the_board_command_runs_a_bundle_with_its_own_mpiexec(seed, bundle, tmp_path):
    done = _board("run", str(bundle), "-i", "x.npy", "-o", "out", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    np.testing.assert_allclose(np.load(tmp_path / "out" / "out0.npy"), seed[3], rtol=1e-5,
                               atol=1e-5)


def _one_line(done: subprocess.CompletedProcess, *words: str) -> None:
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert lines[0].startswith("error: ") and "Traceback" not in done.stderr, done.stderr
    assert len(lines) <= 2 and all(w in lines[0] for w in words), done.stderr


def test_board_errors_are_one_line(bundle, tmp_path):
    # a rank's weight file missing: refused before any rank starts
    (bundle / "weights" / "rank1.safetensors").rename(tmp_path / "moved")
    _one_line(_board("run", str(bundle), "-i", "x.npy", "-o", "out", cwd=tmp_path),
              "rank 1", "missing")
    (tmp_path / "moved").rename(bundle / "weights" / "rank1.safetensors")
    # no input: refused by rank 0 before any call, the ranks closed
    _one_line(_board("run", str(bundle), "-o", "out", cwd=tmp_path), "takes 1", "(x)")
    # not a generation bundle
    _one_line(_board("generate", str(bundle), "--ids", "1", "2", cwd=tmp_path),
              "not a generation bundle")
    # a job of the wrong size, as a user's own mpiexec would start it
    done = subprocess.run([mpiexec_path(), "-n", "1", sys.executable, "-m", "tvm_distx.runtime.board",
                           "job", "run", str(bundle), "-i", str(tmp_path / "x.npy"), "-o",
                           str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "the bundle needs 2 ranks, and this MPI job has 1" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("numpy_has_bfloat16", [True, False], ids=["ml_dtypes", "bits"])
def test_a_bfloat16_program_runs_on_the_board_command(tmp_path, numpy_has_bfloat16):
    """bfloat16 weights on the board's ranks; a board's numpy has no bfloat16 (no ml_dtypes):
    the ranks then hold them as 16-bit patterns that the kernels read as they are."""
    mod = AnnotateSharding(RULES)(td.load_module(TESTS_DIR / "data" / "seed_tensor_parallel.py"))
    rng = np.random.default_rng(6)
    weights = {n: 0.1 * rng.standard_normal((128, 128), dtype="float32") for n in "AB"}
    stored, stored_weights = td.quantize(mod, weights, "bf16")
    exe = td.compile(stored)
    assert exe.plan is not None and exe.plan_refusal is None
    bundle = exe.export(tmp_path / "bundle", params=stored_weights)
    x = rng.standard_normal((128, 128), dtype="float32")
    np.save(tmp_path / "x.npy", x)
    if not numpy_has_bfloat16:  # an ml_dtypes that cannot be imported, as on a board
        (tmp_path / "stub").mkdir()
        (tmp_path / "stub" / "ml_dtypes.py").write_text("raise ImportError('not on a board')\n")
    done = _board("run", str(bundle), "-i", "x.npy", "-o", "out", cwd=tmp_path,
                  path=None if numpy_has_bfloat16 else tmp_path / "stub")
    assert done.returncode == 0, done.stderr
    decoded = {n: np.asarray(stored_weights[n]).astype("float32") for n in "AB"}
    np.testing.assert_allclose(np.load(tmp_path / "out" / "out0.npy"),
                               mlp_twice(x, decoded["A"], decoded["B"]), rtol=1e-4, atol=1e-4)


def test_a_library_for_another_cpu_is_one_line(bundle, tmp_path):
    manifest = bundle / "manifest.json"
    text = manifest.read_text()
    lib = bundle / "lib.so"
    header = bytearray(lib.read_bytes())
    header[18:20] = (243).to_bytes(2, "little")  # EM_RISCV
    lib.write_bytes(bytes(header))
    data = json.loads(text)
    data["library_sha256"] = hashlib.sha256(bytes(header)).hexdigest()
    manifest.write_text(json.dumps(data))
    _one_line(_board("run", str(bundle), "-i", "x.npy", "-o", "out", cwd=tmp_path),
              "built for riscv64", "this host is x86_64")


def _python3(folder: Path, *flags: str) -> dict:
    """An environment whose ``python3`` is this one (with ``flags``), as a board has it."""
    folder.mkdir(exist_ok=True)
    wrapper = folder / "python3"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {' '.join(flags)} \"$@\"\n")
    wrapper.chmod(0o755)
    return {**os.environ, "PATH": f"{folder}:{Path(mpiexec_path()).parent}:"
            f"{os.environ['PATH']}"}


def test_a_board_run_sh_runs_with_its_own_modules_and_needs_numpy(seed, bundle, tmp_path):
    write_board_runtime(bundle, 2, "rvv")  # what an RVV bundle holds, here for this CPU
    run = [str(bundle / "run.sh"), "run", "-i", "x.npy", "-o", "out"]
    done = subprocess.run(run, capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env=_python3(tmp_path / "bin"))
    assert done.returncode == 0, done.stderr
    np.testing.assert_allclose(np.load(tmp_path / "out" / "out0.npy"), seed[3], rtol=1e-5,
                               atol=1e-5)
    # a python3 without site-packages: no numpy, one line and a hint
    done = subprocess.run(run, capture_output=True, text=True, cwd=tmp_path, timeout=60,
                          env=_python3(tmp_path / "bare", "-S"))
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "error: this machine has no numpy for python3",
        "hint: apt install python3-numpy (a board needs python3-numpy, python3-mpi4py and "
        "openmpi-bin)"]


def test_the_boards_runtime_imports_no_tvm():
    """Every module a board runs is found from its entry by reading imports; none imports TVM
    at its top, and the board's own modules import it nowhere."""
    modules = runtime_modules()  # refuses a module that imports TVM at its top
    assert {"tvm_distx.runtime.board.job", "tvm_distx.runtime.board.executor", "tvm_distx.runtime.mpi_rank",
            "tvm_distx.generation.generator", "tvm_distx.bundle.manifest"} <= set(modules)
    assert not any(m.startswith(("tvm_distx.compiler", "tvm_distx.passes", "tvm_distx.legalize",
                                 "tvm_distx.frontend", "tvm_distx.llm")) for m in modules)
    for module in modules:
        if not module.startswith("tvm_distx.runtime.board"):
            continue
        path = importlib.util.find_spec(module).origin
        for node in ast.walk(ast.parse(Path(path).read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] in ("tvm", "tvm_ffi") for n in names), module
