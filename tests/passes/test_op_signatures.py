"""Tests of :mod:`tvm_distx.passes.op_signatures`: the signature data model and its registry.

Signatures are compared label-agnostically (:func:`signature_tools.canon`).
"""

from __future__ import annotations

import pytest
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from signature_tools import expect, operand_names, sig_of
from tvm_distx.passes import op_signatures as ops
from tvm_distx.passes.op_signatures import OpSignature, op_signature, register_signature


# --------------------------------------------------------------------------- modules
@I.ir_module
class Distributed:
    I.module_attrs({"device_num": 2})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(
        x: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[0]"),
        w: R.dist.DTensor((8, 16), "float32", "mesh[0]", "R"),
    ) -> R.dist.DTensor((4, 16), "float32", "mesh[0]", "S[0]"):
        y = R.matmul(x, w)
        z = R.nn.relu(y)
        return z


@I.ir_module
class Unknown:
    @R.function
    def main(x: R.Tensor((1, 3, 8, 8), "float32"), w: R.Tensor((4, 3, 3, 3), "float32")):
        with R.dataflow():
            c = R.nn.conv2d(x, w)
            R.output(c)
        return c


# --------------------------------------------------------------------------- the dataclass
def test_reduction_labels_are_operand_labels_missing_from_outputs():
    sig = OpSignature(operands=(), labels=(("a", "b"), ("b", "c")), output=(("a", "c"),))
    assert sig.reduction_labels() == frozenset({"b"})
    assert sig.unshardable == frozenset()
    with pytest.raises(Exception):
        sig.labels = ()  # frozen


def test_register_signature_decorator_and_lookup():
    @register_signature("relax.nn.conv2d")
    def conv(call, mod):
        return None

    try:
        assert "relax.nn.conv2d" in ops.registered_ops()
        assert ops._RULES["relax.nn.conv2d"] is conv
        assert sig_of(Unknown, "c") is None
    finally:
        del ops._RULES["relax.nn.conv2d"]
    assert "relax.nn.conv2d" not in ops.registered_ops()
    with pytest.raises(ValueError):
        register_signature()


def test_unknown_op_and_non_calls_give_none():
    assert sig_of(Unknown, "c") is None
    assert op_signature(relax.Var("x", R.Tensor((2,), "float32")), Unknown) is None


def test_registry_covers_the_listed_ops():
    names = ops.registered_ops()
    for short in ("nn.relu", "nn.gelu_tanh", "isinf", "logical_or", "matmul", "std", "nn.rms_norm",
                  "permute_dims", "expand_dims", "squeeze", "concat", "split", "reshape",
                  "call_tir"):
        assert "relax." + short in names
    assert "relax.dist.annotate_sharding" not in names
    for name in names:  # every registered name is a real operator
        assert ops._op(name).name == name


def test_a_failing_rule_gives_none(caplog):
    @register_signature("relax.nn.conv2d")
    def broken(call, mod):
        raise RuntimeError("boom")

    try:
        with caplog.at_level("WARNING", logger=ops.__name__):
            assert sig_of(Unknown, "c") is None
    finally:
        del ops._RULES["relax.nn.conv2d"]
    assert any("relax.nn.conv2d" in r.getMessage() for r in caplog.records)


def test_an_inconsistent_rule_gives_none():
    @register_signature("relax.nn.conv2d")
    def wrong_rank(call, mod):
        return OpSignature(tuple(call.args), (("a",), ("b",)), (("a",),))

    try:
        assert sig_of(Unknown, "c") is None
    finally:
        del ops._RULES["relax.nn.conv2d"]


# --------------------------------------------------------------------------- DTensor operands
def test_dtensor_operands_are_described_like_tensors():
    sig = sig_of(Distributed, "y")
    expect(sig, ((0, 1), (1, 2)), ((0, 2),), reduction={1})
    assert operand_names(sig) == ["x", "w"]
    expect(sig_of(Distributed, "z"), ((0, 1),), ((0, 1),))
