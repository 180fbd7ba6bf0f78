"""Sharding rules users declare as strings: :func:`register_sharding_rule`.

An operator or kernel that tvm-distx has no rule for runs replicated. A user
says how it shards with one einsum-like string (the syntax is
:mod:`tvm_distx.passes.einsum`'s), as JAX's ``custom_partitioning`` takes a
``sharding_rule``::

    td.register_sharding_rule("relax.my_op", "mk,kn->mn")   # a Relax operator
    td.register_sharding_rule("my_kernel", "...mk,kn->...mn")  # a call_tir kernel, by name

Which rule a call gets, first match wins:

1. a ``call_tir`` of a kernel with a rule of its own (this module's, by the
   ``PrimFunc``'s ``global_symbol`` or its name in the module): that rule, not
   what :mod:`tvm_distx.passes.tir_access` reads from its accesses;
2. a call of a Relax operator: the rule last registered for the operator, a
   user's replacing the built-in one of :mod:`tvm_distx.passes.relax_op_rules`;
3. otherwise the built-in rules (``call_tir``: its accesses), or none (replicated).

The string is checked when it is registered (syntax, an operator name TVM does
not know); its terms are checked against the operands' ranks when propagation
meets a call (:class:`~tvm_distx.errors.RuleError` both times). An operator without
TVM's distributed type rule (``dist.FInferType``, which a user's operator
registered with ``ir.RegisterOp`` lacks) gets one from its string. Propagation
marks each kernel used with a user's rule (``PrimFunc`` attribute
:data:`tvm_distx.ir.helpers.KERNEL_RULE_ATTR`), and the local view runs such a
kernel on each rank's shards as written: its split dimensions must then be
symbolic extents of its buffers (``m = T.int64()``), so that the kernel fits
any shard (a kernel with static extents is left to TVM's local view).
"""

from __future__ import annotations

import logging
import re

import tvm
from tvm import relax
from tvm.relax.distributed import DTensorType, Placement

from tvm_distx.errors import RuleError
from tvm_distx.layout import TensorSharding
from tvm_distx.passes.einsum import EinsumSpec, einsum_signature, parse_einsum
from tvm_distx.passes.op_signatures import (OpSignature, is_tensor, output_types,
                                            register_kernel_signature, register_signature)

__all__ = ["kernel_rule", "register_sharding_rule", "user_rules"]

logger = logging.getLogger(__name__)

#: Every rule a user registered: operator or kernel name -> its parsed string.
_SPECS: dict[str, EinsumSpec] = {}
_KERNEL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_DIST_INFER = "dist.FInferType"


def register_sharding_rule(name: str, rule: str, *, unshardable: str = "") -> None:
    """Declare how a Relax operator or a ``call_tir`` kernel shards, as an einsum-like string.

    Parameters
    ----------
    name : str
        A Relax operator (``"relax.my_op"``, registered with TVM before this
        call), or the name of a ``PrimFunc`` called with ``R.call_tir`` (its
        ``global_symbol``, or its name in the module).
    rule : str
        One term per tensor operand, ``->``, one term per result: one letter
        per dimension, equal letters one axis, a letter in no result a summed
        axis (split, it gives a partial sum completed by an all-reduce); ``1``
        a size-1 dimension of its own; a leading ``...`` any number of batch
        dimensions, broadcast. For example ``"mk,kn->mn"``, ``"...d,d->...d"``.
    unshardable : str
        Letters of ``rule`` that must never be split (a softmax axis, a
        reduction that is not a sum).

    Raises
    ------
    RuleError
        When ``rule`` is malformed, or ``name`` looks like an operator
        (``relax.*``) that TVM does not have. A rule whose terms do not fit a
        call's operands raises it when propagation meets the call.

    Notes
    -----
    A later registration of the same name replaces the earlier one. A
    kernel's rule wins over reading its TIR accesses; an operator's replaces
    the built-in rule. A kernel with a rule runs on each rank's shards as
    written, so its split dimensions must be symbolic. An operator needs TVM's
    ``FInferType``; when it has no ``dist.FInferType``, one is registered that
    types its result from ``rule``.

    Examples
    --------
    >>> import tvm_distx as td
    >>> td.register_sharding_rule("row_scale", "mn,m->mn")
    """
    if not isinstance(name, str) or not name:
        raise RuleError(f"register_sharding_rule needs a name, got {name!r}",
                        hint='name a Relax operator ("relax.my_op") or a call_tir kernel '
                        '("my_kernel")')
    spec = parse_einsum(rule, unshardable)
    if _is_operator(name):
        register_signature(name)(_operator_rule(spec, name))
        _give_distributed_type(name)
        what = "operator"
    elif name.startswith("relax.") or not _KERNEL_NAME.fullmatch(name):
        raise RuleError(f"register_sharding_rule: {name!r} is neither a Relax operator TVM "
                        "knows nor the name of a TIR function",
                        hint='register the operator with TVM first (tvm.get_global_func('
                        '"ir.RegisterOp")), or give the PrimFunc\'s name as R.call_tir calls it')
    else:
        register_kernel_signature(name)(_kernel_rule(spec, name))
        what = "kernel"
    if name in _SPECS:
        logger.info("sharding rule of %s %s replaced: %r -> %r", what, name,
                    _SPECS[name].text, spec.text)
    _SPECS[name] = spec
    logger.debug("sharding rule of %s %s: %r", what, name, spec.text)


