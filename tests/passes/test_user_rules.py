"""Rules declared as strings: :mod:`tvm_distx.passes.einsum` and ``td.register_sharding_rule``.

The user's kernel here is a matmul written as plain loops (no blocks), which
:mod:`tvm_distx.passes.tir_access` cannot read: without a rule it runs
replicated; with ``"mk,kn->mn"`` it is split, and runs on two MPI ranks equal to
numpy, row-split and with its summed axis split (a partial sum).
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T
from tvm import relax
from tvm.relax.distributed import DeviceMesh
from tvm.relax.distributed import Placement as TvmPlacement
from tvm.relax.op.distributed import annotate_sharding

import tvm_distx as td
from locations import TESTS_DIR
from signature_tools import bindings, expect, sig_of
from tvm_distx.errors import RuleError, UnsupportedProgramError
from tvm_distx.layout import TensorSharding
from tvm_distx.passes import PropagateSharding, op_signatures, user_rules
from tvm_distx.passes.einsum import einsum, parse_einsum
from tvm_distx.passes.tir_access import prim_func_signature
from test_relax_op_rules import Matmuls, Reductions


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    """Each test registers its rules in copies of the registries, dropped afterwards."""
    monkeypatch.setattr(op_signatures, "_RULES", dict(op_signatures._RULES))
    monkeypatch.setattr(op_signatures, "_KERNEL_RULES", dict(op_signatures._KERNEL_RULES))
    monkeypatch.setattr(user_rules, "_SPECS", dict(user_rules._SPECS))


def loop_matmul_module(x_placement: str, w_placement: str) -> tvm.IRModule:
    """``y = x @ w`` by a kernel of plain loops, over symbolic extents, then ``relu``."""

    @I.ir_module
    class LoopMatmul:
        I.module_attrs({"device_num": 2})
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @T.prim_func
        def loop_matmul(a: T.handle, b: T.handle, c: T.handle):
            m, k, n = T.int64(), T.int64(), T.int64()
            A = T.match_buffer(a, (m, k), "float32")
            B = T.match_buffer(b, (k, n), "float32")
            C = T.match_buffer(c, (m, n), "float32")
            for i, j in T.grid(m, n):
                C[i, j] = T.float32(0)
                for kk in range(k):
                    C[i, j] = C[i, j] + A[i, kk] * B[kk, j]

        @R.function
        def main(x: R.Tensor((16, 12), "float32"), w: R.Tensor((12, 8), "float32")):
            cls = LoopMatmul
            with R.dataflow():
                xs = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement=x_placement)
                ws = R.dist.annotate_sharding(w, device_mesh="mesh[0]", placement=w_placement)
                y = R.call_tir(cls.loop_matmul, (xs, ws), out_ty=R.Tensor((16, 8), "float32"))
                R.output(y)
            return y

    return LoopMatmul


@I.ir_module
class RowSplitPropagated:
    I.module_attrs({"device_num": 2})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @T.prim_func
    def loop_matmul(a: T.handle, b: T.handle, c: T.handle):
        T.func_attr({"tvm_distx.sharding_rule": "mk,kn->mn"})
        m, k, n = T.int64(), T.int64(), T.int64()
        A = T.match_buffer(a, (m, k), "float32")
        B = T.match_buffer(b, (k, n), "float32")
        C = T.match_buffer(c, (m, n), "float32")
        for i, j in T.grid(m, n):
            C[i, j] = T.float32(0)
            for kk in range(k):
                C[i, j] = C[i, j] + A[i, kk] * B[kk, j]

    @R.function
    def main(x: R.dist.DTensor((16, 12), "float32", "mesh[0]", "S[0]"),
             w: R.dist.DTensor((12, 8), "float32", "mesh[0]", "R"),
             ) -> R.dist.DTensor((16, 8), "float32", "mesh[0]", "S[0]"):
        cls = RowSplitPropagated
        with R.dataflow():
            y = R.dist.call_tir(cls.loop_matmul, (x, w),
                                out_ty=R.dist.DTensor((16, 8), "float32", "mesh[0]", "S[0]"))
            R.output(y)
        return y


def _placement(value) -> str:
    return str(TensorSharding.from_type(value.ty).placement)


# --------------------------------------------------------------------------- the syntax
@pytest.mark.parametrize("text, fault", [
    ("mk,kn", "exactly one '->'"),
    ("mk->m->k", "exactly one '->'"),
    ("mk,kn->mx", "'x' is in no operand"),
    ("mkk->mk", "appears twice"),
    ("m...k->mk", "may only start a term"),
    ("m$->m", "is not a dimension"),
    ("...k->k", "no result does"),
])
def test_a_malformed_rule_is_a_rule_error_with_a_hint(text, fault):
    with pytest.raises(RuleError, match=fault) as err:
        td.register_sharding_rule("loop_matmul", text)
    assert err.value.hint and "hint:" in str(err.value)
    assert "loop_matmul" not in user_rules.user_rules()  # nothing registered


def test_unshardable_must_name_letters_of_the_rule():
    with pytest.raises(RuleError, match="does not have"):
        parse_einsum("mk,kn->mn", unshardable="q")
    assert parse_einsum("mk,kn->mn", unshardable="k").reductions() == frozenset("k")


def test_an_unknown_operator_or_a_bad_kernel_name_is_a_rule_error():
    with pytest.raises(RuleError, match="neither a Relax operator") as err:
        td.register_sharding_rule("relax.no_such_operator", "mk,kn->mn")
    assert "ir.RegisterOp" in err.value.hint
    with pytest.raises(RuleError, match="neither a Relax operator"):
        td.register_sharding_rule("two words", "mk,kn->mn")


def test_the_einsum_of_matmul_is_the_builtin_rule():
    for name in ("mm", "bmm", "bcast"):
        call = bindings(Matmuls)[name]
        assert einsum(call, "...mk,...kn->...mn") == sig_of(Matmuls, name)
    # (2, 3, 4, 8) x (1, 8, 16): the broadcast 1 is a dimension of its own, never split
    expect(einsum(bindings(Matmuls)["bcast"], "...mk,...kn->...mn"),
           ((0, 1, 2, 3), (4, 3, 5)), ((0, 1, 2, 5),), unshardable={4}, reduction={3, 4})
    # a rule that does not fit the ranks describes nothing (a built-in rule's None)
    assert einsum(bindings(Matmuls)["bmm"], "mk,kn->mn") is None


def test_a_size_one_term_is_a_dimension_of_its_own():
    # sum over axis 1 of (4, 8, 16) with keepdims: the kept 1 is never split
    expect(einsum(bindings(Reductions)["s_keep"], "abc->a1c"), ((0, 1, 2),), ((0, 3, 2),),
           unshardable={3}, reduction={1})


# --------------------------------------------------------------------------- propagation
def test_the_kernel_is_unreadable_so_without_a_rule_it_runs_replicated():
    mod = loop_matmul_module("S[0]", "R")
    assert prim_func_signature(mod["loop_matmul"], 2) is None
    out = PropagateSharding()(mod)
    values = bindings(out)
    gathered = values["xs_redist"]  # x, split on its rows, gathered whole before the kernel
    assert gathered.op.name == "relax.dist.redistribute" and _placement(gathered) == "R"
    assert [_placement(f) for f in values["y"].args[1].fields] == ["R", "R"]
    assert out["loop_matmul"].attrs.get("tvm_distx.sharding_rule") is None


def test_the_users_rule_splits_the_kernel_and_marks_it():
    td.register_sharding_rule("loop_matmul", "mk,kn->mn")
    out = PropagateSharding()(loop_matmul_module("S[0]", "R"))
    tvm.ir.assert_structural_equal(out, RowSplitPropagated)


def test_a_split_summed_axis_gives_a_replicated_result_completed_by_a_sum():
    td.register_sharding_rule("loop_matmul", "mk,kn->mn")
    out = PropagateSharding()(loop_matmul_module("S[1]", "S[0]"))
    y = bindings(out)["y"]
    assert _placement(y) == "R" and _placement(y.args[1].fields[0]) == "S[1]"
    assert _placement(y.args[1].fields[1]) == "S[0]"


def test_unshardable_keeps_the_summed_axis_whole():
    td.register_sharding_rule("loop_matmul", "mk,kn->mn", unshardable="k")
    out = PropagateSharding()(loop_matmul_module("S[1]", "R"))
    y = bindings(out)["y"]
    assert [_placement(f) for f in y.args[1].fields] == ["R", "R"]


def test_a_rule_that_does_not_fit_the_operands_is_a_rule_error_naming_the_function():
    td.register_sharding_rule("loop_matmul", "mkq,kn->mn")
    with pytest.raises(RuleError, match=r"operand 0 \('xs'\) has rank 2, but its term 'mkq'") as err:
        PropagateSharding()(loop_matmul_module("S[0]", "R"))
    assert err.value.function == "main" and "kernel 'loop_matmul'" in str(err.value)


def test_a_rule_that_joins_axes_of_different_lengths_is_a_rule_error():
    td.register_sharding_rule("loop_matmul", "mk,nk->mn")  # k of x is 12 long, of w 8
    with pytest.raises(RuleError, match="one axis is 12 long in operand 0 but 8 in operand 1"):
        PropagateSharding()(loop_matmul_module("S[0]", "R"))


def test_a_kernels_rule_wins_over_its_accesses():
    """A kernel tir_access reads (row-split) declared whole on its rows: the rule wins."""

    @I.ir_module
    class Readable:
        I.module_attrs({"device_num": 2})
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @T.prim_func(s_tir=True)
        def scale(a: T.Buffer((8, 4), "float32"), b: T.Buffer((8, 4), "float32")):
            for i, j in T.grid(8, 4):
                with T.sblock("b"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    b[vi, vj] = a[vi, vj] * T.float32(2)

        @R.function
        def main(x: R.Tensor((8, 4), "float32")):
            cls = Readable
            with R.dataflow():
                xs = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="S[0]")
                y = R.call_tir(cls.scale, (xs,), out_ty=R.Tensor((8, 4), "float32"))
                R.output(y)
            return y

    assert _placement(bindings(PropagateSharding()(Readable))["y"]) == "S[0]"
    td.register_sharding_rule("scale", "mn->mn", unshardable="m")
    assert _placement(bindings(PropagateSharding()(Readable))["y"]) == "R"


def test_the_documented_kernel_is_split_on_its_summed_axis():
    """docs/concepts.md's example (tests/test_readme.py runs it on two MPI ranks)."""
    td.register_sharding_rule("my_matmul", "mk,kn->mn")
    out = PropagateSharding()(td.load_module(TESTS_DIR / "data" / "loop_matmul.py"))
    y = bindings(out)["y"]
    assert [_placement(f) for f in y.args[1].fields] == ["S[1]", "S[0]"] and _placement(y) == "R"
    assert out["my_matmul"].attrs["tvm_distx.sharding_rule"] == "mk,kn->mn"


