"""Our legalization rules for the operators whose TVM rule fails or misleads.

:func:`legalize_rules` is the ``customize_legalize_map`` that
:func:`tvm_distx.compiler.pipeline.legalize_operators` gives ``LegalizeOps``. Every
operator it does not name keeps TVM's own rule; the ones it names keep it too
for every call the reason below does not cover.

* ``full`` and ``full_like`` of an infinite or NaN value. TVM's rule passes the
  result's dtype to ``topi.full`` as a type object, and ``topi.full`` checks a
  non-finite value's dtype with ``in`` on a string (``TypeError: argument of
  type 'PrimType' is not iterable``). Such fills are common: routers start their
  scores at ``-inf`` (``full_like(logits, -inf)``), masks at ``-inf`` too.
* ``take`` in its default mode (``"fast"``: the indices are in bounds, nothing
  checks them). TVM's rule builds it with ``topi.take``, which logs "Fast mode
  segfaults when there are out-of-bounds indices" for every call, two to four
  times per language model (the embedding lookups). The gather is the same
  expression without the log line. The indices a user gives are checked before
  any call (a prompt's token ids against the vocabulary), which is what makes
  the mode safe here.
* ``scatter_elements`` that replaces (``reduction="update"``) a few entries per
  row, as a router writes its top-k weights into a row per expert. TVM's rule
  is a loop program built with its IR builder, whose ``seq_scope`` mark LLVM's
  code generator does not know ("Unknown pragma pragma_scope", once per
  kernel), and which no schedule can read. Ours is one element-wise block:
  each entry is a chain of one select per update of its row, the last update
  outermost, so a repeated index keeps the last update, as the loop's
  sequential order does. It reads each row's ``k`` indices once per entry,
  so it is used up to :data:`SCATTER_MAX_UPDATES` updates per row.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

import tvm
import tvm_ffi
from tvm import relax, te, topi

__all__ = ["legalize_rules"]

logger = logging.getLogger(__name__)

Rule = Callable[[relax.BlockBuilder, relax.Call], relax.Expr]

#: The most updates per row (along the scatter's axis) that our ``scatter_elements`` takes.
SCATTER_MAX_UPDATES = 16


def legalize_rules() -> dict[str, Rule]:
    """The ``customize_legalize_map`` of our rules (the module's docstring lists them)."""
    rules: dict[str, Rule] = {}
    for name in ("relax.full", "relax.full_like"):
        rules[name] = _non_finite_fill(_tvm_rule(name))
    rules["relax.take"] = _take_in_bounds(_tvm_rule("relax.take"))
    rules["relax.scatter_elements"] = _scatter_few(_tvm_rule("relax.scatter_elements"))
    return rules


def _tvm_rule(name: str) -> Rule:
    return tvm.ir.Op.get(name).get_attr("FLegalize")


def _non_finite_fill(default: Rule) -> Rule:
    """The legalization of a fill whose value is a non-finite scalar constant, else ``default``."""

    def rule(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        value, ty = call.args[1], call.ty
        if not isinstance(value, tvm.ir.Constant) or value.value.shape != () \
                or not isinstance(ty, relax.TensorType) \
                or not isinstance(ty.shape, relax.ShapeExpr):
            return default(bb, call)
        number = value.value.numpy().item()
        if not isinstance(number, float) or math.isfinite(number):
            return default(bb, call)
        return bb.call_te(topi.full, list(ty.shape.values), str(ty.dtype), number,
                          primfunc_name_hint="full")

    return rule


def _take_in_bounds(default: Rule) -> Rule:
    """``take`` in ``"fast"`` mode as a plain gather; any other mode keeps ``default``."""

    def rule(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        data, indices = call.args
        if str(call.attrs.mode) != "fast" or not all(
                isinstance(arg.ty, relax.TensorType) and isinstance(arg.ty.shape, relax.ShapeExpr)
                for arg in call.args):
            return default(bb, call)
        ndim = len(data.ty.shape.values)
        axis = 0 if call.attrs.axis is None else int(call.attrs.axis)
        return bb.call_te(_gather, data, indices, axis + ndim if axis < 0 else axis,
                          primfunc_name_hint="take")

    return rule


def _gather(data: te.Tensor, indices: te.Tensor, axis: int) -> te.Tensor:
    """``data`` indexed along ``axis`` by every entry of ``indices`` (numpy's ``take``)."""
    depth = len(indices.shape)
    shape = [*data.shape[:axis], *indices.shape, *data.shape[axis + 1:]]

    def element(*index):
        at = indices[index[axis:axis + depth]] if depth else indices()
        return data[(*index[:axis], at, *index[axis + depth:])]

    return te.compute(shape, element, name="T_take", tag="injective")


def _shape(expr: relax.Expr) -> list[tvm.tirx.PrimExpr] | None:
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    return list(ty.shape.values)


def _scatter_few(default: Rule) -> Rule:
    """``scatter_elements`` of a few updates per row as two blocks; else ``default``."""

    def rule(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        data, indices, updates = call.args
        shapes = [_shape(arg) for arg in call.args]
        if str(call.attrs.reduction) != "update" or any(s is None for s in shapes):
            return default(bb, call)
        data_shape, index_shape, update_shape = shapes
        axis = int(call.attrs.axis) % len(data_shape)
        same = tvm_ffi.structural_equal
        count = index_shape[axis]
        if not (same(index_shape, update_shape) and isinstance(count, tvm.tirx.IntImm)
                and int(count) <= SCATTER_MAX_UPDATES
                and all(same(index_shape[d], data_shape[d])
                        for d in range(len(data_shape)) if d != axis)):
            return default(bb, call)
        return bb.call_te(_scatter_update, data, indices, updates, axis,
                          primfunc_name_hint="scatter_elements")

    return rule


def _scatter_update(data: te.Tensor, indices: te.Tensor, updates: te.Tensor,
                    axis: int) -> te.Tensor:
    """``data`` with ``updates`` written along ``axis`` at ``indices`` (the last one wins).

    Each entry is a chain of selects, one per update of its row, the last
    update outermost: an index repeated in a row keeps its last update.
    """
    extent = data.shape[axis].astype("int64")

    def entry(*index):
        value = data[index]
        for k in range(int(indices.shape[axis])):
            at = (*index[:axis], k, *index[axis + 1:])
            target = indices[at].astype("int64")
            target = tvm.tirx.Select(target < 0, target + extent, target)
            value = tvm.tirx.Select(target == index[axis].astype("int64"), updates[at], value)
        return value

    return te.compute(data.shape, entry, name="T_scatter_elements", tag="injective")
