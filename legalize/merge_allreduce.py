"""Merge all-reduces that meet in a linear kernel: ``allreduce(a) + allreduce(b)`` -> one.

After TVM's local view every partial sum is completed where it is made: a
row-parallel matmul is followed by its own ``R.ccl.allreduce``. When two partial
sums are then only combined linearly, the all-reduces can wait and run once on
the combination, because a sum over ranks commutes with every kernel that is
linear in the summed operands (:func:`tvm_distx.legalize.linearity.linear_in`)::

    lv1 = allreduce(moe)                    s = add(moe, multiply(gate, shared))
    lv2 = allreduce(shared)         ->      out = allreduce(s)
    lv3 = multiply(gate, lv2)
    out = add(lv1, lv3)

A mixture-of-experts layer with a shared expert beside the routed ones (each a
partial sum when split) then needs one all-reduce instead of two.

:class:`MergeAllReduces` walks each dataflow block once. An all-reduce whose
result has one use is *held*; a kernel whose held operands it is linear in, and
whose other operands every rank of the summed mesh axes holds whole, runs on the
addends and its result is held in turn. A held value is completed (its
all-reduce emitted) just before the first use that cannot take it. A chain that
never met a second all-reduce is emitted exactly as it was written, so the pass
changes nothing but merges. A kernel runs on the addends only when its result
is no larger than the addends it combines, so the merge never moves more bytes.

The merged all-reduce's input is not produced by the sharded reduction itself;
:func:`tvm_distx.legalize.partial_sums.partial_sum` follows such linear chains
back to it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import tvm
import tvm_ffi
from tvm import relax

from tvm_distx.ir import helpers as _ir
from tvm_distx.ir.module_pass import module_pass
from tvm_distx.layout import TensorSharding

from tvm_distx.legalize.linearity import linear_in
from tvm_distx.legalize.partial_sums import ALLREDUCE_OP, partial_sum, true_sharding

__all__ = ["MergeAllReduces"]

logger = logging.getLogger(__name__)

_LOCAL_KERNEL = "relax.dist.call_tir_local_view"


@dataclass
class _Held:
    """A value whose all-reduce is postponed.

    Attributes
    ----------
    var : relax.Var
        The complete value, as the program names it.
    addend : relax.Var
        This rank's addend of ``var``.
    call : relax.Call
        The all-reduce that completed the first partial sum of the chain (its attributes).
    axes : tuple of int
        The mesh axes summed over.
    written : list of relax.Binding
        The bindings that compute ``var`` as the program wrote them.
    on_addends : list of relax.Binding
        The bindings that compute ``addend``.
    merged : bool
        Whether two all-reduces met in the chain.
    """

    var: relax.Var
    addend: relax.Var
    call: relax.Call
    axes: tuple[int, ...]
    written: list = field(default_factory=list)
    on_addends: list = field(default_factory=list)
    merged: bool = False

    def complete(self) -> list:
        """The bindings that compute :attr:`var`: one all-reduce if merged, else as written."""
        if not self.merged:
            return list(self.written)
        allreduce = _typed(relax.Call(self.call.op, [self.addend], self.call.attrs,
                                      self.call.ty_args))
        return self.on_addends + [relax.VarBinding(self.var, allreduce)]


@module_pass(name="tvm_distx.MergeAllReduces")
class MergeAllReduces:
    """Complete partial sums that are combined linearly with one all-reduce (module doc)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        out = mod
        for gvar, func in _ir.relax_functions(mod):
            rewritten = _Merger(mod, func).run()
            if rewritten is not None:
                if out is mod:
                    out = mod.clone()
                out[gvar] = rewritten
        return out


