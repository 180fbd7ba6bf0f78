"""Kernel fusion before scheduling: TVM's FuseOps, then each weight decode into its reader.

:func:`fuse_kernels` runs TVM's ``FuseOps`` and ``FuseTIR``, which fuse a kernel
with its elementwise consumers (a matmul and its ``silu``, say), then
:class:`FuseWeightDecodes`.

TVM's ``FuseOps`` never fuses an elementwise *producer* into a matmul or a
reduction, so a weight stored in another format (:func:`tvm_distx.quantize`)
would be decoded by a kernel of its own that writes the whole float32 weight
on every call, and the matmul would then read that: more bytes than a float32
weight, not fewer. :class:`FuseWeightDecodes` puts each decode kernel (a kernel
of parameters alone: :func:`tvm_distx.ir.weight_decode.is_decode_kernel`) and
the one kernel that reads its result into one primitive function, which
``FuseTIR`` makes one kernel. The decode is then the kernel's prologue, and the
schedules (:mod:`.matvec`, :mod:`.matmul`, :mod:`.reduction`, :mod:`.injective`)
compute it where the weight is read: in registers, on the rows a lookup reads,
or once per packed panel.
"""

from __future__ import annotations

import logging

import tvm
from tvm import relax, s_tir, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from tvm_distx.ir import helpers as _ir
from tvm_distx.ir.module_pass import module_pass
from tvm_distx.ir.weight_decode import is_decode_kernel, mark_decode, weight_params

__all__ = ["FuseWeightDecodes", "fuse_kernels"]

logger = logging.getLogger(__name__)

_OP_PATTERN_OPAQUE = 8  # OpPatternKind::kOpaque: a kernel nobody may fuse into
_SCHEDULED_ATTR = "tirx.is_scheduled"


