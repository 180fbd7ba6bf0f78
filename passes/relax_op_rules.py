"""Signature rules of Relax operators (see :mod:`tvm_distx.passes.op_signatures`).

One rule per operator family, each registered with
:func:`~tvm_distx.passes.op_signatures.register_signature`: elementwise unary
and binary operators (numpy broadcasting), ``matmul``, reductions, softmax and
normalisation, and layout changes (``permute_dims``, ``expand_dims``,
``squeeze``, ``concat``, ``split``, ``reshape``). ``relax.call_tir`` has its
rule in :mod:`tvm_distx.passes.tir_access`.

Most rules are one einsum-like string (:mod:`tvm_distx.passes.einsum`):
``"...mk,...kn->...mn"`` for ``matmul``, ``"...,...->..."`` for a broadcasting
binary operator, ``"abc->a1c"`` for a sum over axis 1 with ``keepdims``; the
rules of operators with attributes build theirs from the attributes.
``reshape`` is written by hand (its groups of dimensions are not an einsum).

To describe a new operator, add a rule here: a function ``f(call, mod)``
returning an :class:`~tvm_distx.passes.op_signatures.OpSignature` (usually
``einsum(call, "...")``), or None when unsure (the solver then replicates).
A user describes one without editing the package with
:func:`tvm_distx.register_sharding_rule`.
"""

from __future__ import annotations

import math
from typing import Sequence

import tvm
from tvm import relax

from tvm_distx.errors import UnsupportedProgramError
from tvm_distx.passes.einsum import Namer, dims, einsum, letters, same_extent
from tvm_distx.passes.op_signatures import (OpSignature, is_tensor, output_types, register_signature,
                                            static_int, tensor_ndim)

__all__: list[str] = []  # the rules are found through the registry


# --------------------------------------------------------------------------- helpers
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


def _term(x: relax.Expr, minimum: int = 0) -> str | None:
    """One letter per dimension of ``x`` (``"abc"``), None when its rank is unknown or lower."""
    ndim = tensor_ndim(x.ty)
    return letters(ndim) if ndim is not None and ndim >= minimum else None


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
    """Elementwise unary op: the result has the operand's labels (clip's bounds are not operands)."""
    return einsum(call, "...->...", [call.args[0]])


@register_signature(*("relax." + n for n in _BINARY))
def _binary(call: relax.Call, mod: tvm.IRModule) -> OpSignature | None:
    """Elementwise binary op with numpy broadcasting: ``"...,...->..."``."""
    operands = [a for a in call.args if is_tensor(a)]
    return einsum(call, ",".join(["..."] * len(operands)) + "->...", operands) if operands else None


# --------------------------------------------------------------------------- matmul
@register_signature("relax.matmul")
def _matmul(call: relax.Call, mod: tvm.IRModule) -> OpSignature | None:
    """``matmul`` with numpy semantics: ``"...mk,...kn->...mn"``; a 1-D operand is ``"k"``.

    Batch dims broadcast; ``k`` is a (sum) reduction label.
    """
    a, b = call.args[0], call.args[1]
    na, nb = tensor_ndim(a.ty), tensor_ndim(b.ty)
    if na is None or nb is None or na == 0 or nb == 0:
        return None
    lhs = "k" if na == 1 else "...mk"
    rhs = "k" if nb == 1 else "...kn"
    result = ("..." if na > 1 or nb > 1 else "") + ("m" if na > 1 else "") + ("n" if nb > 1 else "")
    return einsum(call, f"{lhs},{rhs}->{result}", [a, b])


# --------------------------------------------------------------------------- reductions
_LINEAR_REDUCTIONS = ("sum", "mean")
_OTHER_REDUCTIONS = ("max", "min", "prod", "variance", "std")


@register_signature(*("relax." + n for n in _LINEAR_REDUCTIONS + _OTHER_REDUCTIONS))
def _reduction(call: relax.Call, mod: tvm.IRModule) -> OpSignature | None:
    """Reduction over ``attrs.axis`` (None: all axes), with ``attrs.keepdims``: ``"abc->a1c"``.

    Reduced labels are reduction labels. Only ``sum`` and ``mean`` (linear in
    their input) may shard them: a partial result of ``max``/``min``/``prod``
    needs an all-reduce of that kind, which a signature cannot express, and
    ``variance``/``std`` cannot be completed by an all-reduce at all, so their
    reduced labels are unshardable. A kept dimension (size 1) is a ``1``.
    """
    x = call.args[0]
    term = _term(x)
    if term is None:
        return None
    axes = range(len(term)) if call.attrs.axis is None else _axes(call.attrs.axis, len(term))
    reduced = "".join(term[a] for a in sorted(set(axes)))
    kept = "".join(("1" if call.attrs.keepdims else "") if d in reduced else d for d in term)
    linear = call.op.name.split(".")[-1] in _LINEAR_REDUCTIONS
    return einsum(call, f"{term}->{kept}", [x], unshardable="" if linear else reduced)