# --------------------------------------------------------------------------- a user's operator
PAIRWISE = "relax.distx_test.pairwise"


@pytest.fixture(scope="module")
def pairwise_op() -> tvm.ir.Op:
    """A Relax operator of the user's own, ``x @ w`` in meaning, with TVM's type rule only."""
    tvm.get_global_func("ir.RegisterOp")(PAIRWISE, "a user's operator: x @ w")

    def infer(call, builder):  # noqa: ARG001
        x, w = call.args[0].ty, call.args[1].ty
        return relax.TensorType([x.shape.values[0], w.shape.values[1]], x.dtype)

    tvm.ir.register_op_attr(PAIRWISE, "FInferType", infer)
    tvm.ir.register_op_attr(PAIRWISE, "FPurity", True)
    return tvm.ir.Op.get(PAIRWISE)


def pairwise_module(op: tvm.ir.Op, x_placement: str, w_placement: str) -> tvm.IRModule:
    mesh = DeviceMesh((2,), tvm.ir.Range(0, 2))
    x = relax.Var("x", relax.TensorType((8, 4), "float32"))
    w = relax.Var("w", relax.TensorType((4, 6), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            xs = bb.emit(annotate_sharding(x, mesh, TvmPlacement.from_text(x_placement)), "xs")
            ws = bb.emit(annotate_sharding(w, mesh, TvmPlacement.from_text(w_placement)), "ws")
            y = bb.emit_output(relax.Call(op, [xs, ws]), "y")
        bb.emit_func_output(y)
    mod = bb.get().with_attr("device_num", 2)
    mod.update_global_info("mesh", [mesh])
    return mod


def test_a_users_operator_without_a_rule_cannot_be_typed_on_dtensors(pairwise_op):
    with pytest.raises(UnsupportedProgramError, match="cannot type relax.distx_test.pairwise"):
        PropagateSharding(warn_unlegalized=False)(pairwise_module(pairwise_op, "S[0]", "R"))


@pytest.mark.parametrize("x_placement, w_placement, result", [
    ("S[0]", "R", "S[0]"), ("R", "S[1]", "S[1]"), ("S[1]", "S[0]", "R")])
def test_a_users_operator_is_split_by_its_rule(pairwise_op, x_placement, w_placement, result):
    td.register_sharding_rule(PAIRWISE, "mk,kn->mn")
    out = PropagateSharding(warn_unlegalized=False)(pairwise_module(pairwise_op, x_placement,
                                                                    w_placement))
    main = out["main"]
    assert [_placement(p) for p in main.params] == [x_placement, w_placement]
    y = bindings(out)["y"]
    assert y.op.same_as(pairwise_op) and list(y.args) == list(main.params)  # no redistribute
    assert _placement(y) == result  # a split k: the partial sum typed "R", as TVM types it


# --------------------------------------------------------------------------- running it
@pytest.mark.parametrize("x_placement, w_placement, local_shapes, collective", [
    ("S[0]", "R", [(8, 12), (12, 8)], None),
    ("S[1]", "S[0]", [(16, 6), (6, 8)], "tvm_distx.ccl.allreduce"),
], ids=["rows-split", "summed-axis-split"])
def test_the_users_kernel_runs_on_two_mpi_ranks_equal_to_numpy(x_placement, w_placement,
                                                               local_shapes, collective):
    td.register_sharding_rule("loop_matmul", "mk,kn->mn")
    mod = loop_matmul_module(x_placement, w_placement)
    ranks = td.lower_to_ranks(mod)["main"]  # each rank runs the kernel on its shards
    assert [tuple(int(d) for d in p.ty.shape) for p in ranks.params] == local_shapes
    script = ranks.script(show_meta=False)
    assert "R.call_tir(loop_matmul, (x, w)" in script  # the kernel as written
    assert (collective in script) if collective else ("ccl" not in script)
    exe = td.compile(mod)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((16, 12)).astype("float32")
    w = rng.standard_normal((12, 8)).astype("float32")
    np.testing.assert_allclose(exe.run(x, w, backend="mpi"), x @ w, rtol=1e-5, atol=1e-5)