def fuse_kernels(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with each kernel fused with its elementwise consumers and its weight decodes.

    TVM's ``AnnotateTIROpPattern``, ``FuseOps`` and ``FuseTIR``, then
    :class:`FuseWeightDecodes` and ``FuseTIR`` again. A kernel with a user's
    sharding rule (:data:`~tvm_distx.ir.helpers.KERNEL_RULE_ATTR`) is the user's
    own code, often over symbolic extents that ``FuseTIR`` cannot match with
    its consumers' static ones: it is left as written (opaque).
    """
    if not any(isinstance(func, relax.Function) for func in mod.functions.values()):
        return mod
    return tvm.transform.Sequential([_user_kernels_opaque,
                                     relax.transform.AnnotateTIROpPattern(),
                                     relax.transform.FuseOps(),
                                     relax.transform.FuseTIR(),
                                     FuseWeightDecodes(),
                                     relax.transform.FuseTIR(),
                                     relax.transform.DeadCodeElimination()])(mod)


@tvm.transform.module_pass(opt_level=0, name="tvm_distx.UserKernelsOpaque")
def _user_kernels_opaque(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Kernels with a user's sharding rule marked opaque, so that nothing is fused into them."""
    out = mod
    for gv, func in mod.functions.items():
        if isinstance(func, tirx.PrimFunc) and func.attrs is not None \
                and _ir.KERNEL_RULE_ATTR in func.attrs:
            if out is mod:
                out = mod.clone()
            out[gv] = func.with_attr("op_pattern", _OP_PATTERN_OPAQUE)
    return out


@module_pass("tvm_distx.FuseWeightDecodes")
class FuseWeightDecodes:
    """Group each weight decode kernel with the kernel that reads its result.

    A ``call_tir`` that decodes parameters, whose result has exactly one use,
    an operand of another ``call_tir``, becomes one primitive Relax function
    with that reader; run ``FuseTIR`` afterwards to make it one kernel. A
    reader already scheduled (the sparse experts kernel) or not made of blocks
    (sort, scan) is left alone; a lookup (``take``, opaque to ``FuseOps``) is not.
    """

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        out, grouped = mod, 0
        for gv, func in _ir.relax_functions(mod):
            if func.attrs is not None and "Primitive" in func.attrs:
                continue
            pairs = _decode_readers(func, mod)
            if not pairs:
                continue
            rewriter = _Grouper(out, pairs)
            new = rewriter.visit_expr(func)
            out = rewriter.builder_.get()
            out[gv] = relax.analysis.remove_all_unused(new)
            grouped += len(pairs)
            logger.debug("%s: %d weight decodes fused into their readers", gv.name_hint,
                         len(pairs))
        return out if grouped else mod


def _decode_readers(func: relax.Function, mod: tvm.IRModule) -> dict:
    """``{reader binding var: [decode bindings]}``: each decode read once, by a ``call_tir``."""
    params = weight_params(func)
    decodes, uses = {}, {}
    readers: dict = {}
    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            for operand in _ir.operand_vars(value):
                uses.setdefault(operand, []).append(binding)
            if isinstance(binding, relax.VarBinding) and is_decode_kernel(value, mod, params):
                decodes[binding.var] = binding
    for operand in _ir.operand_vars(func.body.body):
        uses.setdefault(operand, []).append(None)
    for var, decode in decodes.items():
        users = uses.get(var, [])
        if len(users) != 1 or users[0] is None:
            continue
        reader = users[0]
        if reader.var in decodes or not _fusible_reader(reader.value, mod):
            continue
        if sum(1 for arg in reader.value.args[1].fields if arg.same_as(var)) != 1:
            continue
        readers.setdefault(reader.var, []).append(decode)
    return readers


def _fusible_reader(call, mod: tvm.IRModule) -> bool:
    """A ``call_tir`` (no run-time scalars) of a kernel that may take a prologue.

    Not a kernel scheduled already (the sparse experts kernel), nor an opaque
    one that is not made of blocks (the sort and scan kernels).
    """
    if not _ir.is_call_to(call, "relax.call_tir") or len(call.args) != 2:
        return False
    callee, args = call.args
    if not isinstance(callee, tvm.ir.GlobalVar) or not isinstance(args, relax.Tuple) \
            or callee not in mod:
        return False
    func = mod[callee]
    if not isinstance(func, tirx.PrimFunc):
        return False
    attrs = func.attrs if func.attrs is not None else {}
    if bool(attrs.get(_SCHEDULED_ATTR, False)):
        return False  # the sparse experts kernel, say: hand-written, no prologue
    # an opaque kernel (a lookup's data-dependent read) takes one if it is made of blocks
    return int(attrs.get("op_pattern", 0)) != _OP_PATTERN_OPAQUE or \
        isinstance(func.body, s_tir.SBlockRealize)


@mutator
class _Grouper(PyExprMutator):
    """Replaces each reader and its decodes by a call of one primitive function."""

    def __init__(self, mod: tvm.IRModule, pairs: dict) -> None:
        super().__init__(mod)
        self.pairs = pairs
        self.decoded = {d.var for decodes in pairs.values() for d in decodes}
        self.marked: dict = {}  # a decode kernel -> its copy with marked blocks

    def visit_var_binding_(self, binding) -> None:
        if binding.var in self.decoded:
            return  # emitted inside its reader's function
        decodes = self.pairs.get(binding.var)
        if decodes is None:
            super().visit_var_binding_(binding)
            return
        marked = {}
        for d in decodes:
            callee = d.value.args[0]
            if callee not in self.marked:
                self.marked[callee] = self.builder_.add_func(
                    mark_decode(self.builder_.get()[callee]), callee.name_hint)
            marked[d.var] = self.marked[callee]
        func, args = _primitive(decodes, marked, binding)
        reader = binding.value.args[0].name_hint
        name = "fused_decode_" + (reader[len("fused_"):] if reader.startswith("fused_")
                                  else reader)
        gv = self.builder_.add_func(func, name)
        call = self.builder_.normalize(relax.Call(gv, [self.visit_expr(arg) for arg in args]))
        self.builder_.emit_normalized(relax.VarBinding(binding.var, call))


def _primitive(decodes: list, kernels: dict, reader: relax.VarBinding):
    """The primitive function computing ``reader`` from its operands and its decodes'.

    ``kernels`` gives the kernel each decode calls (its blocks marked).

    Returns the function and the outer operands it takes, in order.
    """
    outer: list = []
    inner: list = []

    def param(arg):
        if isinstance(arg.ty, tvm.ir.PrimType):
            return arg  # a kernel's scalar (an extent FuseOps passes): its vars come in below
        for seen, var in zip(outer, inner):
            if seen.same_as(arg):
                return var
        inner.append(relax.Var(arg.name if isinstance(arg, relax.Var) else f"c{len(outer)}",
                               arg.ty))
        outer.append(arg)
        return inner[-1]

    def call(value: relax.Call, operands: list, callee=None) -> relax.Call:
        return relax.Call(value.op, [callee or value.args[0], relax.Tuple(operands)],
                          value.attrs, value.ty_args)

    decoded = {d.var: [param(arg) for arg in d.value.args[1].fields] for d in decodes}
    operands = [None if arg in decoded else param(arg) for arg in reader.value.args[1].fields]
    # an extent the operands' shapes or scalars use but do not define (the ``3 * n``
    # rows of a batch) comes in as a shape operand
    defined = {v for var in inner for v in relax.analysis.definable_tir_vars_in_type(var.ty)}
    used = [v for ty in [var.ty for var in inner] + [reader.var.ty]
            for v in relax.analysis.tir_vars_in_type(ty)]
    used += [v for d in [*decodes, reader] for arg in d.value.args[1].fields
             if isinstance(arg.ty, tvm.ir.PrimType) for v in tirx.analysis.undefined_vars(arg)]
    undefined = list(dict.fromkeys(v for v in used if v not in defined))
    if undefined:
        param(relax.ShapeExpr(undefined))
    bb = relax.BlockBuilder()
    with bb.function("decoded_reader", list(inner), attrs={"Primitive": True}, private=True):
        with bb.dataflow():
            for d in decodes:
                decoded[d.var] = bb.emit(call(d.value, decoded[d.var], kernels[d.var]))
            operands = [decoded[arg] if new is None else new
                        for arg, new in zip(reader.value.args[1].fields, operands)]
            out = bb.emit_output(call(reader.value, operands))
        bb.emit_func_output(out)
    return bb.get()["decoded_reader"], outer
