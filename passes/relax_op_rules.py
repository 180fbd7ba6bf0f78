"""Signature rules of Relax operators (see :mod:`tvm_distx.passes.op_signatures`).

One rule per operator family, each registered with
:func:`~tvm_distx.passes.op_signatures.register_signature`: elementwise unary
and binary operators (numpy broadcasting), ``matmul``, reductions, softmax and
normalisation, and layout changes (``permute_dims``, ``expand_dims``,
``squeeze``, ``concat``, ``split``, ``reshape``). ``relax.call_tir`` has its
rule in :mod:`tvm_distx.passes.tir_access`.

To describe a new operator, add a rule here: a function ``f(call, mod)``
returning an :class:`~tvm_distx.passes.op_signatures.OpSignature`, or None
when unsure (the solver then replicates).
"""

from __future__ import annotations

import math
from typing import Sequence

import tvm
import tvm_ffi
from tvm import relax

from tvm_distx.errors import UnsupportedProgramError
from tvm_distx.passes.op_signatures import (Labels, OpSignature, is_tensor, output_types, register_signature,
                            static_int, tensor_ndim, tensor_type)

__all__: list[str] = []  # the rules are found through the registry


# --------------------------------------------------------------------------- type helpers
def _dims(expr_or_ty) -> tuple[tvm.ir.Expr, ...] | None:
    """The shape of a tensor as PrimExprs, None when unknown."""
    ty = expr_or_ty if isinstance(expr_or_ty, tvm.ir.Type) else getattr(expr_or_ty, "ty", None)
    tensor = tensor_type(ty)
    if tensor is None or tensor.ndim < 0 or not isinstance(tensor.shape, relax.ShapeExpr):
        return None
    return tuple(tensor.shape.values)


def _same_extent(a, b) -> bool:
    sa, sb = static_int(a), static_int(b)
    if sa is not None or sb is not None:
        return sa is not None and sa == sb
    return bool(tvm_ffi.structural_equal(a, b))


def _axis(value, ndim: int) -> int:
    axis = int(value)
    if not -ndim <= axis < max(ndim, 1):
        raise UnsupportedProgramError(f"axis {axis} out of range for rank {ndim}")
    return axis % ndim if ndim else 0


def _axes(values, ndim: int) -> list[int]:
    axes = [_axis(v, ndim) for v in values]
    if len(set(axes)) != len(axes):
        raise UnsupportedProgramError(f"repeated axes {axes}")
    return axes


class _Namer:
    """Deterministic label factory (``d0``, ``d1``, ...) that tracks unshardable labels."""

    def __init__(self) -> None:
        self.count = 0
        self.unshardable: set[str] = set()

    def fresh(self, unshardable: bool = False) -> str:
        label = f"d{self.count}"
        self.count += 1
        if unshardable:
            self.unshardable.add(label)
        return label

    def many(self, n: int) -> Labels:
        return tuple(self.fresh() for _ in range(n))

    def signature(self, operands, labels, output) -> OpSignature:
        return OpSignature(
            operands=tuple(operands),
            labels=tuple(tuple(x) for x in labels),
            output=tuple(tuple(x) for x in output),
            unshardable=frozenset(self.unshardable),
        )


def _broadcast(namer: _Namer, shapes: Sequence[Sequence]) -> tuple[list[list[str]], list[str]] | None:
    """Labels for numpy-style broadcasting of several shapes (right-aligned).

    Dimensions of equal extent share a label; a static 1 that broadcasts
    against a larger extent gets a fresh unshardable label. Returns the
    per-shape labels and the result's labels, or None when the extents cannot
    be decided statically (e.g. two different symbolic extents).
    """
    out_ndim = max((len(s) for s in shapes), default=0)
    per = [[""] * len(s) for s in shapes]
    out: list[str] = []
    for pos in range(out_ndim):
        members = []
        for i, shape in enumerate(shapes):
            d = pos - (out_ndim - len(shape))
            if d >= 0:
                members.append((i, d, shape[d]))
        wide = [m for m in members if static_int(m[2]) != 1]
        label = namer.fresh()
        if not wide:  # every extent is 1: one axis of size 1
            for i, d, _ in members:
                per[i][d] = label
        else:
            ref = wide[0][2]
            if any(not _same_extent(ref, ext) for _, _, ext in wide):
                return None
            for i, d, ext in members:
                per[i][d] = label if static_int(ext) != 1 else namer.fresh(unshardable=True)
        out.append(label)
    return per, out


