"""Distributed type rules that TVM 0.27 lacks, registered with TVM when this package loads.

TVM types a call whose operands are DTensors through the operator's
``dist.FInferType`` attribute, and stops with an ``InternalError`` when an
operator has none. Real models reach such operators: OPT's learned positions turn
the cache position into a shape with ``relax.tensor_to_shape``. Each rule here
gives the type TVM would give the same call on plain tensors, for operators
whose result is not a tensor (so it has no placement). Operators with a tensor
result need a placement rule instead (:mod:`tvm_distx.passes.relax_op_rules`).

A rule is registered only when TVM has none, so a later TVM that brings its own
keeps it.
"""

from __future__ import annotations

import logging

import tvm
from tvm import relax

logger = logging.getLogger(__name__)

__all__: list[str] = []

_ATTR = "dist.FInferType"


def _tensor_to_shape(call: relax.Call, builder) -> relax.ShapeType:  # noqa: ARG001
    """``tensor_to_shape(x)`` of a 1-D tensor of ``n`` integers: a shape of ``n`` dims."""
    ty = call.args[0].ty
    shape = getattr(getattr(ty, "tensor_ty", ty), "shape", None)
    values = getattr(shape, "values", None)
    if values is not None and len(values) == 1 and isinstance(values[0], tvm.tirx.IntImm):
        return relax.ShapeType(ndim=int(values[0]))
    return relax.ShapeType(ndim=-1)


_RULES = {"relax.tensor_to_shape": _tensor_to_shape}


def _register() -> None:
    for name, rule in _RULES.items():
        op = tvm.ir.Op.get(name)
        if op.get_attr(_ATTR) is None:
            tvm.ir.register_op_attr(name, _ATTR, rule)
            logger.debug("registered %s for %s", _ATTR, name)


_register()
