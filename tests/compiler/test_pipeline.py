"""lower_to_ranks(): the whole pipeline in the required order, with stage dumps."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R

import tvm_distx as td
from tvm_distx import ShardingRule
from tvm_distx.legalize.lower_distir import rank_entry
from tvm_distx.passes import AnnotateSharding
from tvm_distx.compiler.pipeline import STAGES
from tvm_distx.runtime import emulate, shard_array
from tvm_distx.runtime.backends import launch
from tvm_distx.layout import TensorSharding
from locations import TESTS_DIR

DATA = TESTS_DIR / "data"


@pytest.fixture(scope="module")
def tensor_parallel():
    mod = td.load_module(DATA / "seed_tensor_parallel.py")
    rules = [ShardingRule(param="A", result="S[1]", function="mlp"),
             ShardingRule(param="B", result="S[0]", function="mlp"),
             # the caller wants the result row-split: a planned redistribute
             ShardingRule(callee="mlp", result="S[0]", function="main")]
    return AnnotateSharding(rules)(mod)


def test_distribute_runs_every_stage_and_the_program_equals_numpy(tensor_parallel, tmp_path):
    ranks = td.lower_to_ranks(tensor_parallel, dump_dir=tmp_path)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["00_input.py"] + [f"{i:02d}_{n}.py" for i, n in enumerate(STAGES, 1)]
    propagated = tvm.script.from_source((tmp_path / "02_propagate_sharding.py").read_text())
    params = propagated["main"].params
    rng = np.random.default_rng(11)
    x, A, B = (0.1 * rng.standard_normal((128, 128), dtype="float32") for _ in range(3))
    shards = [[shard_array(v, TensorSharding.from_type(p.ty), d) for v, p in zip((x, A, B), params)]
              for d in (0, 1)]
    outs = emulate(tvm.compile(ranks, target=tvm.target.Target({"kind": "llvm"})), shards, [0, 1])

    def mlp(v):
        return np.maximum(v @ A, 0) @ B

    want = mlp(mlp(x))
    out_sharding = TensorSharding.from_type(propagated["main"].ty.ret)
    assert str(out_sharding.placement) == "S[0]"
    for device, out in zip((0, 1), outs):
        np.testing.assert_allclose(out, shard_array(want, out_sharding, device), atol=1e-5)


def test_distribute_lowers_the_seed_pipeline_to_one_program_per_stage():
    mod = td.load_module(DATA / "seed_pipeline.py")
    rule = ShardingRule(callee="mlp", args={0: "R"}, meshes=["mesh[0]", "mesh[1]"])
    ranks = td.lower_to_ranks(AnnotateSharding([rule])(mod))
    entries = [rank_entry(ranks, "main", d) for d in (0, 1)]
    assert entries == ["main_rank0", "main_rank1"]
    rng = np.random.default_rng(5)
    x, A, B = (0.1 * rng.standard_normal((128, 128), dtype="float32") for _ in range(3))
    outs = emulate(tvm.compile(ranks, target=tvm.target.Target({"kind": "llvm"})),
                   [[x, A, B], []], [0, 1], entry=entries)

    def mlp(v):
        return np.maximum(v @ A, 0) @ B

    np.testing.assert_allclose(outs[1], mlp(mlp(x)), atol=1e-5)


@I.ir_module
class ReshapeOn2x4:
    """Found by the randomized tests: as legalized, TVM's local view cannot shard it."""

    I.module_attrs({"device_num": 8})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2, 4), I.Range(0, 8))]})

    @R.function
    def main(x: R.Tensor((4, 4), "float32")) -> R.Tensor((4, 2, 2), "float32"):
        with R.dataflow():
            a = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="S[1]S[0]")
            y = R.reshape(a, (4, 2, 2))
            R.output(y)
        return y