# --------------------------------------------------------------------------- elementwise
_UNARY = (
    "nn.relu", "nn.gelu", "nn.gelu_tanh", "nn.silu", "sigmoid", "tanh", "exp", "log", "sqrt",
    "rsqrt", "negative", "abs", "square", "erf", "sin", "cos", "clip", "astype", "round",
    "floor", "ceil", "sign", "isfinite", "isnan", "isinf",
)
_BINARY = (
    "add", "subtract", "multiply", "divide", "power", "floor_divide", "maximum", "minimum",
    "equal", "not_equal", "greater", "greater_equal", "less", "less_equal", "logical_and",
    "logical_or",
)


@register_signature(*("relax." + n for n in _UNARY))
def _unary(call: relax.Call, mod: tvm.IRModule) -> OpSignature | None:
    """Elementwise unary op: the result has the operand's labels."""
    x = call.args[0]
    ndim = tensor_ndim(x.ty)
    if ndim is None:
        return None
    namer = _Namer()
    labels = namer.many(ndim)
    return namer.signature([x], [labels], [labels])


@register_signature(*("relax." + n for n in _BINARY))
def _binary(call: relax.Call, mod: tvm.IRModule) -> OpSignature | None:
    """Elementwise binary op with numpy broadcasting."""
    operands = [a for a in call.args if is_tensor(a)]
    if not operands:
        return None
    shapes = [_dims(a) for a in operands]
    if any(s is None for s in shapes):
        return None
    namer = _Namer()
    result = _broadcast(namer, shapes)
    if result is None:
        return None
    per, out = result
    return namer.signature(operands, per, [out])


# --------------------------------------------------------------------------- matmul
@register_signature("relax.matmul")
def _matmul(call: relax.Call, mod: tvm.IRModule) -> OpSignature | None:
    """``matmul`` with numpy semantics: batch dims broadcast, 1-D operands allowed.

    ``(..., m, k) x (..., k, n) -> (..., m, n)``; ``k`` is a (sum) reduction label.
    """
    a, b = call.args[0], call.args[1]
    na, nb = tensor_ndim(a.ty), tensor_ndim(b.ty)
    if na is None or nb is None or na == 0 or nb == 0:
        return None
    namer = _Namer()
    batch_a, batch_b = max(na - 2, 0), max(nb - 2, 0)
    if batch_a or batch_b:
        da, db = _dims(a), _dims(b)
        if da is None or db is None:
            return None
        result = _broadcast(namer, [da[:batch_a], db[:batch_b]])
        if result is None:
            return None
        (la, lb), out = result
    else:
        la, lb, out = [], [], []
    m = namer.fresh() if na >= 2 else None
    k = namer.fresh()
    n = namer.fresh() if nb >= 2 else None
    labels_a = [k] if na == 1 else [*la, m, k]
    labels_b = [k] if nb == 1 else [*lb, k, n]
    result_labels = list(out)
    if na >= 2:
        result_labels.append(labels_a[-2])
    if nb >= 2:
        result_labels.append(labels_b[-1])
    return namer.signature([a, b], [labels_a, labels_b], [result_labels])


# --------------------------------------------------------------------------- reductions
_LINEAR_REDUCTIONS = ("sum", "mean")
_OTHER_REDUCTIONS = ("max", "min", "prod", "variance", "std")


@register_signature(*("relax." + n for n in _LINEAR_REDUCTIONS + _OTHER_REDUCTIONS))
def _reduction(call: relax.Call, mod: tvm.IRModule) -> OpSignature | None:
    """Reduction over ``attrs.axis`` (None: all axes), with ``attrs.keepdims``.

    Reduced labels are reduction labels. Only ``sum`` and ``mean`` (linear in
    their input) may shard them: a partial result of ``max``/``min``/``prod``
    needs an all-reduce of that kind, which a signature cannot express, and
    ``variance``/``std`` cannot be completed by an all-reduce at all, so their
    reduced labels are unshardable. A kept dimension (size 1) gets a fresh,
    unshardable label.
    """
    x = call.args[0]
    ndim = tensor_ndim(x.ty)
    if ndim is None:
        return None
    attrs = call.attrs
    axes = set(range(ndim)) if attrs.axis is None else set(_axes(attrs.axis, ndim))
    keepdims = bool(attrs.keepdims)
    linear = call.op.name.split(".")[-1] in _LINEAR_REDUCTIONS
    namer = _Namer()
    labels = namer.many(ndim)
    out = []
    for i, label in enumerate(labels):
        if i in axes:
            if not linear:
                namer.unshardable.add(label)
            if keepdims:
                out.append(namer.fresh(unshardable=True))
        else:
            out.append(label)
    return namer.signature([x], [labels], [out])