# --------------------------------------------------------------------------- normalisation
@register_signature("relax.nn.softmax", "relax.nn.log_softmax")
def _softmax(call: relax.Call, mod: tvm.IRModule) -> OpSignature | None:
    """Softmax along ``attrs.axis``: ``"abc->abc"``, the axis unshardable."""
    x = call.args[0]
    term = _term(x, minimum=1)
    if term is None:
        return None
    return einsum(call, f"{term}->{term}", [x], unshardable=term[_axis(call.attrs.axis, len(term))])


@register_signature("relax.nn.layer_norm", "relax.nn.rms_norm")
def _norm(call: relax.Call, mod: tvm.IRModule) -> OpSignature | None:
    """``layer_norm(data, gamma, beta)`` and ``rms_norm(data, weight)``: ``"abc,c,c->abc"``.

    The normalised ``attrs.axes`` are unshardable; the affine parameters have
    exactly those dimensions, in the order of ``axes``.
    """
    operands = [a for a in call.args if is_tensor(a)]
    term = _term(operands[0])
    if term is None:
        return None
    normalised = "".join(term[a] for a in _axes(call.attrs.axes, len(term)))
    params = "".join(f",{normalised}" for _ in operands[1:])
    return einsum(call, f"{term}{params}->{term}", operands, unshardable=normalised)


# --------------------------------------------------------------------------- layout
@register_signature("relax.permute_dims")
def _permute_dims(call: relax.Call, mod: tvm.IRModule) -> OpSignature | None:
    """``permute_dims``: ``"abc->cab"``, the operand's labels permuted (no axes: reversed)."""
    x = call.args[0]
    term = _term(x)
    if term is None:
        return None
    ndim = len(term)
    axes = list(reversed(range(ndim))) if call.attrs.axes is None else _axes(call.attrs.axes, ndim)
    if sorted(axes) != list(range(ndim)):
        return None
    return einsum(call, f"{term}->{''.join(term[a] for a in axes)}", [x])


@register_signature("relax.expand_dims")
def _expand_dims(call: relax.Call, mod: tvm.IRModule) -> OpSignature | None:
    """``expand_dims``: ``"abc->1abc1"``, a new dim is a size-1 dim of its own."""
    x = call.args[0]
    term = _term(x)
    if term is None:
        return None
    out_ndim = len(term) + len(call.attrs.axis)
    inserted = set(_axes(call.attrs.axis, out_ndim))
    rest = iter(term)
    result = "".join("1" if i in inserted else next(rest) for i in range(out_ndim))
    return einsum(call, f"{term}->{result}", [x])


@register_signature("relax.squeeze")
def _squeeze(call: relax.Call, mod: tvm.IRModule) -> OpSignature | None:
    """``squeeze``: ``"abc->ac"``, a removed (size-1) dim dropped and unshardable."""
    x = call.args[0]
    term = _term(x)
    if term is None:
        return None
    if call.attrs.axis is None:
        shape = dims(x)
        if shape is None or any(static_int(d) is None for d in shape):
            return None
        removed = "".join(term[i] for i, d in enumerate(shape) if static_int(d) == 1)
    else:
        removed = "".join(term[a] for a in sorted(_axes(call.attrs.axis, len(term))))
    kept = "".join(d for d in term if d not in removed)
    return einsum(call, f"{term}->{kept}", [x], unshardable=removed)


@register_signature("relax.concat")
def _concat(call: relax.Call, mod: tvm.IRModule) -> OpSignature | None:
    """``concat`` of a literal tuple: ``"abc,abc->abc"``, the axis unshardable.

    The concat axis has one (unshardable) label for every field and the result,
    so it is not a reduction. A tuple passed as a variable gives None.
    """
    tup = call.args[0]
    if not isinstance(tup, relax.Tuple) or call.attrs.axis is None:
        return None
    fields = list(tup.fields)
    if not fields or not all(is_tensor(f) for f in fields):
        return None
    term = _term(fields[0], minimum=1)
    if term is None:
        return None
    return einsum(call, ",".join([term] * len(fields)) + f"->{term}", fields,
                  unshardable=term[_axis(call.attrs.axis, len(term))])


@register_signature("relax.split")
def _split(call: relax.Call, mod: tvm.IRModule) -> OpSignature | None:
    """``split``: ``"abc->abc,abc"``, every field the operand's labels; the axis unshardable."""
    x = call.args[0]
    term = _term(x, minimum=1)
    outputs = output_types(call.ty)
    if term is None or outputs is None or not isinstance(call.ty, relax.TupleType):
        return None
    return einsum(call, f"{term}->" + ",".join([term] * len(outputs)), [x],
                  unshardable=term[_axis(call.attrs.axis, len(term))])


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
    src, dst = dims(x), dims(call.ty)
    if src is None or dst is None:
        return None
    namer = Namer()
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
    while head < min(len(src), len(dst)) and same_extent(src[head], dst[head]):
        head += 1
    tail = 0
    while (tail < min(len(src), len(dst)) - head
           and same_extent(src[len(src) - 1 - tail], dst[len(dst) - 1 - tail])):
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
