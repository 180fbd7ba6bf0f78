"""Einsum-like rule strings: ``"mk,kn->mn"`` read as an :class:`OpSignature` of one call.

An operator rule says which dimensions of a call's operands and results are one
logical axis (see :mod:`tvm_distx.passes.op_signatures`). Most operators say it in
a few characters, as an einsum string does (PyTorch DTensor writes its matmul
strategies the same way, JAX's ``custom_partitioning`` takes such a string as its
``sharding_rule``):

* one term per operand, ``,``-separated, then ``->`` and one term per result (a
  tuple result lists its fields, ``"abc->abc,abc"``; an empty term is a scalar);
* a term is one letter per dimension (``a``-``z``, ``A``-``Z``); equal letters in
  different tensors are one axis; a letter in no result is a reduction, which a
  split turns into a partial sum (completed by an all-reduce);
* ``1`` is a dimension of size one that is not one of the axes (a ``keepdims``
  or an ``expand_dims``): it gets a label of its own, never split;
* ``...`` at the start of a term stands for any number of leading batch
  dimensions, broadcast numpy-style (right-aligned) against the other operands'
  ``...``: equal extents are one axis, a size 1 against a larger extent is a
  dimension of its own, never split. Every result term with ``...`` gets the
  broadcast batch dimensions;
* spaces are ignored.

``unshardable`` (letters) names the axes that must stay whole: a softmax axis, a
reduction that is not a sum (``max``, ``variance``).

This module owns the syntax (:func:`parse_einsum`, which raises
:class:`~tvm_distx.errors.RuleError` on a malformed string) and how a parsed
string labels one call (:func:`einsum_signature`, :func:`einsum`). Labels are
``d0``, ``d1``, ... in order of first appearance (the ``...`` dimensions first),
the same names the rules written by hand used.

Examples
--------
>>> spec = parse_einsum("...mk,...kn->...mn")
>>> einsum(matmul_call, "...mk,...kn->...mn")   # (4, 8) x (8, 16)
OpSignature(..., labels=(('d0', 'd1'), ('d1', 'd2')), output=(('d0', 'd2'),), ...)
"""

from __future__ import annotations

import functools
import re
import string
from dataclasses import dataclass
from typing import Sequence

import tvm
import tvm_ffi
from tvm import relax

from tvm_distx.errors import RuleError
from tvm_distx.passes.op_signatures import (Labels, OpSignature, is_tensor, output_types,
                                            static_int, tensor_ndim, tensor_type)

__all__ = ["ELLIPSIS", "EinsumSpec", "einsum", "einsum_signature", "letters", "parse_einsum"]

#: The token of a term's leading batch dimensions.
ELLIPSIS = "..."
#: The token of a size-1 dimension with a label of its own.
SIZE_ONE = "1"
_LETTERS = string.ascii_letters
_HINT = ('write one term per operand, "->", one term per result: one letter per dimension, '
         '"1" for a size-1 dimension, "..." first for leading batch dimensions, for example '
         '"...mk,...kn->...mn"')


# --------------------------------------------------------------------------- the syntax
@dataclass(frozen=True)
class EinsumSpec:
    """A parsed rule string.

    Parameters
    ----------
    text : str
        The string as written.
    operands, results : tuple of tuple of str
        Per operand and per result, its tokens: letters, ``"1"`` and a leading ``"..."``.
    unshardable : frozenset of str
        Letters that must not be split.
    """

    text: str
    operands: tuple[tuple[str, ...], ...]
    results: tuple[tuple[str, ...], ...]
    unshardable: frozenset[str] = frozenset()

    def reductions(self) -> frozenset[str]:
        """Letters of some operand that no result has (summed axes)."""
        produced = {t for term in self.results for t in term}
        return frozenset(t for term in self.operands for t in term
                         if t in _LETTERS and t not in produced)


@functools.lru_cache(maxsize=512)
def parse_einsum(text: str, unshardable: str = "") -> EinsumSpec:
    """Read a rule string (see the module's documentation for the syntax).

    Parameters
    ----------
    text : str
        For example ``"mk,kn->mn"``.
    unshardable : str
        Letters of ``text`` that must not be split.

    Returns
    -------
    EinsumSpec

    Raises
    ------
    RuleError
        When the string is malformed, naming the fault.
    """
    if not isinstance(text, str) or not isinstance(unshardable, str):
        raise RuleError(f"a rule string must be a str, got {type(text).__name__}", hint=_HINT)
    compact = re.sub(r"\s+", "", text)
    if compact.count("->") != 1:
        raise RuleError(f"rule {text!r} needs exactly one '->' between operands and results",
                        hint=_HINT)
    left, right = compact.split("->")
    operands = tuple(_term(t, text) for t in left.split(","))
    results = tuple(_term(t, text) for t in right.split(","))
    seen = {t for term in operands for t in term}
    for term in results:
        for token in term:
            if token not in seen and token != SIZE_ONE:
                raise RuleError(f"rule {text!r}: result dimension {token!r} is in no operand",
                                hint="every letter of a result names an operand's dimension "
                                '(write "1" for a new dimension of size one)')
    if ELLIPSIS in seen and not any(ELLIPSIS in term for term in results):
        raise RuleError(f"rule {text!r}: operands have '...' but no result does",
                        hint='give the result the batch dimensions too: "...k->..."')
    pinned = frozenset(re.sub(r"\s+", "", unshardable))
    unknown = sorted(pinned - seen)
    if unknown:
        raise RuleError(f"unshardable={unshardable!r} names {''.join(unknown)!r}, which "
                        f"rule {text!r} does not have", hint="name letters of the rule's operands")
    return EinsumSpec(text, operands, results, pinned)