def test_a_reshape_whose_loops_tvm_cannot_shard_as_written_lowers_once_simplified(caplog):
    # The legalized index x[((j * 2 + k) // 4 + i) % 4, (j * 2 + k) % 4] mentions i
    # in the column, which is split on the other mesh axis; simplified it is x[i, j * 2 + k].
    with caplog.at_level("INFO", logger="tvm_distx.legalize.local_view"):
        exe = td.compile(ReshapeOn2x4, target="x86")
    assert "retrying with simplified indices in reshape" in caplog.text
    x = np.arange(16, dtype="float32").reshape(4, 4)
    np.testing.assert_array_equal(exe.run(x, backend="emulate"), x.reshape(4, 2, 2))


@I.ir_module
class ArgmaxOfSplitRows:
    I.module_attrs({"device_num": 2})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.Tensor((4, 6), "float32")) -> R.Tensor((4,), "int64"):
        with R.dataflow():
            a = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="S[0]")
            y = R.argmax(a, axis=1)
            R.output(y)
        return y


def test_any_kernel_tvm_cannot_lower_to_the_local_view_is_named():
    """TVM's local view cannot lower an argmax of split rows (its reduction block writes
    two buffers); the error names the kernel, its variable and its operands."""
    with pytest.raises(td.errors.UnsupportedProgramError,
                       match="cannot lower kernel 'argmax' with its operands x S\\[0\\]") as err:
        td.lower_to_ranks(ArgmaxOfSplitRows)
    assert err.value.function == "main" and err.value.var == "y"
    assert "replicate the operands of this kernel" in err.value.hint


def test_a_kernel_whose_loops_tvm_cannot_shard_even_simplified_is_refused_by_name(monkeypatch):
    from tvm_distx.legalize import local_view

    monkeypatch.setattr(local_view, "_simplify_sharded_kernels", lambda mod: (mod, {"reshape"}))
    with pytest.raises(td.errors.UnsupportedProgramError,
                       match="cannot give the loops of kernel 'reshape' one sharding each") as err:
        td.lower_to_ranks(ReshapeOn2x4)
    assert err.value.function == "main" and err.value.var == "y"
    assert "S[1]S[0]" in str(err.value) and err.value.hint


def test_compile_lowers_once_and_keeps_the_local_view_and_writes_its_library_once(
        tensor_parallel, tmp_path, monkeypatch):
    """The executable keeps the ``local_view`` module of its one run of the stages (what
    comm_report reads), and emits its library's machine code at its first export only:
    a second bundle gets a copy of the same bytes, and runs."""
    from tvm_distx.compiler import pipeline
    from tvm_distx.compiler.targets import ResolvedTarget

    runs, run_stages = [], pipeline.run_stages
    monkeypatch.setattr(pipeline, "run_stages",
                        lambda mod, **kw: runs.append(mod) or run_stages(mod, **kw))
    exe = td.compile(tensor_parallel)
    assert runs == [tensor_parallel]
    expected = run_stages(tensor_parallel)["local_view"]
    tvm.ir.assert_structural_equal(exe.local_view, expected)
    assert td.comm_report(exe.local_view).rows == td.comm_report(expected).rows

    written, export_library = [], ResolvedTarget.export_library
    monkeypatch.setattr(ResolvedTarget, "export_library",
                        lambda self, vm, path: written.append(path) or
                        export_library(self, vm, path))
    rng = np.random.default_rng(5)
    x, A, B = (0.1 * rng.standard_normal((128, 128), dtype="float32") for _ in range(3))
    first = exe.export(tmp_path / "first", params={"A": A, "B": B})
    second = exe.export(tmp_path / "second", params={"A": A, "B": B})
    assert written == [first / "lib.so"]
    assert (second / "lib.so").read_bytes() == (first / "lib.so").read_bytes()

    def mlp(v):
        return np.maximum(v @ A, 0) @ B

    np.testing.assert_allclose(launch(second, [x], backend="emulate"),  # its own weights
                               mlp(mlp(x)), atol=1e-5)
