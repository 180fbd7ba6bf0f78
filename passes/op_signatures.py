"""Einsum-style signatures of Relax operator calls: the data model and the rule registry.

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

This module owns the :class:`OpSignature` data model, the registry of rules
(:func:`register_signature`, :func:`registered_ops`), the lookup
:func:`op_signature` that checks what a rule returns against the call's types,
and the tensor-type helpers rules share. The rules themselves live elsewhere:

* :mod:`tvm_distx.passes.relax_op_rules`: one rule per Relax operator
  (elementwise, matmul, reductions, normalisation, layout changes);
* :mod:`tvm_distx.passes.tir_access`: the ``relax.call_tir`` rule, which reads
  the access patterns of the called ``PrimFunc``.

A ``call_tir`` kernel can have a rule of its own, registered by the name of its
``PrimFunc`` (:func:`register_kernel_signature`); it wins over reading the
PrimFunc's accesses. Users register both kinds as strings with
:func:`tvm_distx.register_sharding_rule` (:mod:`tvm_distx.passes.user_rules`).

Importing :mod:`tvm_distx.passes` registers both. Rules are plain functions
registered per operator name (like PyTorch DTensor's sharding strategies, but
returning data). Every rule is conservative: when it is unsure it returns
``None`` (the solver then replicates) or marks a label unshardable. Both are
always correct.

Examples
--------
>>> sig = op_signature(matmul_call, mod)   # (4, 8) x (8, 16)
>>> sig.labels, sig.output, sig.reduction_labels()
((('d0', 'd1'), ('d1', 'd2')), (('d0', 'd2'),), frozenset({'d1'}))
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Callable

import tvm
from tvm import relax, tirx
from tvm.relax.distributed import DTensorType

from tvm_distx.errors import ArgumentError, RuleError

__all__ = [
    "Labels",
    "OpSignature",
    "SignatureRule",
    "op_signature",
    "kernel_name",
    "register_kernel_signature",
    "register_signature",
    "registered_kernels",
    "registered_ops",
    # helpers for rules
    "is_tensor",
    "output_types",
    "static_int",
    "tensor_ndim",
    "tensor_type",
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
#: Rules of ``call_tir`` kernels, by the kernel's name.
_KERNEL_RULES: dict[str, SignatureRule] = {}


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
        raise ArgumentError("register_signature needs at least one operator name",
                            hint='name the operators: @register_signature("relax.add")')

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


def register_kernel_signature(*kernel_names: str) -> Callable[[SignatureRule], SignatureRule]:
    """Register a signature rule for ``relax.call_tir`` calls of the named kernels.

    Parameters
    ----------
    *kernel_names : str
        Names of ``PrimFunc`` s (see :func:`kernel_name`).

    Returns
    -------
    callable
        A decorator that records ``f(call, mod) -> OpSignature | None`` for every
        name and returns ``f`` unchanged; ``f`` gets the ``call_tir`` call. Such a
        rule wins over the rule of ``relax.call_tir`` (the kernel's accesses).
    """
    if not kernel_names:
        raise ArgumentError("register_kernel_signature needs at least one kernel name",
                            hint='name the kernels: @register_kernel_signature("my_kernel")')

    def decorator(rule: SignatureRule) -> SignatureRule:
        for name in kernel_names:
            _KERNEL_RULES[name] = rule
        return rule

    return decorator


def registered_kernels() -> frozenset[str]:
    """The kernel names that have a signature rule of their own.

    Returns
    -------
    frozenset of str
        Registered kernel names.
    """
    return frozenset(_KERNEL_RULES)


def kernel_name(call: relax.Call, mod: tvm.IRModule) -> str | None:
    """The name a ``call_tir``'s kernel is registered under, None for any other call.

    The kernel's ``global_symbol`` when it has one and a rule is registered for it,
    else the name of its ``GlobalVar`` in ``mod``.
    """
    if _op_name(call) != "relax.call_tir" or not isinstance(call.args[0], tvm.ir.GlobalVar):
        return None
    gv = call.args[0]
    try:
        func = mod[gv]
    except Exception:  # noqa: BLE001 - not in the module
        return gv.name_hint
    symbol = func.attrs.get("global_symbol") if func.attrs is not None else None
    if symbol is not None and str(symbol) in _KERNEL_RULES:
        return str(symbol)
    return gv.name_hint


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
    kernel = kernel_name(call, mod)
    if kernel in _KERNEL_RULES:  # a kernel's own rule wins over reading its accesses
        rule, name = _KERNEL_RULES[kernel], f"kernel '{kernel}'"
    else:
        rule = _RULES.get(name) if name is not None else None
    if rule is None:
        return None
    try:
        sig = rule(call, mod)
    except RuleError:  # a user's rule that does not fit the call: the user must know
        raise
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
        ndim = tensor_ndim(operand.ty)
        if ndim is None or ndim != len(labels):
            return f"operand of rank {ndim} has {len(labels)} labels"
    outputs = output_types(call.ty)
    if outputs is None or len(outputs) != len(sig.output):
        return "outputs do not match the call's type"
    for ty, labels in zip(outputs, sig.output):
        ndim = tensor_ndim(ty)
        if ndim is None or ndim != len(labels):
            return f"output of rank {ndim} has {len(labels)} labels"
    for labels in sig.labels + sig.output:
        if len(set(labels)) != len(labels):
            return f"a label repeats within one tensor: {labels}"
    return None


# --------------------------------------------------------------------------- helpers for rules
def tensor_type(ty) -> relax.TensorType | None:
    """The TensorType of a tensor or DTensor type; None for anything else."""
    if isinstance(ty, DTensorType):
        ty = ty.tensor_ty
    return ty if isinstance(ty, relax.TensorType) else None


def tensor_ndim(ty) -> int | None:
    """The rank of a tensor or DTensor type; None when unknown or not a tensor."""
    tensor = tensor_type(ty)
    if tensor is None or tensor.ndim < 0:
        return None
    return int(tensor.ndim)


def is_tensor(expr: relax.Expr) -> bool:
    """Whether an expression is a tensor or a DTensor."""
    return tensor_type(getattr(expr, "ty", None)) is not None


def output_types(ty) -> list | None:
    """The tensor types a call produces (one, or a tuple's fields)."""
    if tensor_type(ty) is not None:
        return [ty]
    if isinstance(ty, relax.TupleType):
        fields = list(ty.fields)
        if all(tensor_type(f) is not None for f in fields):
            return fields
    return None


def static_int(dim) -> int | None:
    """The value of a static extent; None for a symbolic one."""
    if isinstance(dim, tirx.IntImm):
        return int(dim.value)
    return None