# --------------------------------------------------------------------------- normalisation
@register_signature("relax.nn.softmax", "relax.nn.log_softmax")
def _softmax(call: relax.Call, mod: tvm.IRModule) -> OpSignature | None:
    """Softmax along ``attrs.axis``: same labels, the axis unshardable."""
    x = call.args[0]
    ndim = tensor_ndim(x.ty)
    if ndim is None or ndim == 0:
        return None
    namer = _Namer()
    labels = namer.many(ndim)
    namer.unshardable.add(labels[_axis(call.attrs.axis, ndim)])
    return namer.signature([x], [labels], [labels])


@register_signature("relax.nn.layer_norm", "relax.nn.rms_norm")
def _norm(call: relax.Call, mod: tvm.IRModule) -> OpSignature | None:
    """``layer_norm(data, gamma, beta)`` and ``rms_norm(data, weight)``.

    The normalised ``attrs.axes`` are unshardable; the affine parameters have
    exactly those dimensions, in the order of ``axes``.
    """
    operands = [a for a in call.args if is_tensor(a)]
    data, params = operands[0], operands[1:]
    ndim = tensor_ndim(data.ty)
    if ndim is None:
        return None
    axes = _axes(call.attrs.axes, ndim)
    namer = _Namer()
    labels = namer.many(ndim)
    normalised = tuple(labels[a] for a in axes)
    namer.unshardable.update(normalised)
    for p in params:
        if tensor_ndim(p.ty) != len(normalised):
            return None
    return namer.signature(operands, [labels] + [normalised] * len(params), [labels])


# --------------------------------------------------------------------------- layout
@register_signature("relax.permute_dims")
def _permute_dims(call: relax.Call, mod: tvm.IRModule) -> OpSignature | None:
    """``permute_dims``: the result's labels are the operand's, permuted (None: reversed)."""
    x = call.args[0]
    ndim = tensor_ndim(x.ty)
    if ndim is None:
        return None
    axes = list(reversed(range(ndim))) if call.attrs.axes is None else _axes(call.attrs.axes, ndim)
    if sorted(axes) != list(range(ndim)):
        return None
    namer = _Namer()
    labels = namer.many(ndim)
    return namer.signature([x], [labels], [[labels[a] for a in axes]])


@register_signature("relax.expand_dims")
def _expand_dims(call: relax.Call, mod: tvm.IRModule) -> OpSignature | None:
    """``expand_dims``: new size-1 dims get fresh unshardable labels."""
    x = call.args[0]
    ndim = tensor_ndim(x.ty)
    if ndim is None:
        return None
    out_ndim = ndim + len(call.attrs.axis)
    inserted = set(_axes(call.attrs.axis, out_ndim))
    namer = _Namer()
    labels = namer.many(ndim)
    rest = iter(labels)
    out = [namer.fresh(unshardable=True) if i in inserted else next(rest) for i in range(out_ndim)]
    return namer.signature([x], [labels], [out])


@register_signature("relax.squeeze")
def _squeeze(call: relax.Call, mod: tvm.IRModule) -> OpSignature | None:
    """``squeeze``: removed (size-1) dims are dropped and unshardable."""
    x = call.args[0]
    ndim = tensor_ndim(x.ty)
    if ndim is None:
        return None
    if call.attrs.axis is None:
        dims = _dims(x)
        if dims is None or any(static_int(d) is None for d in dims):
            return None
        removed = {i for i, d in enumerate(dims) if static_int(d) == 1}
    else:
        removed = set(_axes(call.attrs.axis, ndim))
    namer = _Namer()
    labels = namer.many(ndim)
    namer.unshardable.update(labels[i] for i in removed)
    return namer.signature([x], [labels], [[l for i, l in enumerate(labels) if i not in removed]])


@register_signature("relax.concat")
def _concat(call: relax.Call, mod: tvm.IRModule) -> OpSignature | None:
    """``concat`` of a literal tuple: the fields share all labels; the axis is unshardable.

    The concat axis has one (unshardable) label for every field and the result,
    so it is not a reduction. A tuple passed as a variable gives None.
    """
    tup = call.args[0]
    if not isinstance(tup, relax.Tuple) or call.attrs.axis is None:
        return None
    fields = list(tup.fields)
    if not fields or not all(is_tensor(f) for f in fields):
        return None
    ndim = tensor_ndim(fields[0].ty)
    if ndim is None or ndim == 0 or any(tensor_ndim(f.ty) != ndim for f in fields):
        return None
    namer = _Namer()
    labels = namer.many(ndim)
    namer.unshardable.add(labels[_axis(call.attrs.axis, ndim)])
    return namer.signature(fields, [labels] * len(fields), [labels])