def kernel_rule(func: tvm.tirx.PrimFunc, name: str) -> EinsumSpec | None:
    """The user's rule of a kernel (by its ``global_symbol`` or ``name``), None without one.

    Parameters
    ----------
    func : tvm.tirx.PrimFunc
        The kernel.
    name : str
        Its name in the module.

    Returns
    -------
    EinsumSpec or None
    """
    symbol = func.attrs.get("global_symbol") if func.attrs is not None else None
    for candidate in (str(symbol) if symbol is not None else None, name):
        if candidate is not None and candidate in _SPECS and not _is_operator(candidate):
            return _SPECS[candidate]
    return None


def user_rules() -> dict[str, str]:
    """Every rule registered with :func:`register_sharding_rule`: name -> rule string.

    Returns
    -------
    dict of str to str
    """
    return {name: spec.text for name, spec in _SPECS.items()}


def _is_operator(name: str) -> bool:
    try:
        tvm.ir.Op.get(name)
    except Exception:  # noqa: BLE001 - TVM raises its own error for an unknown name
        return False
    return True


def _operator_rule(spec: EinsumSpec, name: str):
    def rule(call: relax.Call, mod: tvm.IRModule) -> OpSignature | None:
        operands = []
        for arg in call.args:  # a tuple argument (a list of tensors) gives its fields
            operands.extend(a for a in (arg.fields if isinstance(arg, relax.Tuple) else [arg])
                            if is_tensor(a))
        return einsum_signature(spec, operands, output_types(call.ty), strict=True,
                                what=f"operator {name}")

    rule.__name__ = f"user_rule[{name}]"
    return rule


def _give_distributed_type(name: str) -> None:
    """Register ``dist.FInferType`` for an operator that has none, from the user's rule.

    TVM types a call on DTensors only through that attribute, which a user's
    operator (registered with ``ir.RegisterOp``) usually lacks. The type is the
    operator's own ``FInferType`` on the global tensors, placed as the rule says:
    a result dimension whose letter an operand splits is split the same way; a
    split summed letter gives ``R`` (TVM's type of a partial sum). Propagation
    redistributes wherever that differs from what it decided.
    """
    op = tvm.ir.Op.get(name)
    if op.get_attr(_DIST_INFER) is not None or op.get_attr("FInferType") is None:
        return

    def infer(call: relax.Call, builder) -> DTensorType:
        spec = _SPECS.get(name)  # the rule registered last
        if spec is None:
            raise RuleError(f"operator {name} has no sharding rule (any more)",
                            hint="register one with tvm_distx.register_sharding_rule")
        args, operands, plain = [], [], []
        for arg in call.args:
            if isinstance(arg, relax.Tuple):
                fields = [_plain(f, operands, plain) for f in arg.fields]
                args.append(relax.Tuple(fields))
            else:
                args.append(_plain(arg, operands, plain))
        global_ty = op.get_attr("FInferType")(relax.Call(op, args, call.attrs, call.ty_args),
                                              builder)
        sig = einsum_signature(spec, plain, output_types(global_ty), strict=True,
                               what=f"operator {name}")
        if not operands or sig is None or len(sig.output) != 1:
            raise RuleError(f"rule {spec.text!r} of operator {name} cannot type this call on "
                            "DTensors", hint="give the operator one tensor result")
        mesh = operands[0].device_mesh
        result: list[str] = []
        placements = [TensorSharding.from_type(ty).placement.entries for ty in operands]
        for axis in range(len(mesh.shape)):
            split = [sig.labels[i][entries[axis].dim] for i, entries in enumerate(placements)
                     if entries[axis].is_shard()]
            dims = [sig.output[0].index(label) for label in split if label in sig.output[0]]
            result.append(f"S[{dims[0]}]" if dims else "R")
        return DTensorType(global_ty, mesh, Placement.from_text("".join(result)))

    tvm.ir.register_op_attr(name, _DIST_INFER, infer)
    logger.debug("registered %s for %s from its sharding rule", _DIST_INFER, name)


def _plain(arg: relax.Expr, operands: list, plain: list) -> relax.Expr:
    """``arg`` as a plain tensor variable of its global type (a DTensor's type noted)."""
    ty = arg.ty
    if not isinstance(ty, DTensorType):
        return arg
    var = relax.Var(f"operand{len(plain)}", ty.tensor_ty)
    operands.append(ty)
    plain.append(var)
    return var


def _kernel_rule(spec: EinsumSpec, name: str):
    def rule(call: relax.Call, mod: tvm.IRModule) -> OpSignature | None:
        args = call.args[1]
        if not isinstance(args, relax.Tuple):
            return None
        # scalar arguments (an int for a PrimFunc's scalar parameter) are not operands
        operands = [a for a in args.fields if is_tensor(a)]
        return einsum_signature(spec, operands, output_types(call.ty), strict=True,
                                what=f"kernel '{name}'")

    rule.__name__ = f"user_rule[{name}]"
    return rule
