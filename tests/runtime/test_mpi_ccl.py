"""The MPI backend of the ``tvm_distx.ccl.*`` functions, on real ranks under ``mpiexec``.

Two kinds of run, each a subprocess of the venv's ``mpiexec`` with a timeout:

* ``tests/mpi/ccl_worker.py`` calls every registered function directly on TVM
  tensors and compares with numpy (collectives on 1-D and 2x2 meshes along
  each axis, send/recv within a mesh and between meshes, TVM's disco
  builtins, and the errors of a rank that is not in a group);
* ``tests/mpi/run_programs.py`` runs compiled programs in a
  ``relax.VirtualMachine`` per rank: ours (``td.lower_to_ranks``: tensor
  parallelism, and two pipeline stages) and one lowered by TVM's own
  ``LowerDistIR`` (which calls ``runtime.disco.*``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import tvm_distx as td
from tvm_distx import ShardingRule
from tvm_distx.legalize.lower_distir import rank_entry
from tvm_distx.passes import AnnotateSharding
from tvm_distx.runtime import shard_array
from tvm_distx.layout import TensorSharding
from locations import TESTS_DIR

HERE = TESTS_DIR
MPIEXEC = Path(sys.executable).parent / "mpiexec"
TARGET = tvm.target.Target({"kind": "llvm"})

pytestmark = pytest.mark.skipif(not MPIEXEC.exists(), reason=f"no mpiexec at {MPIEXEC}")


def mpirun(ranks: int, script: str, *args: str, timeout: float = 120) -> str:
    """Run ``tests/mpi/<script>`` on ``ranks`` ranks; its output, or a failure that shows it."""
    env = dict(os.environ, TVM_NUM_THREADS="1")  # the ranks share the machine's cores
    cmd = [str(MPIEXEC), "-n", str(ranks), sys.executable, str(HERE / "mpi" / script), *args]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{script} on {ranks} ranks did not finish in {timeout} s:\n{err.stdout}"
                    f"\n{err.stderr}")
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{script} on {ranks} ranks exited {done.returncode}:\n{output}"
    return output


@pytest.mark.parametrize("ranks", [2, 4])
def test_every_function_equals_numpy_on_mpi_ranks(ranks):
    output = mpirun(ranks, "ccl_worker.py")
    assert f"cases on {ranks} ranks" in output and "MPI-CCL OK" in output, output


# ---------------------------------------------------------------------- compiled programs
@I.ir_module
class TvmTensorParallel:
    """Megatron-style MLP for TVM's own DistIR passes (1-D mesh, inputs from worker 0)."""

    I.module_attrs({"device_num": 2})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.Tensor((32, 64), "float32"), A: R.Tensor((64, 64), "float32"),
             B: R.Tensor((64, 32), "float32")) -> R.Tensor((32, 32), "float32"):
        with R.dataflow():
            A1 = R.dist.annotate_sharding(A, device_mesh="mesh[0]", placement="S[1]")
            B1 = R.dist.annotate_sharding(B, device_mesh="mesh[0]", placement="S[0]")
            h = R.nn.relu(R.matmul(x, A1))
            y = R.matmul(h, B1)
            R.output(y)
        return y


def tvm_lowered(mod: tvm.IRModule) -> tvm.IRModule:
    """TVM's DistIR pipeline, in the order that gives right numbers (see the notes)."""
    dist = relax.distributed.transform
    for stage in (relax.transform.LegalizeOps(), dist.PropagateSharding(),
                  dist.LowerGlobalViewToLocalView(), dist.LegalizeRedistribute(),
                  dist.LowerDistIR(), relax.transform.LegalizeOps()):
        mod = stage(mod)
    return mod


def mlp(x, A, B):
    return np.maximum(x @ A, 0) @ B


def save_program(folder: Path, name: str, mod: tvm.IRModule, entries, inputs, wants) -> dict:
    """Compile ``mod`` into ``folder`` with every rank's inputs and expected result."""
    tvm.compile(mod, target=TARGET).export_library(folder / f"{name}.so")
    for rank, (args, want) in enumerate(zip(inputs, wants)):
        np.savez(folder / f"{name}.rank{rank}.in.npz", **{f"arg{i}": a for i, a in enumerate(args)})
        if want is not None:
            np.save(folder / f"{name}.rank{rank}.want.npy", want)
    return {"name": name, "library": f"{name}.so", "entries": entries}


def test_compiled_programs_run_on_two_mpi_ranks(tmp_path):
    rng = np.random.default_rng(11)
    programs = []

    # ours: td.lower_to_ranks of the seed, with the result redistributed to S[0]
    rules = [ShardingRule(param="A", result="S[1]", function="mlp"),
             ShardingRule(param="B", result="S[0]", function="mlp"),
             ShardingRule(callee="mlp", result="S[0]", function="main")]
    seed = td.load_module(HERE / "data" / "seed_tensor_parallel.py")
    ranks = td.lower_to_ranks(AnnotateSharding(rules)(seed), dump_dir=tmp_path / "stages")
    propagated = tvm.script.from_source(
        (tmp_path / "stages" / "02_propagate_sharding.py").read_text())["main"]
    x, A, B = (0.1 * rng.standard_normal((128, 128), dtype="float32") for _ in range(3))
    want = mlp(mlp(x, A, B), A, B)
    out = TensorSharding.from_type(propagated.ty.ret)
    shardings = [TensorSharding.from_type(p.ty) for p in propagated.params]
    programs.append(save_program(
        tmp_path, "distribute", ranks, [rank_entry(ranks, "main", d) for d in (0, 1)],
        [[shard_array(v, s, d) for v, s in zip((x, A, B), shardings)] for d in (0, 1)],
        [shard_array(want, out, d) for d in (0, 1)]))

    # two pipeline stages: rank 0 sends (an impure call without output), rank 1 receives
    rule = ShardingRule(callee="mlp", args={0: "R"}, meshes=["mesh[0]", "mesh[1]"])
    ranks = td.lower_to_ranks(AnnotateSharding([rule])(td.load_module(HERE / "data" /
                                                                  "seed_pipeline.py")))
    programs.append(save_program(tmp_path, "pipeline", ranks,
                                 [rank_entry(ranks, "main", d) for d in (0, 1)],
                                 [[x, A, B], []], [None, want]))

    # TVM's LowerDistIR: broadcast and scatter from worker 0, then runtime.disco.allreduce
    x, A, B = (0.1 * rng.standard_normal(s, dtype="float32") for s in ((32, 64), (64, 64),
                                                                        (64, 32)))
    programs.append(save_program(tmp_path, "tvm_lower_distir", tvm_lowered(TvmTensorParallel),
                                 ["main", "main"], [[x, A, B]] * 2, [mlp(x, A, B)] * 2))

    (tmp_path / "programs.json").write_text(json.dumps(programs))
    output = mpirun(2, "run_programs.py", str(tmp_path))
    assert "PROGRAMS OK 3" in output, output
