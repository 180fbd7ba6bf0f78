"""Helpers of the operator-signature tests (test_op_signatures, test_relax_op_rules, test_tir_access).

Signatures are compared label-agnostically: :func:`canon` renumbers labels in
order of first appearance (operands first, then outputs), so ``(4,8)x(8,16)``
matmul reads ``operands ((0, 1), (1, 2))``, ``output ((0, 2),)``.
"""

from __future__ import annotations

import tvm
from tvm import relax

from tvm_distx.passes.op_signatures import OpSignature, op_signature


def canon(sig: OpSignature) -> dict:
    """The signature with labels renumbered 0, 1, ... by first appearance."""
    assert sig is not None
    numbers: dict[str, int] = {}
    for labels in sig.labels + sig.output:
        for label in labels:
            numbers.setdefault(label, len(numbers))

    def renumber(groups):
        return tuple(tuple(numbers[label] for label in labels) for labels in groups)

    return {
        "operands": renumber(sig.labels),
        "output": renumber(sig.output),
        "unshardable": frozenset(numbers[label] for label in sig.unshardable),
        "reduction": frozenset(numbers[label] for label in sig.reduction_labels()),
    }


def expect(sig, operands, output, unshardable=(), reduction=()):
    assert canon(sig) == {
        "operands": operands,
        "output": output,
        "unshardable": frozenset(unshardable),
        "reduction": frozenset(reduction),
    }


def bindings(mod: tvm.IRModule, func: str = "main") -> dict[str, relax.Expr]:
    """Name of each bound variable of ``func`` -> its value."""
    out = {}
    for block in mod[func].body.blocks:
        for binding in block.bindings:
            out[binding.var.name] = binding.value
    return out


def sig_of(mod: tvm.IRModule, name: str) -> OpSignature | None:
    call = bindings(mod)[name]
    return op_signature(call, mod)


def operand_names(sig: OpSignature) -> list[str]:
    return [o.name for o in sig.operands]