def _term(term: str, text: str) -> tuple[str, ...]:
    """The tokens of one term, checked."""
    tokens: list[str] = []
    rest = term
    if rest.startswith(ELLIPSIS):
        tokens.append(ELLIPSIS)
        rest = rest[len(ELLIPSIS):]
    for char in rest:
        if char == ".":
            raise RuleError(f"rule {text!r}: '...' may only start a term (in {term!r})", hint=_HINT)
        if char not in _LETTERS and char != SIZE_ONE:
            raise RuleError(f"rule {text!r}: {char!r} is not a dimension (in {term!r})", hint=_HINT)
        if char in tokens and char != SIZE_ONE:
            raise RuleError(f"rule {text!r}: {char!r} appears twice in the term {term!r}",
                            hint="one tensor cannot have the same axis twice")
        tokens.append(char)
    return tuple(tokens)


def letters(n: int) -> str | None:
    """``n`` distinct letters (``"abc"`` for 3), to build a rule string for a rank; None past 52."""
    return _LETTERS[:n] if n <= len(_LETTERS) else None


# --------------------------------------------------------------------------- labelling a call
def einsum(call: relax.Call, text: str, operands: Sequence[relax.Expr] | None = None, *,
           unshardable: str = "") -> OpSignature | None:
    """The signature ``text`` gives ``call``; None when the ranks do not fit it.

    Parameters
    ----------
    call : relax.Call
        The call; its results are read from its type.
    text : str
        The rule string.
    operands : sequence of relax.Expr, optional
        The tensors the operand terms describe, in order (default: the call's
        tensor arguments).
    unshardable : str
        Letters that must not be split.

    Returns
    -------
    OpSignature or None
    """
    if operands is None:
        operands = [a for a in call.args if is_tensor(a)]
    return einsum_signature(parse_einsum(text, unshardable), operands, output_types(call.ty))


def einsum_signature(spec: EinsumSpec, operands: Sequence[relax.Expr], outputs: Sequence | None,
                     *, strict: bool = False, what: str = "") -> OpSignature | None:
    """Label ``operands`` and ``outputs`` (tensor types) as ``spec`` says.

    Parameters
    ----------
    spec : EinsumSpec
        The parsed rule.
    operands : sequence of relax.Expr
        The call's tensor operands, one per operand term.
    outputs : sequence of types, or None
        The call's result types, one per result term.
    strict : bool
        Raise :class:`~tvm_distx.errors.RuleError` when the tensors do not fit
        the rule (a user's rule), instead of returning None (a built-in one).
    what : str
        The operator or kernel, for the error's message.

    Returns
    -------
    OpSignature or None
        None (without ``strict``) when counts or ranks do not fit, or when
        broadcast batch extents cannot be decided statically.
    """
    def misfit(message: str) -> None:
        if strict:
            raise RuleError(f"rule {spec.text!r} of {what}: {message}",
                            hint="give one term per operand and per result, with one letter "
                            "per dimension (or start the term with '...')")
        return None

    if len(operands) != len(spec.operands):
        return misfit(f"{len(spec.operands)} operand terms, but the call has "
                      f"{len(operands)} tensor operands")
    if outputs is None or len(outputs) != len(spec.results):
        return misfit(f"{len(spec.results)} result terms, but the call has "
                      f"{'no tensor result' if outputs is None else len(outputs)} results")
    ranks = [tensor_ndim(o.ty) for o in operands]
    out_ranks = [tensor_ndim(t) for t in outputs]
    batch = []  # per operand: its number of '...' dims, None without '...'
    for i, (term, rank) in enumerate(zip(spec.operands, ranks)):
        if rank is None:
            return None
        named = len(term) - (ELLIPSIS in term)
        if rank < named or (ELLIPSIS not in term and rank != named):
            name = operands[i].name if isinstance(operands[i], relax.Var) else f"#{i}"
            return misfit(f"operand {i} ('{name}') has rank {rank}, but its term "
                          f"{''.join(term)!r} names {named} dimensions")
        batch.append(rank - named if ELLIPSIS in term else None)
    namer = Namer()
    batch_labels = _batch_labels(namer, operands, batch)
    if batch_labels is None:
        return None
    per, out_batch = batch_labels
    by_letter: dict[str, str] = {}

    def label(token: str) -> str:
        if token == SIZE_ONE:
            return namer.fresh(unshardable=True)
        if token not in by_letter:
            by_letter[token] = namer.fresh(unshardable=token in spec.unshardable)
        return by_letter[token]

    labels = [[*(per[i] if ELLIPSIS in term else []), *(label(t) for t in term if t != ELLIPSIS)]
              for i, term in enumerate(spec.operands)]
    out = []
    for j, (term, rank) in enumerate(zip(spec.results, out_ranks)):
        row = [*(out_batch if ELLIPSIS in term else []), *(label(t) for t in term if t != ELLIPSIS)]
        if rank != len(row):
            return misfit(f"result {j} has rank {rank}, but its term {''.join(term)!r} "
                          f"gives {len(row)} dimensions")
        out.append(row)
    if strict:
        clash = _extent_clash(labels, operands, out, outputs)
        if clash is not None:
            return misfit(clash)
    return namer.signature(operands, labels, out)