@register_signature("relax.split")
def _split(call: relax.Call, mod: tvm.IRModule) -> OpSignature | None:
    """``split``: every field of the result has the operand's labels; the axis is unshardable."""
    x = call.args[0]
    ndim = tensor_ndim(x.ty)
    outputs = output_types(call.ty)
    if ndim is None or ndim == 0 or outputs is None or not isinstance(call.ty, relax.TupleType):
        return None
    namer = _Namer()
    labels = namer.many(ndim)
    namer.unshardable.add(labels[_axis(call.attrs.axis, ndim)])
    return namer.signature([x], [labels], [labels] * len(outputs))


@register_signature("relax.reshape")
def _reshape(call: relax.Call, mod: tvm.IRModule) -> OpSignature | None:
    """``reshape``: match groups of consecutive dims whose extents multiply equally.

    Within a group only the major-most non-1 input dim and the major-most non-1
    output dim share a label, and only when their extents have a common factor
    (otherwise no shard count can divide both); every other dim gets a fresh
    unshardable label. The solver must still check that a shard count divides
    both extents. With symbolic extents, the leading and trailing dims that are
    the same on both sides keep their labels and the static dims between them
    are grouped as above (``(n, 16) -> (n, 4, 4)`` keeps the split of the 16 on
    the first 4, as TVM does); any other symbolic reshape is not described.
    """
    x = call.args[0]
    src, dst = _dims(x), _dims(call.ty)
    if src is None or dst is None:
        return None
    namer = _Namer()
    if any(static_int(a) is None for a in src) or any(static_int(b) is None for b in dst):
        return _symbolic_reshape(x, list(src), list(dst), namer)
    s = [static_int(d) for d in src]
    t = [static_int(d) for d in dst]
    if 0 in s or 0 in t or math.prod(s) != math.prod(t):
        return None
    in_labels, out_labels = _grouped_labels(s, t, namer)
    return namer.signature([x], [in_labels], [out_labels])


def _grouped_labels(s: Sequence[int], t: Sequence[int], namer) -> tuple[list[str], list[str]]:
    """Labels of a static reshape from ``s`` to ``t`` (see :func:`_reshape`)."""
    in_labels: list[str] = [""] * len(s)
    out_labels: list[str] = [""] * len(t)
    for group_in, group_out in _reshape_groups(s, t):
        major_in = next((i for i in group_in if s[i] != 1), None)
        major_out = next((j for j in group_out if t[j] != 1), None)
        shared = None
        if major_in is not None and major_out is not None and math.gcd(s[major_in], t[major_out]) > 1:
            shared = namer.fresh()
            in_labels[major_in] = out_labels[major_out] = shared
        for i in group_in:
            if not in_labels[i]:
                in_labels[i] = namer.fresh(unshardable=True)
        for j in group_out:
            if not out_labels[j]:
                out_labels[j] = namer.fresh(unshardable=True)
    return in_labels, out_labels


def _symbolic_reshape(x, src: list, dst: list, namer) -> OpSignature | None:
    """A reshape with symbolic extents: same dims at both ends, static ones between."""
    head = 0
    while head < min(len(src), len(dst)) and _same_extent(src[head], dst[head]):
        head += 1
    tail = 0
    while (tail < min(len(src), len(dst)) - head
           and _same_extent(src[len(src) - 1 - tail], dst[len(dst) - 1 - tail])):
        tail += 1
    s = [static_int(d) for d in src[head:len(src) - tail]]
    t = [static_int(d) for d in dst[head:len(dst) - tail]]
    if None in s or None in t or 0 in s or 0 in t or math.prod(s) != math.prod(t):
        return None
    ends = namer.many(head + tail)
    middle_in, middle_out = _grouped_labels(s, t, namer) if s or t else ([], [])
    in_labels = list(ends[:head]) + middle_in + list(ends[head:])
    out_labels = list(ends[:head]) + middle_out + list(ends[head:])
    return namer.signature([x], [in_labels], [out_labels])


def _reshape_groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Split two static shapes of equal size into groups of equal extent product.

    Size-1 dims left over at the end form their own groups.
    """
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(src) and j < len(dst):
        gi, gj = [i], [j]
        pi, pj = src[i], dst[j]
        i += 1
        j += 1
        while pi != pj:
            if pi < pj:
                gi.append(i)
                pi *= src[i]
                i += 1
            else:
                gj.append(j)
                pj *= dst[j]
                j += 1
        groups.append((gi, gj))
    # remaining dims are all 1 (the products are equal)
    groups.extend(([k], []) for k in range(i, len(src)))
    groups.extend(([], [k]) for k in range(j, len(dst)))
    return groups
