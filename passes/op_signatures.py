"""Einsum-style signatures of Relax operator calls, for sharding propagation.

A sharding solver needs to know, for one call, which dimensions of its
operands and results are *the same logical axis*: sharding one of them along a
mesh axis means sharding the others the same way. This module describes that as
data, in the spirit of an einsum string (``"mk,kn->mn"`` for a matmul): an
:class:`OpSignature` gives every tensor dimension a label, and equal labels are
one axis.

* A label that appears in some operand but in no output is a *reduction*
  (contraction) axis. Sharding it is allowed and gives a partial result, which
  lowering completes with an all-reduce (sum).
* A label in :attr:`OpSignature.unshardable` must stay replicated: the softmax
  axis, a concat axis, a size-1 dimension that broadcasts, a reduction that is
  not a sum, a TIR dimension accessed with a shifted index, ...

Rules are plain functions registered per operator name with
:func:`register_signature` (like PyTorch DTensor's sharding strategies, but
returning data). :func:`op_signature` looks the rule up and checks what it
returns against the call's types. ``relax.call_tir`` gets a rule that reads the
access patterns of the called ``PrimFunc`` (see :func:`prim_func_signature`).

Every rule is conservative: when it is unsure it returns ``None`` (the solver
then replicates) or marks a label unshardable. Both are always correct.

Examples
--------
>>> sig = op_signature(matmul_call, mod)   # (4, 8) x (8, 16)
>>> sig.labels, sig.output, sig.reduction_labels()
((('d0', 'd1'), ('d1', 'd2')), (('d0', 'd2'),), frozenset({'d1'}))
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.relax.distributed import DTensorType
from tvm.s_tir.stmt import SBlock, SBlockRealize

__all__ = [
    "OpSignature",
    "SignatureRule",
    "op_signature",
    "prim_func_signature",
    "register_signature",
    "registered_ops",
]

logger = logging.getLogger(__name__)

Labels = tuple[str, ...]
SignatureRule = Callable[[relax.Call, tvm.IRModule], "OpSignature | None"]


# --------------------------------------------------------------------------- the signature
@dataclass(frozen=True)
class OpSignature:
    """How the tensor operands and results of one call share axes.

    Parameters
    ----------
    operands : tuple of relax.Expr
        The call's tensor operands, in order. For ``relax.call_tir`` these are
        the fields of ``args[1]``; for ``relax.concat`` the fields of the tuple
        argument. Non-tensor arguments (shapes, prim values) are left out.
    labels : tuple of tuple of str
        Per operand, one label per tensor dimension.
    output : tuple of tuple of str
        Per output tensor, one label per dimension. A single-tensor result is a
        1-tuple; a tuple result lists each field.
    unshardable : frozenset of str
        Labels that must not be sharded.

    Notes
    -----
    Two dimensions with the same label are one logical axis. No label appears
    twice in one tensor.
    """

    operands: tuple[relax.Expr, ...]
    labels: tuple[Labels, ...]
    output: tuple[Labels, ...]
    unshardable: frozenset[str] = field(default_factory=frozenset)

    def reduction_labels(self) -> frozenset[str]:
        """Labels in some operand but in no output (contraction axes).

        Returns
        -------
        frozenset of str
            The reduction labels, unshardable ones included.
        """
        produced = {label for labels in self.output for label in labels}
        return frozenset(
            label for labels in self.labels for label in labels if label not in produced
        )

    def all_labels(self) -> frozenset[str]:
        """Every label of the signature, operands and outputs.

        Returns
        -------
        frozenset of str
            The labels.
        """
        return frozenset(label for labels in self.labels + self.output for label in labels)


# --------------------------------------------------------------------------- registry
_RULES: dict[str, SignatureRule] = {}


def register_signature(*op_names: str) -> Callable[[SignatureRule], SignatureRule]:
    """Register a signature rule for one or more Relax operators.

    Parameters
    ----------
    *op_names : str
        Full operator names, e.g. ``"relax.add"``.

    Returns
    -------
    callable
        A decorator that records ``f(call, mod) -> OpSignature | None`` for
        every name and returns ``f`` unchanged. A later registration of the
        same name replaces the earlier one.

    Examples
    --------
    >>> @register_signature("relax.my_unary")
    ... def _my_unary(call, mod):
    ...     ...
    """
    if not op_names:
        raise ValueError("register_signature needs at least one operator name")

    def decorator(rule: SignatureRule) -> SignatureRule:
        for name in op_names:
            try:
                _op(name)
            except Exception:  # noqa: BLE001 - the op may be registered later
                logger.warning("signature rule %s registered for unknown operator %s",
                               rule.__name__, name)
            if name in _RULES and _RULES[name] is not rule:
                logger.debug("signature rule for %s replaced by %s", name, rule.__name__)
            _RULES[name] = rule
        return rule

    return decorator


def registered_ops() -> frozenset[str]:
    """The operator names that have a signature rule.

    Returns
    -------
    frozenset of str
        Registered operator names.
    """
    return frozenset(_RULES)


@functools.lru_cache(maxsize=None)
def _op(name: str) -> tvm.ir.Op:
    """Look a Relax operator up once."""
    return tvm.ir.Op.get(name)


def _op_name(call: relax.Call) -> str | None:
    if isinstance(call.op, tvm.ir.Op):
        return call.op.name
    return None


def op_signature(call: relax.Call, mod: tvm.IRModule) -> OpSignature | None:
    """The signature of one Relax call.

    Parameters
    ----------
    call : relax.Call
        A call of a Relax operator (calls of Relax functions have no signature).
    mod : tvm.IRModule
        The module, to resolve the ``PrimFunc`` of a ``relax.call_tir``.

    Returns
    -------
    OpSignature or None
        None when there is no rule for the call, or the rule cannot describe
        it (the solver then replicates).
    """
    if not isinstance(call, relax.Call):
        return None
    name = _op_name(call)
    rule = _RULES.get(name) if name is not None else None
    if rule is None:
        return None
    try:
        sig = rule(call, mod)
    except Exception:  # noqa: BLE001 - a rule that fails must not break propagation
        logger.warning("signature rule for %s failed; the call will be replicated", name,
                       exc_info=True)
        return None
    if sig is None:
        logger.debug("no signature for this %s call", name)
        return None
    problem = _check(sig, call)
    if problem is not None:
        logger.warning("signature rule for %s gave an inconsistent signature (%s); ignored",
                       name, problem)
        return None
    return sig


def _check(sig: OpSignature, call: relax.Call) -> str | None:
    """Why ``sig`` does not fit ``call`` (None when it fits)."""
    if len(sig.operands) != len(sig.labels):
        return "operands and labels differ in number"
    for operand, labels in zip(sig.operands, sig.labels):
        ndim = _ndim(operand.ty)
        if ndim is None or ndim != len(labels):
            return f"operand of rank {ndim} has {len(labels)} labels"
    outputs = _output_types(call.ty)
    if outputs is None or len(outputs) != len(sig.output):
        return "outputs do not match the call's type"
    for ty, labels in zip(outputs, sig.output):
        ndim = _ndim(ty)
        if ndim is None or ndim != len(labels):
            return f"output of rank {ndim} has {len(labels)} labels"
    for labels in sig.labels + sig.output:
        if len(set(labels)) != len(labels):
            return f"a label repeats within one tensor: {labels}"
    return None


# --------------------------------------------------------------------------- type helpers
def _tensor_type(ty) -> relax.TensorType | None:
    if isinstance(ty, DTensorType):
        ty = ty.tensor_ty
    return ty if isinstance(ty, relax.TensorType) else None


def _ndim(ty) -> int | None:
    tensor = _tensor_type(ty)
    if tensor is None or tensor.ndim < 0:
        return None
    return int(tensor.ndim)


def _is_tensor(expr: relax.Expr) -> bool:
    return _tensor_type(getattr(expr, "ty", None)) is not None


def _dims(expr_or_ty) -> tuple[tvm.ir.Expr, ...] | None:
    """The shape of a tensor as PrimExprs, None when unknown."""
    ty = expr_or_ty if isinstance(expr_or_ty, tvm.ir.Type) else getattr(expr_or_ty, "ty", None)
    tensor = _tensor_type(ty)
    if tensor is None or tensor.ndim < 0 or not isinstance(tensor.shape, relax.ShapeExpr):
        return None
    return tuple(tensor.shape.values)


def _static(dim) -> int | None:
    if isinstance(dim, tirx.IntImm):
        return int(dim.value)
    return None


def _same_extent(a, b) -> bool:
    sa, sb = _static(a), _static(b)
    if sa is not None or sb is not None:
        return sa is not None and sa == sb
    return bool(tvm_ffi.structural_equal(a, b))


def _output_types(ty) -> list | None:
    """The tensor types a call produces (one, or a tuple's fields)."""
    if _tensor_type(ty) is not None:
        return [ty]
    if isinstance(ty, relax.TupleType):
        fields = list(ty.fields)
        if all(_tensor_type(f) is not None for f in fields):
            return fields
    return None


def _axis(value, ndim: int) -> int:
    axis = int(value)
    if not -ndim <= axis < max(ndim, 1):
        raise ValueError(f"axis {axis} out of range for rank {ndim}")
    return axis % ndim if ndim else 0


def _axes(values, ndim: int) -> list[int]:
    axes = [_axis(v, ndim) for v in values]
    if len(set(axes)) != len(axes):
        raise ValueError(f"repeated axes {axes}")
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
        wide = [m for m in members if _static(m[2]) != 1]
        label = namer.fresh()
        if not wide:  # every extent is 1: one axis of size 1
            for i, d, _ in members:
                per[i][d] = label
        else:
            ref = wide[0][2]
            if any(not _same_extent(ref, ext) for _, _, ext in wide):
                return None
            for i, d, ext in members:
                per[i][d] = label if _static(ext) != 1 else namer.fresh(unshardable=True)
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
    ndim = _ndim(x.ty)
    if ndim is None:
        return None
    namer = _Namer()
    labels = namer.many(ndim)
    return namer.signature([x], [labels], [labels])


@register_signature(*("relax." + n for n in _BINARY))
def _binary(call: relax.Call, mod: tvm.IRModule) -> OpSignature | None:
    """Elementwise binary op with numpy broadcasting."""
    operands = [a for a in call.args if _is_tensor(a)]
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
    na, nb = _ndim(a.ty), _ndim(b.ty)
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
    ndim = _ndim(x.ty)
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
    ndim = _ndim(x.ty)
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
    operands = [a for a in call.args if _is_tensor(a)]
    data, params = operands[0], operands[1:]
    ndim = _ndim(data.ty)
    if ndim is None:
        return None
    axes = _axes(call.attrs.axes, ndim)
    namer = _Namer()
    labels = namer.many(ndim)
    normalised = tuple(labels[a] for a in axes)
    namer.unshardable.update(normalised)
    for p in params:
        if _ndim(p.ty) != len(normalised):
            return None
    return namer.signature(operands, [labels] + [normalised] * len(params), [labels])


# --------------------------------------------------------------------------- layout
@register_signature("relax.permute_dims")
def _permute_dims(call: relax.Call, mod: tvm.IRModule) -> OpSignature | None:
    """``permute_dims``: the result's labels are the operand's, permuted (None: reversed)."""
    x = call.args[0]
    ndim = _ndim(x.ty)
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
    ndim = _ndim(x.ty)
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
    ndim = _ndim(x.ty)
    if ndim is None:
        return None
    if call.attrs.axis is None:
        dims = _dims(x)
        if dims is None or any(_static(d) is None for d in dims):
            return None
        removed = {i for i, d in enumerate(dims) if _static(d) == 1}
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
    if not fields or not all(_is_tensor(f) for f in fields):
        return None
    ndim = _ndim(fields[0].ty)
    if ndim is None or ndim == 0 or any(_ndim(f.ty) != ndim for f in fields):
        return None
    namer = _Namer()
    labels = namer.many(ndim)
    namer.unshardable.add(labels[_axis(call.attrs.axis, ndim)])
    return namer.signature(fields, [labels] * len(fields), [labels])


@register_signature("relax.split")
def _split(call: relax.Call, mod: tvm.IRModule) -> OpSignature | None:
    """``split``: every field of the result has the operand's labels; the axis is unshardable."""
    x = call.args[0]
    ndim = _ndim(x.ty)
    outputs = _output_types(call.ty)
    if ndim is None or ndim == 0 or outputs is None or not isinstance(call.ty, relax.TupleType):
        return None
    namer = _Namer()
    labels = namer.many(ndim)
    namer.unshardable.add(labels[_axis(call.attrs.axis, ndim)])
    return namer.signature([x], [labels], [labels] * len(outputs))


@register_signature("relax.reshape")
def _reshape(call: relax.Call, mod: tvm.IRModule) -> OpSignature | None:
    """``reshape``: match groups of consecutive dims whose extents multiply equally.

    Static shapes only (a symbolic reshape is described only when input and
    output shapes are identical). Within a group only the major-most non-1
    input dim and the major-most non-1 output dim share a label, and only when
    their extents have a common factor (otherwise no shard count can divide
    both); every other dim gets a fresh unshardable label. The solver must
    still check that a shard count divides both extents.
    """
    x = call.args[0]
    src, dst = _dims(x), _dims(call.ty)
    if src is None or dst is None:
        return None
    namer = _Namer()
    symbolic = any(_static(a) is None for a in src)
    if symbolic and len(src) == len(dst) and all(_same_extent(a, b) for a, b in zip(src, dst)):
        labels = namer.many(len(src))
        return namer.signature([x], [labels], [labels])
    s = [_static(d) for d in src]
    t = [_static(d) for d in dst]
    if None in s or None in t or 0 in s or 0 in t or math.prod(s) != math.prod(t):
        return None
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


# --------------------------------------------------------------------------- call_tir
@register_signature("relax.call_tir")
def _call_tir(call: relax.Call, mod: tvm.IRModule) -> OpSignature | None:
    """``call_tir``: the signature of the called PrimFunc's access patterns."""
    callee, args = call.args[0], call.args[1]
    if not isinstance(callee, tvm.ir.GlobalVar) or not isinstance(args, relax.Tuple):
        return None
    try:
        func = mod[callee]
    except Exception:  # noqa: BLE001 - not in the module
        logger.debug("call_tir of %s, which the module does not have", callee.name_hint)
        return None
    if not isinstance(func, tirx.PrimFunc):
        return None
    outputs = _output_types(call.ty_args[0]) if len(call.ty_args) else None
    operands = list(args.fields)
    if outputs is None or not all(_is_tensor(o) for o in operands):
        return None
    template = prim_func_signature(func, len(operands))
    if template is None:
        return None
    in_labels, out_labels, unshardable = template
    if len(out_labels) != len(outputs):
        return None
    return OpSignature(tuple(operands), in_labels, out_labels, unshardable)


@functools.lru_cache(maxsize=1024)
def prim_func_signature(
    func: tirx.PrimFunc, num_inputs: int
) -> tuple[tuple[Labels, ...], tuple[Labels, ...], frozenset[str]] | None:
    """Labels of a destination-passing-style PrimFunc's buffer parameters.

    Parameters
    ----------
    func : tirx.PrimFunc
        The function; its first ``num_inputs`` buffer parameters are inputs, the
        other buffer parameters outputs.
    num_inputs : int
        How many buffer parameters are inputs.

    Returns
    -------
    tuple or None
        ``(input_labels, output_labels, unshardable)``, or None when the
        function cannot be analysed.

    Notes
    -----
    Every ``SBlock`` relates each buffer dimension indexed by exactly one of
    its iteration variables to that variable; a union-find over all blocks
    turns the relations into labels, chaining through intermediate buffers.
    A class of related dims is unshardable when any member is unsafe: a dim
    indexed by anything other than a bare iteration variable (``i + 1``,
    ``i // 2``, a constant), an iteration variable used outside an index or
    whose domain differs from the dim's extent, a spatial variable missing from
    the block's write, a buffer used other than by loads and stores, or a
    class holding two dims of one buffer. A class with reduction variables is
    shardable (as a reduction label) only when every such block is a sum
    (``init`` zero, ``W[I] = W[I] + e``) whose result reaches the outputs
    through linear scaling only; it is unshardable if it reaches an output dim.
    """
    try:
        return _PrimFuncAnalysis(func, num_inputs).run()
    except Exception:  # noqa: BLE001 - unknown IR shapes: no signature
        logger.debug("call_tir analysis failed", exc_info=True)
        return None


_normalize_to_iter_sum = tvm.sym.iter_affine_map.normalize_to_iter_sum
_WALK_SKIP = tvm_ffi.WalkResult.SKIP
_DATA_PAR = int(tirx.IterVar.DataPar)
_COMM_REDUCE = int(tirx.IterVar.CommReduce)


def _is_buffer(value) -> bool:
    return tirx.is_buffer_var(value)


def _is_zero(expr) -> bool:
    return isinstance(expr, (tirx.IntImm, tirx.FloatImm)) and float(expr.value) == 0.0


def _is_float(expr) -> bool:
    ty = getattr(expr, "ty", None)
    dtype = getattr(ty, "dtype", None)
    return dtype is not None and str(dtype).startswith(("float", "bfloat"))


def _has_load(expr) -> bool:
    found = []
    tvm_ffi.structural_walk(expr, [(tvm.ir.TensorLoad, lambda _: found.append(True))])
    return bool(found)


@dataclass
class _BlockInfo:
    """What one SBlock does, as seen by the analysis.

    An iteration variable ``v`` appears in an index as a *major* part (``v``
    itself, or ``v // L`` covering all of ``v``: the dim is ``v``'s extent / L
    and sharding ``v`` in p contiguous pieces shards the dim the same way) or
    as a *minor* part (``v % m``, ``v // l % e``, or a non-leading term of a
    fused index ``u * s + v``), which only keeps its meaning on a shard of
    ``v`` when the shard size is a multiple of ``l * e``.
    """

    block: SBlock | None
    iter_nodes: list = field(default_factory=list)  # node per iteration variable
    iter_types: list[int] = field(default_factory=list)
    dom_map: dict = field(default_factory=dict)  # iteration Var -> Range
    loads: list = field(default_factory=list)  # buffer indices read
    stores: list = field(default_factory=list)  # buffer indices written
    majors: dict = field(default_factory=dict)  # node -> set of L of single-part majors
    fused: list = field(default_factory=list)  # nodes leading a fused index
    minors: list = field(default_factory=list)  # (node, l * e)
    store_major: list = field(default_factory=list)  # per store: nodes it indexes by (major)
    store_any: list = field(default_factory=list)  # per store: nodes in its indices at all


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict = {}

    def find(self, node):
        self.parent.setdefault(node, node)
        root = node
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[node] != root:
            self.parent[node], node = root, self.parent[node]
        return root

    def union(self, a, b) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra


class _PrimFuncAnalysis:
    """Union-find over (buffer, dim) and (block, iteration variable) nodes.

    Buffers are identified by their position in :attr:`buffers` (parameters
    first), so nodes are plain hashable tuples: ``("b", buffer_index, dim)``
    and ``("v", block_index, var_index)``.
    """

    def __init__(self, func: tirx.PrimFunc, num_inputs: int) -> None:
        self.func = func
        self.params = [p for p in func.params if _is_buffer(p)]
        self.num_inputs = num_inputs
        self.buffers: list = []
        self.buffer_index: dict = {}
        for p in self.params:
            self._buffer(p)
        self.uf = _UnionFind()
        self.unsafe: set = set()
        self.blocks: list[_BlockInfo] = []
        self.iter_var_node: dict = {}  # iteration Var -> node
        self.escaped: set[int] = set()  # buffers used other than by loads/stores
        self.loose: set[int] = set()  # buffers accessed outside any block
        self.analyzer = tvm.sym.Analyzer()

    # -- buffers
    def _buffer(self, var) -> int:
        index = self.buffer_index.get(var)
        if index is None:
            index = len(self.buffers)
            self.buffers.append(var)
            self.buffer_index[var] = index
        return index

    def _shape(self, index: int) -> list:
        return list(self.buffers[index].ty.shape)

    def _dim_node(self, index: int, dim: int):
        node = ("b", index, dim)
        self.uf.find(node)
        return node

    # -- walking
    def run(self):
        if self.num_inputs > len(self.params) or self.num_inputs < 0:
            return None
        self._walk(self.func.body, None)
        if not any(info.iter_nodes for info in self.blocks):
            return None  # no schedulable block: nothing learnt
        self._finish_blocks()
        return self._labels()

    def _walk(self, node, block: _BlockInfo | None) -> None:
        def on_realize(realize):
            if not (isinstance(realize.predicate, tirx.IntImm) and int(realize.predicate.value) == 1):
                self._walk(realize.predicate, block)
                self._block(realize.block, safe=False)
            else:
                self._block(realize.block, safe=True)
            for value in realize.iter_values:
                self._walk(value, block)
            return _WALK_SKIP

        def on_block(blk):  # an SBlock outside an SBlockRealize
            self._block(blk, safe=False)
            return _WALK_SKIP

        def on_load(load):
            self._access(load.source, list(load.indices), block, store=False)
            return _WALK_SKIP

        def on_store(store):
            self._access(store.buffer, list(store.indices), block, store=True)
            self._walk(store.value, block)
            return _WALK_SKIP

        def on_alloc(alloc):
            self._buffer(alloc.buffer)
            return _WALK_SKIP

        def on_var(var):
            self._other_use(var)
            return _WALK_SKIP

        tvm_ffi.structural_walk(
            node,
            [
                (SBlockRealize, on_realize),
                (SBlock, on_block),
                (tvm.ir.TensorLoad, on_load),
                (tirx.BufferStore, on_store),
                (tirx.AllocBuffer, on_alloc),
                (tvm.ir.Var, on_var),
            ],
            order="pre",
        )

    def _other_use(self, var) -> None:
        """A variable used outside an index position."""
        node = self.iter_var_node.get(var)
        if node is not None:
            self.unsafe.add(node)
        elif _is_buffer(var):
            self.escaped.add(self._buffer(var))

    def _block(self, blk: SBlock, safe: bool) -> None:
        info = _BlockInfo(blk)
        bid = len(self.blocks)
        self.blocks.append(info)
        for k, iv in enumerate(blk.iter_vars):
            node = ("v", bid, k)
            self.uf.find(node)
            info.iter_nodes.append(node)
            info.iter_types.append(int(iv.iter_type))
            self.iter_var_node[iv.var] = node
            info.dom_map[iv.var] = iv.dom
            try:  # the ranges let ``v % extent`` simplify to ``v``
                self.analyzer.bind(iv.var, iv.dom)
            except Exception:  # noqa: BLE001 - an unbindable range only loses precision
                logger.debug("cannot bind the range of %s", iv.var)
            if not safe or int(iv.iter_type) not in (_DATA_PAR, _COMM_REDUCE):
                self.unsafe.add(node)
            if _static(iv.dom.min) != 0:
                self.unsafe.add(node)
        for alloc in blk.alloc_buffers:
            self._buffer(alloc)
        for match in blk.match_buffers:
            self.escaped.add(self._buffer(match.buffer))
            self._walk(match.source, info)  # the source buffer var escapes
        if blk.init is not None:
            self._walk(blk.init, info)
        self._walk(blk.body, info)

    def _iter_dom(self, node):
        _, bid, k = node
        return self.blocks[bid].block.iter_vars[k].dom

    def _access(self, var, indices: list, block: _BlockInfo | None, store: bool) -> None:
        index = self._buffer(var)
        shape = self._shape(index)
        if block is None:
            self.loose.add(index)
        else:
            (block.stores if store else block.loads).append(index)
        nodes = [self._dim_node(index, d) for d in range(len(shape))]
        major: set = set()
        anywhere: set = set()
        if store and block is not None:
            block.store_major.append(major)
            block.store_any.append(anywhere)
        if len(indices) != len(shape) or block is None:
            self.unsafe.update(nodes)
            for expr in indices:
                self._walk(expr, block)
            return
        for d, expr in enumerate(indices):
            simple = self._simplify(expr)
            node = self.iter_var_node.get(simple) if isinstance(simple, tvm.ir.Var) else None
            if node is not None and node in block.iter_nodes:  # a bare variable
                self.uf.union(nodes[d], node)
                if not self._equal(self._iter_dom(node).extent, shape[d]):
                    self.unsafe.add(nodes[d])
                    self.unsafe.add(node)
                block.majors.setdefault(node, set()).add(1)
                major.add(node)
                anywhere.add(node)
                continue
            parts = None if _has_load(expr) else self._affine_parts(simple, block)
            if not parts:  # a constant, a load, or not affine in this block's variables
                self.unsafe.add(nodes[d])
                # every iteration variable the index really uses becomes unsafe
                self._walk(expr if _has_load(expr) else simple, block)
                continue
            anywhere.update(p[0] for p in parts)
            if not self._is_mixed_radix(parts, shape[d]):
                self.unsafe.add(nodes[d])
                self.unsafe.update(p[0] for p in parts)
                continue
            lead, lower, extent, _ = parts[0]
            if lower * extent == _static(self._iter_dom(lead).extent):
                self.uf.union(nodes[d], lead)
                major.add(lead)
                if len(parts) == 1:
                    block.majors.setdefault(lead, set()).add(lower)
                elif lower == 1:
                    block.fused.append(lead)
                else:
                    self.unsafe.add(nodes[d])
                    self.unsafe.add(lead)
            else:
                self.unsafe.add(nodes[d])
                block.minors.append((lead, lower * extent))
            for node, lower, extent, _ in parts[1:]:
                block.minors.append((node, lower * extent))

    def _affine_parts(self, expr, block: _BlockInfo) -> list | None:
        """``expr`` as ``sum(((v // lower) % extent) * scale)`` over this block's variables.

        Returns ``[(node, lower, extent, scale), ...]`` by decreasing scale, ``[]``
        for a constant, None when ``expr`` has another form (an offset, other
        variables, symbolic factors).
        """
        if not block.dom_map:
            return None
        try:
            iter_sum = _normalize_to_iter_sum(expr, block.dom_map, self.analyzer)
        except Exception:  # noqa: BLE001 - not an affine index
            return None
        if _static(iter_sum.base) != 0:
            return None
        parts = []
        for split in iter_sum.args:
            source = split.source.source
            node = self.iter_var_node.get(source) if isinstance(source, tvm.ir.Var) else None
            numbers = [_static(split.lower_factor), _static(split.extent), _static(split.scale)]
            if node is None or node not in block.iter_nodes or None in numbers:
                return None
            parts.append((node, *numbers))
        parts.sort(key=lambda p: -p[3])
        return parts

    @staticmethod
    def _is_mixed_radix(parts: list, dim_extent) -> bool:
        """The parts tile ``[0, dim_extent)`` exactly, like the digits of a number."""
        extent = _static(dim_extent)
        if extent is None or parts[-1][3] != 1:
            return False
        for (_, _, _, scale), (_, _, inner_extent, inner_scale) in zip(parts, parts[1:]):
            if scale != inner_scale * inner_extent:
                return False
        return parts[0][3] * parts[0][2] == extent

    def _simplify(self, expr):
        """``expr`` simplified with the known iteration ranges (itself on failure)."""
        if isinstance(expr, (tvm.ir.Var, tirx.IntImm)):
            return expr
        try:
            return self.analyzer.simplify(expr)
        except Exception:  # noqa: BLE001 - not simplifiable: keep it as written
            return expr

    def _equal(self, a, b) -> bool:
        sa, sb = _static(a), _static(b)
        if sa is not None and sb is not None:
            return sa == sb
        if tvm_ffi.structural_equal(a, b):
            return True
        try:
            return bool(self.analyzer.can_prove_equal(a, b))
        except Exception:  # noqa: BLE001 - dtype mismatch and the like
            return False

    # -- after the walk
    def _finish_blocks(self) -> None:
        for info in self.blocks:
            for node, kind in zip(info.iter_nodes, info.iter_types):
                written = [node in indexed for indexed in info.store_major]
                if kind == _DATA_PAR and not (written and all(written)):
                    self.unsafe.add(node)  # a store that does not depend on it: no sharding
                if kind == _COMM_REDUCE and any(node in indexed for indexed in info.store_any):
                    self.unsafe.add(node)
            # A minor part ``v // l % e`` reads the same on a shard of ``v`` only when
            # the shard size is a multiple of ``l * e``. A shard of ``v`` is a multiple
            # of every L of its majors (the solver divides each related dim, whose
            # extent is extent(v) / L), so ``l * e`` must divide the largest L.
            for node, period in info.minors:
                factors = info.majors.get(node)
                if not factors or max(factors) % period:
                    self.unsafe.add(node)
            # A fused index ``v * s + ...`` stays aligned only when shards of ``v``
            # divide extent(v): some dim related to ``v`` must have that extent.
            for node in info.fused:
                if 1 not in info.majors.get(node, set()):
                    self.unsafe.add(node)
        for index in self.escaped:
            for d in range(len(self._shape(index))):
                self.unsafe.add(self._dim_node(index, d))

    def _classes(self) -> dict:
        classes: dict = {}
        for node in list(self.uf.parent):
            classes.setdefault(self.uf.find(node), []).append(node)
        return classes

    def _labels(self):
        outputs = set(range(self.num_inputs, len(self.params)))
        classes = self._classes()
        unsafe_roots = set()
        for root, members in classes.items():
            dims_of = [n[1] for n in members if n[0] == "b"]
            vars_of = [n[1] for n in members if n[0] == "v"]
            reduce_nodes = [n for n in members
                            if n[0] == "v" and self.blocks[n[1]].iter_types[n[2]] == _COMM_REDUCE]
            if (any(n in self.unsafe for n in members)
                    or len(dims_of) != len(set(dims_of))
                    or len(vars_of) != len(set(vars_of))):
                unsafe_roots.add(root)
                continue
            in_output = any(b in outputs for b in dims_of)
            if reduce_nodes:
                if in_output or not self._partial_sum_ok(reduce_nodes, outputs):
                    unsafe_roots.add(root)
            elif not in_output:
                unsafe_roots.add(root)  # an input axis the outputs do not depend on
        # name the classes in order of first appearance over the parameters
        names: dict = {}
        unshardable: set[str] = set()
        counter = [0]

        def fresh() -> str:
            label = f"d{counter[0]}"
            counter[0] += 1
            return label

        per_param = []
        for index in range(len(self.params)):
            labels = []
            for d in range(len(self._shape(index))):
                root = self.uf.find(("b", index, d))
                label = names.get(root)
                if label is None:
                    label = names[root] = fresh()
                    if root in unsafe_roots:
                        unshardable.add(label)
                if label in labels:  # cannot happen for a safe class
                    label = fresh()
                    unshardable.add(label)
                labels.append(label)
            per_param.append(tuple(labels))
        return (
            tuple(per_param[: self.num_inputs]),
            tuple(per_param[self.num_inputs:]),
            frozenset(unshardable),
        )

    # -- partial sums
    def _partial_sum_ok(self, reduce_nodes: list, outputs: set[int]) -> bool:
        """Whether sharding the reduction in these blocks gives a partial sum of the outputs."""
        writers: dict[int, set[int]] = {}
        readers: dict[int, set[int]] = {}
        for bid, info in enumerate(self.blocks):
            for b in info.stores:
                writers.setdefault(b, set()).add(bid)
            for b in info.loads:
                readers.setdefault(b, set()).add(bid)
        pending = []
        for node in reduce_nodes:
            bid = node[1]
            target = self._sum_target(bid)
            if target is None:
                return False
            pending.append((target, bid))
        seen = set()
        while pending:
            buffer, writer = pending.pop()
            if (buffer, writer) in seen:
                continue
            seen.add((buffer, writer))
            if (buffer in self.escaped or buffer in self.loose
                    or writers.get(buffer, set()) != {writer}):
                return False
            # a partial buffer may only be scaled into other partial buffers (an
            # output, or an intermediate that is itself only scaled or dead)
            for reader in readers.get(buffer, set()) - {writer}:
                target = self._scale_target(reader, buffer)
                if target is None:
                    return False
                pending.append((target, reader))
        return True

    def _sum_target(self, bid: int) -> int | None:
        """The buffer a block sums into (``init`` 0, ``W[I] = W[I] + e``), else None."""
        blk = self.blocks[bid].block
        body, init = blk.body, blk.init
        if not isinstance(body, tirx.BufferStore) or not isinstance(init, tirx.BufferStore):
            return None
        if not init.buffer.same_as(body.buffer) or not _is_zero(init.value):
            return None
        if not tvm_ffi.structural_equal(list(init.indices), list(body.indices)):
            return None
        value = body.value
        if not isinstance(value, tirx.Add):
            return None
        for acc, other in ((value.a, value.b), (value.b, value.a)):
            if (isinstance(acc, tvm.ir.TensorLoad) and acc.source.same_as(body.buffer)
                    and tvm_ffi.structural_equal(list(acc.indices), list(body.indices))
                    and not self._loads_buffer(other, body.buffer)):
                return self.buffer_index.get(body.buffer)
        return None

    def _scale_target(self, bid: int, source: int) -> int | None:
        """The buffer a spatial block writes as ``c * source[I]`` (c free of loads), else None."""
        info = self.blocks[bid]
        blk = info.block
        if blk is None or blk.init is not None or _COMM_REDUCE in info.iter_types:
            return None
        body = blk.body
        if not isinstance(body, tirx.BufferStore):
            return None
        if info.loads.count(source) != 1 or len(info.loads) != 1:
            return None
        if not self._linear_in_load(body.value):
            return None
        return self.buffer_index.get(body.buffer)

    def _linear_in_load(self, expr) -> bool:
        """``expr`` is ``load``, ``load * c``, ``c * load``, float ``load / c`` or a float cast.

        Integer division and casts to or from integers truncate, so a sum of
        their partial results differs from the result of the sum.
        """
        if isinstance(expr, tvm.ir.TensorLoad):
            return True
        if isinstance(expr, tirx.Cast):
            return (_is_float(expr) and _is_float(expr.value)
                    and self._linear_in_load(expr.value))
        if isinstance(expr, tirx.Mul):
            if not _has_load(expr.b):
                return self._linear_in_load(expr.a)
            if not _has_load(expr.a):
                return self._linear_in_load(expr.b)
            return False
        if isinstance(expr, tirx.Div):
            return _is_float(expr) and not _has_load(expr.b) and self._linear_in_load(expr.a)
        return False

    @staticmethod
    def _loads_buffer(expr, buffer) -> bool:
        found = []

        def on_load(load):
            if load.source.same_as(buffer):
                found.append(True)

        tvm_ffi.structural_walk(expr, [(tvm.ir.TensorLoad, on_load)])
        return bool(found)
