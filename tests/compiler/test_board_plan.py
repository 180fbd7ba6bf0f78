"""Rank plans: the VM's own per-rank Relax program, written as data; and what is refused."""

from __future__ import annotations

import base64
import json
import tempfile

import numpy as np
import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

import tvm_distx as td
from tvm_distx import AnnotateSharding, ShardingRule
from tvm_distx.compiler.board_plan import INLINE_ELEMENTS, board_runtime, lower_for_vm, rank_plan
from tvm_distx.errors import CompilerStageError
from locations import TESTS_DIR

TARGET = tvm.target.Target("llvm")


@pytest.fixture(scope="module")
def plan():
    mod = td.load_module(TESTS_DIR / "data" / "seed_tensor_parallel.py")
    rules = [ShardingRule(param="A", result="S[1]", function="mlp"),
             ShardingRule(param="B", result="S[0]", function="mlp")]
    exe = td.compile(AnnotateSharding(rules)(mod))
    return rank_plan(lower_for_vm(exe.built, exe.target.target))


def test_the_plan_of_the_seed_program_is_its_kernels_calls_and_one_all_reduce(plan):
    assert json.loads(json.dumps(plan)) == plan  # plain data
    assert plan["version"] == 2 and plan["constants"] == []
    mlp = plan["functions"]["mlp"]
    calls = [(i["op"], i.get("name")) for i in mlp["body"]
             if i["op"] in ("kernel", "call", "builtin") and "check" not in i.get("name", "")
             and "match_shape" not in i.get("name", "")]
    assert calls == [("kernel", "fused_matmul1_relu1"), ("kernel", "matmul2"),
                     ("builtin", "tvm_distx.ccl.allreduce")]
    assert [i["name"] for i in plan["functions"]["main"]["body"] if i["op"] == "call"] == [
        "mlp", "mlp"]
    sizes = [i["args"][0]["shape"] for i in mlp["body"] if i["op"] == "alloc_storage"]
    assert sizes == [[32768], [65536], [65536]]  # bytes: (128, 64) and twice (128, 128) float32
    assert set(plan["kernels"]) == {"fused_matmul1_relu1", "matmul2"}


def _final(mod: tvm.IRModule) -> tvm.IRModule:
    return lower_for_vm(mod, TARGET)


def test_symbolic_extents_constants_and_tuples_are_written():
    @I.ir_module
    class Module:
        @R.function
        def main(x: R.Tensor(("n", 4), "float32"), y: R.Tensor(("n",), "int64")):
            n = T.int64()
            big = R.const(np.arange(40, dtype="float32").reshape(10, 4))
            small = R.const(3, "int64")
            a = R.add(x, R.const(np.ones(4, "float32")))
            b = R.reshape(a, (n * 4,))
            c = R.add(y, small)
            d = R.matmul(big, R.permute_dims(x))
            return (b, c, d)

    written = rank_plan(_final(Module))
    main = written["functions"]["main"]
    names = {i.get("name") for i in main["body"]}
    assert {"vm.builtin.alloc_shape_heap", "vm.builtin.match_shape",
            "vm.builtin.make_shape"} <= names
    consts = written["constants"]
    inline = [c for c in consts if "values" in c]
    encoded = [c for c in consts if "data" in c]
    assert {"dtype": "int64", "shape": [], "values": [3]} in inline
    assert {"dtype": "float32", "shape": [4], "values": [1.0] * 4} in inline
    assert len(encoded) == 1 and encoded[0]["shape"] == [10, 4] and 40 > INLINE_ELEMENTS
    data = np.frombuffer(base64.b64decode(encoded[0]["data"]), "float32").reshape(10, 4)
    np.testing.assert_array_equal(data, np.arange(40).reshape(10, 4))
    assert next(iter(main["result"])) in ("var", "tuple")


def _refused(mod: tvm.IRModule, *words: str) -> str:
    with pytest.raises(CompilerStageError) as caught:
        rank_plan(_final(mod))
    text = str(caught.value)
    assert "stage 'board plan'" in text and "function 'main'" in text and "hint:" in text
    for word in words:
        assert word in text
    return text


def test_an_unknown_packed_function_is_refused_by_name():
    @I.ir_module
    class Module:
        @R.function
        def main(x: R.Tensor((4,), "float32")):
            R.func_attr({"relax.force_pure": True})
            y = R.call_packed("my.custom.function", x, ty_args=(R.Tensor((4,), "float32"),))
            return y

    _refused(Module, "packed function my.custom.function")


def test_control_flow_is_refused():
    @I.ir_module
    class Module:
        @R.function
        def main(x: R.Tensor((4,), "float32"), flag: R.Tensor((), "bool")):
            if flag:
                y = R.add(x, x)
            else:
                y = R.multiply(x, x)
            return y

    _refused(Module, "If")


def test_every_tir_function_after_the_vm_pipeline_is_noalias():
    """A shape function added last would strip ``noalias`` from every kernel's compute code.

    TVM's LLVM code generator gives each outlined compute function the no-alias flag of
    the last function added; ``lower_for_vm`` marks the one-buffer shape functions, so the
    kernels keep theirs (a run-time-row matmul kept its register tile in memory, 2x slower).
    """
    from tvm import relax, tirx

    from tvm_distx.compiler.pipeline import legalize_ops
    from tvm_distx.compiler.schedule import ScheduleCPU, fuse_kernels, x86_target

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((tirx.Var("n", "int64"), 64), "float32"))
    w = relax.Var("w", relax.TensorType((128, 64), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.matmul(x, relax.op.permute_dims(w)))
        bb.emit_func_output(out)
    target = x86_target(1)
    final = lower_for_vm(ScheduleCPU(target)(fuse_kernels(legalize_ops(bb.get()))), target)
    kernels = {gv.name_hint: f for gv, f in final.functions.items()
               if isinstance(f, tvm.tirx.PrimFunc)}
    assert any(f.attrs.get("tirx.is_host_func") for f in kernels.values())  # a shape function
    assert all(bool(f.attrs.get("tirx.noalias", False)) for f in kernels.values()), kernels
    lib = tvm.compile(final, target=target, relax_pipeline=None)
    assert "noalias" in lib.mod.inspect_source("ll") if not lib.mod.imports else \
        "noalias" in lib.mod.imports[0].inspect_source("ll")


def test_the_board_runtime_is_built_as_bytes_and_leaves_no_temporary_folder(tmp_path,
                                                                            monkeypatch):
    """A process killed after its first export leaves nothing in TMPDIR: the runtime library
    is read into memory and its build folder removed at once (not at exit)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    library = board_runtime.__wrapped__("gcc")  # not the process's cached copy
    assert library[:4] == b"\x7fELF" and len(library) > 1000
    assert list(tmp.iterdir()) == []