class _Merger:
    """One function's walk (see the module doc)."""

    def __init__(self, mod: tvm.IRModule, func: relax.Function) -> None:
        self.mod = mod
        self.func = func
        self.bound, self.uses = _ir.bindings_and_uses(func)
        self.merges = 0

    def run(self) -> relax.Function | None:
        blocks = []
        for block in self.func.body.blocks:
            if isinstance(block, relax.DataflowBlock):
                blocks.append(relax.DataflowBlock(self._block(block.bindings)))
            else:
                blocks.append(block)
        if not self.merges:
            return None
        logger.info("merged %d all-reduce(s) into the ones after them", self.merges)
        body = relax.BlockBuilder().normalize(relax.SeqExpr(blocks, self.func.body.body))
        return relax.Function(self.func.params, body, self.func.ret_ty, self.func.is_pure,
                              self.func.attrs)

    def _block(self, bindings) -> list:
        held: dict[relax.Var, _Held] = {}
        out: list = []

        def complete(var):
            out.extend(held.pop(var).complete())

        for binding in bindings:
            value = binding.value
            if isinstance(binding, relax.VarBinding) and self._can_hold(binding):
                partial = partial_sum(value, self.bound)
                if partial is not None and partial.kind == "sum":
                    held[binding.var] = _Held(binding.var, value.args[0], value, partial.axes,
                                              written=[binding])
                    continue
            taken = self._take(binding, held) if isinstance(binding, relax.VarBinding) else None
            if taken is not None:
                for var in {a for a in _ir.operand_vars(value) if a in held}:
                    held.pop(var)
                if self.uses.get(binding.var, 0) == 1:
                    held[binding.var] = taken
                else:
                    out.extend(taken.complete())
                continue
            for var in _ir.operand_vars(value):
                if var in held:
                    complete(var)
            out.append(binding)
        for var in list(held):
            complete(var)
        return out

    def _can_hold(self, binding: relax.VarBinding) -> bool:
        value = binding.value
        if not (_ir.is_call_to(value, ALLREDUCE_OP) and isinstance(value.args[0], relax.Var)
                and self.uses.get(binding.var, 0) == 1):
            return False
        # held values are retyped from their addends: TVM types an all-reduce's
        # result replicated on every mesh axis, so only where its input already is
        return tvm_ffi.structural_equal(value.args[0].ty, binding.var.ty)

    def _take(self, binding: relax.VarBinding, held: dict) -> _Held | None:
        """The held value ``binding`` makes if it may run on addends, else None."""
        call = binding.value
        if not _ir.is_call_to(call, _LOCAL_KERNEL) or not isinstance(call.args[1], relax.Tuple):
            return None
        args = list(call.args[1].fields)
        summed = {i for i, a in enumerate(args) if isinstance(a, relax.Var) and a in held}
        if not summed:
            return None
        sources = [held[args[i]] for i in sorted(summed)]
        first = sources[0]
        if any(s.axes != first.axes or not _same_reduction(s.call, first.call) for s in sources):
            return None
        if any(args.count(args[i]) > 1 for i in summed):
            return None  # a * a is not linear
        for i, arg in enumerate(args):
            if i not in summed and not _whole_on(arg, first.axes, self.bound):
                return None
        if not _no_larger(binding.var.ty, [s.addend.ty for s in sources]):
            return None
        kernel = self.mod[call.args[0]]
        # the kernel's buffers are the tensor arguments (scalars are other parameters)
        tensors = [i for i, a in enumerate(args) if _ir.is_tensor_type(a.ty)]
        if not isinstance(kernel, tvm.tirx.PrimFunc) or not summed <= set(tensors) or \
                not linear_in(kernel, frozenset(tensors.index(i) for i in summed), len(tensors)):
            return None
        on_addends = [held[a].addend if i in summed else a for i, a in enumerate(args)]
        addend = relax.DataflowVar(f"{binding.var.name}_addend", binding.var.ty)
        kernel_call = _typed(relax.Call(call.op, [call.args[0], relax.Tuple(on_addends)]
                                        + list(call.args[2:]), call.attrs, call.ty_args))
        merged = any(s.merged for s in sources) or len(sources) > 1
        if len(sources) > 1:
            self.merges += len(sources) - 1
            logger.debug("'%s' sums %s before one all-reduce", binding.var.name,
                         ", ".join(f"'{s.var.name}'" for s in sources))
        return _Held(
            binding.var, addend, first.call, first.axes,
            written=[b for s in sources for b in s.complete()] + [binding],
            on_addends=[b for s in sources for b in s.on_addends]
            + [relax.VarBinding(addend, kernel_call)],
            merged=merged)


def _typed(call: relax.Call) -> relax.Call:
    """``call`` with its type inferred (a new call has none)."""
    return relax.BlockBuilder().normalize(call)


def _same_reduction(a: relax.Call, b: relax.Call) -> bool:
    return str(a.attrs.op_type) == str(b.attrs.op_type) and \
        bool(a.attrs.in_group) == bool(b.attrs.in_group)


def _whole_on(arg, axes: tuple[int, ...], bound) -> bool:
    """Whether every rank of the mesh ``axes`` holds the same ``arg``."""
    if not isinstance(arg, relax.Var):
        return isinstance(arg, (relax.Constant, relax.PrimValue, relax.ShapeExpr))
    sharding: TensorSharding | None = true_sharding(arg, bound)
    if sharding is None:
        return not _ir.is_tensor_type(arg.ty)  # a shape or a scalar: the same everywhere
    entries = sharding.placement.entries
    return all(axis < len(entries) and entries[axis].is_replicate() for axis in axes)


def _no_larger(result_ty, addend_tys) -> bool:
    """The result of the kernel has no more bytes than the addends it combines."""
    shape = _ir.static_shape(result_ty)
    if shape is not None and None not in shape:
        sizes = [_ir.static_shape(t) for t in addend_tys]
        if all(s is not None and None not in s for s in sizes):
            def nbytes(ty, dims):
                count = 1
                for d in dims:
                    count *= d
                return count * tvm.runtime.DataType(_dtype(ty)).bits
            return nbytes(result_ty, shape) <= sum(nbytes(t, s) for t, s in zip(addend_tys, sizes))
    # symbolic: the same shape and dtype as one of the addends
    return any(tvm_ffi.structural_equal(result_ty, t) for t in addend_tys)


def _dtype(ty) -> str:
    return str(ty.tensor_ty.dtype if hasattr(ty, "tensor_ty") else ty.dtype)