def _extent_clash(labels, operands, out, outputs) -> str | None:
    """Two static extents of one axis that differ (a user's rule that names them alike)."""
    seen: dict[str, tuple[int, str]] = {}
    tensors = [(f"operand {i}", row, dims(o)) for i, (row, o) in enumerate(zip(labels, operands))]
    tensors += [(f"result {j}", row, dims(t)) for j, (row, t) in enumerate(zip(out, outputs))]
    for where, row, shape in tensors:
        for label, extent in zip(row, shape or ()):
            value = static_int(extent)
            if value is None:
                continue
            if label in seen and seen[label][0] != value:
                return (f"one axis is {seen[label][0]} long in {seen[label][1]} but {value} "
                        f"in {where}")
            seen.setdefault(label, (value, where))
    return None


def _batch_labels(namer: "Namer", operands, batch: list) -> tuple[list, list] | None:
    """Labels of the ``...`` dims of each operand, and of the result's, broadcast."""
    with_batch = [i for i, b in enumerate(batch) if b is not None]
    if len(with_batch) == 1 or not any(batch[i] for i in with_batch):
        # one operand: its batch dims are the result's, nothing to broadcast
        only = with_batch[0] if with_batch else None
        labels = namer.many(batch[only]) if only is not None else ()
        return {i: list(labels) for i in with_batch}, list(labels)
    shapes = [dims(operands[i]) for i in with_batch]
    if any(s is None for s in shapes):
        return None
    result = broadcast(namer, [s[:batch[i]] for i, s in zip(with_batch, shapes)])
    if result is None:
        return None
    per, out = result
    return dict(zip(with_batch, per)), out


# --------------------------------------------------------------------------- shared helpers
def dims(expr_or_ty) -> tuple[tvm.ir.Expr, ...] | None:
    """The shape of a tensor as PrimExprs, None when unknown."""
    ty = expr_or_ty if isinstance(expr_or_ty, tvm.ir.Type) else getattr(expr_or_ty, "ty", None)
    tensor = tensor_type(ty)
    if tensor is None or tensor.ndim < 0 or not isinstance(tensor.shape, relax.ShapeExpr):
        return None
    return tuple(tensor.shape.values)


def same_extent(a, b) -> bool:
    """Whether two extents are provably equal (two static ints, or one symbolic expression)."""
    sa, sb = static_int(a), static_int(b)
    if sa is not None or sb is not None:
        return sa is not None and sa == sb
    return bool(tvm_ffi.structural_equal(a, b))


class Namer:
    """Deterministic label factory (``d0``, ``d1``, ...) that tracks unshardable labels."""

    def __init__(self) -> None:
        self.count = 0
        self.unshardable: set[str] = set()

    def fresh(self, unshardable: bool = False) -> str:
        """A new label."""
        label = f"d{self.count}"
        self.count += 1
        if unshardable:
            self.unshardable.add(label)
        return label

    def many(self, n: int) -> Labels:
        """``n`` new labels."""
        return tuple(self.fresh() for _ in range(n))

    def signature(self, operands, labels, output) -> OpSignature:
        """The signature of these labels."""
        return OpSignature(
            operands=tuple(operands),
            labels=tuple(tuple(x) for x in labels),
            output=tuple(tuple(x) for x in output),
            unshardable=frozenset(self.unshardable),
        )


def broadcast(namer: Namer, shapes: Sequence[Sequence]) -> tuple[list[list[str]], list[str]] | None:
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
            if any(not same_extent(ref, ext) for _, _, ext in wide):
                return None
            for i, d, ext in members:
                per[i][d] = label if static_int(ext) != 1 else namer.fresh(unshardable=True)
        out.append(label)
    return per, out
