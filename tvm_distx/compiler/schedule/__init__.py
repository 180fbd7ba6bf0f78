"""CPU schedules for the rank-local kernels that ``lower_to_ranks`` produces.

After :func:`tvm_distx.lower_to_ranks` every operator is a TIR ``PrimFunc`` written
by ``relax.transform.LegalizeOps`` (possibly fused by ``FuseOps``/``FuseTIR``)
and called with ``R.call_tir``. TVM's default CPU pipeline builds those loop
nests as they are, so a matmul runs as three naive loops, about 80x slower than
numpy. :class:`ScheduleCPU` gives each kernel a hand-written
``tvm.s_tir.Schedule`` recipe, chosen by the kernel's block structure:

:class:`MatvecRule`
    A matrix-vector product (a handful of rows, one decoded token) with a
    weight stored ``(out, in)``: each weight row is read once, contiguously,
    into a vector accumulator (``rfactor`` over the lanes), the output
    columns in parallel, no packing.
:class:`NibbleTableRule`
    The same product with a ``q4`` weight, on AVX-512: each group's 16 possible
    values form one register, and 16 nibbles are decoded by one permute
    (:mod:`.nibbles`). Tried first; other targets skip it.
:class:`MatmulRule`
    One reduction block ``C[b.., i, j] += A[.., i, k] * B[.., k, j]`` (either
    operand layout, optional batch axes), with injective prologue blocks
    (inlined) and epilogue blocks (``relu``, bias ``add``, ...). The recipe is
    a register-blocked micro-kernel: an ``mr x nr`` tile of ``C`` accumulates
    in a ``local`` buffer that LLVM keeps in vector registers, the ``k`` loop
    runs around the unrolled ``mr`` and vectorized ``nr`` loops, each ``nr``
    wide panel of ``B`` is first packed into a contiguous ``[k, nr]`` buffer by
    the thread that owns the panel, and the epilogue runs on the tile while it
    is still in registers.
:class:`InjectiveRule`
    Only spatial blocks (elementwise, broadcast, transpose, ...). Producers are
    inlined; each remaining block's loops are fused, the inner part is
    vectorized and the outer part parallelized when the kernel is big enough.
:class:`ReductionRule`
    Reductions that are not matmuls (``sum``, ``max``, the pieces of
    ``softmax`` or ``layer_norm``). A reduction over a contiguous innermost
    axis is vectorized through ``rfactor``. When every block works row by row
    on the rows of the output block, all blocks are computed per row inside one
    parallel loop; otherwise every block is scheduled on its own.

**Weights stored in another format** (:func:`tvm_distx.quantize`) reach the
rules as kernels whose prologue decodes the weight: :func:`fuse_kernels` fuses
each decode into the kernel that reads it and marks its blocks
(:func:`tvm_distx.ir.weight_decode.is_decode_block`, :attr:`Block.decode`).
The matvec recipe decodes in registers as it reads each row (the per-group
scales and offsets once per row, read with broadcast loads), the matmul recipe
decodes into each packed panel (once per panel, not per row tile), and a
lookup (the reduction and injective recipes) decodes only the rows it reads.
No schedule writes a float copy of a weight.

Every kernel, scheduled or not, then has its float32 ``exp`` and ``sigmoid``
written as vector arithmetic (:func:`.elementary.vector_exp`): LLVM would call
libm once per lane.

A kernel that no rule matches keeps TVM's default lowering, with an INFO log
line naming it. A kernel whose legalization wrote its loops or a library call
itself (:func:`written_as_loops`: a router's ``topk`` and ``scatter_elements``)
is built as written. A rule whose recipe raises a :class:`tvm.s_tir.ScheduleError`
is abandoned the same way. Schedule primitives check their own legality, so a
recipe either yields an equivalent program or fails loudly.

TVM's runtime thread pool sizes itself to *half* the hardware threads on x86
(it assumes hyper-threading), so on a machine without SMT the parallel loops
use half the cores. Call :func:`use_cpu_threads` before the first kernel runs.

This module dispatches: :func:`schedule_primfunc` tries :data:`DEFAULT_RULES`
in order, :class:`ScheduleCPU` and :func:`schedule_module` apply it to a
module. Each kernel family has its own module (:mod:`.matvec`, :mod:`.nibbles`,
:mod:`.matmul`, :mod:`.injective`, :mod:`.reduction`), and :mod:`.base` holds what they share:
the target's traits, the blocks of a kernel as rules see them, the
:class:`Rule` interface and the loop primitives. A new family is a
:class:`Rule` subclass in a module of its own, added to :data:`DEFAULT_RULES`.
"""

from __future__ import annotations

import logging
from typing import Sequence

import tvm
from tvm import s_tir, tirx
from tvm.s_tir import Schedule

from tvm_distx.ir.helpers import with_functions
from tvm_distx.ir.module_pass import module_pass
from tvm_distx.compiler.targets import x86_target
from tvm_distx.compiler.schedule.base import (  # noqa: F401
    MIN_PARALLEL_ELEMENTS, RULE_ATTR, SCHEDULE_ERRORS, SCHEDULED_ATTR, Block, CPUTraits, Rule,
    describe_blocks, first_line, tidy_indices, use_cpu_threads, widen_halves)
from tvm_distx.compiler.schedule.attention import FlashAttention
from tvm_distx.compiler.schedule.cache_write import InPlaceCacheWrites
from tvm_distx.compiler.schedule.elementary import vector_exp
from tvm_distx.compiler.schedule.experts import SparseExperts
from tvm_distx.compiler.schedule.fusion import FuseWeightDecodes, fuse_kernels
from tvm_distx.compiler.schedule.injective import InjectiveRule
from tvm_distx.compiler.schedule.matmul import MatmulRule
from tvm_distx.compiler.schedule.matvec import MatvecRule
from tvm_distx.compiler.schedule.nibbles import NibbleTableRule
from tvm_distx.compiler.schedule.reduction import ReductionRule

__all__ = [
    "AS_WRITTEN",
    "Block",
    "CPUTraits",
    "DEFAULT_RULES",
    "FuseWeightDecodes",
    "RULE_ATTR",
    "fuse_kernels",
    "SCHEDULED_ATTR",
    "InjectiveRule",
    "MatmulRule",
    "MatvecRule",
    "NibbleTableRule",
    "ReductionRule",
    "Rule",
    "ScheduleCPU",
    "WidenHalves",
    "describe_blocks",
    "implement_kernels",
    "schedule_module",
    "schedule_primfunc",
    "use_cpu_threads",
    "written_as_loops",
    "x86_target",
]

logger = logging.getLogger(__name__)

_OP_PATTERN_OPAQUE = 8  # OpPatternKind::kOpaque: FuseOps leaves the kernel alone


#: The rules, tried in order; the first that matches schedules the kernel.
DEFAULT_RULES: tuple[Rule, ...] = (NibbleTableRule(), MatvecRule(), MatmulRule(), InjectiveRule(),
                                   ReductionRule())


#: The rule name of a kernel built as its legalization wrote it (:func:`written_as_loops`).
AS_WRITTEN = "as-written"


# --------------------------------------------------------------------------- driver


def written_as_loops(func: tirx.PrimFunc) -> bool:
    """Whether a kernel was written as explicit loops or a library call, not as blocks.

    Some legalizations write the program themselves: TVM's ``topk`` calls its
    runtime's sort, its ``scatter_elements`` is a parallel loop program (a mixture
    of experts' routing uses both). Their outermost block is then an opaque block
    of their own (no iteration variables), not the ``root`` that holds the blocks
    a recipe reads, so there is nothing for a recipe to read or to improve: the
    kernel is built as written, and :data:`RULE_ATTR` says ``"as-written"``.
    """
    body = func.body
    return (isinstance(body, s_tir.SBlockRealize) and body.block.name_hint != "root"
            and not body.block.iter_vars)


def schedule_primfunc(func: tirx.PrimFunc, target: tvm.target.Target | None = None, *,
                      name: str = "kernel",
                      rules: Sequence[Rule] = DEFAULT_RULES) -> tirx.PrimFunc | None:
    """Schedule one kernel with the first rule that matches it.

    Parameters
    ----------
    func : tvm.tirx.PrimFunc
        A kernel with a root block, as ``LegalizeOps`` writes them.
    target : tvm.target.Target, optional
        The LLVM CPU target; :func:`x86_target` by default.
    name : str
        The kernel's name, for log lines.
    rules : sequence of Rule
        Tried in order.

    Returns
    -------
    tvm.tirx.PrimFunc or None
        The scheduled kernel, marked ``tirx.is_scheduled`` and with the rule's
        name as ``tvm_distx.schedule_rule``; ``None`` when no
        rule matches or the matching rule's recipe fails (both logged at INFO).
    """
    cpu = CPUTraits.of(target if target is not None else x86_target())
    if not cpu.half_vectors:
        func = widen_halves(func)
    if written_as_loops(func):
        logger.debug("schedule: %s is written as loops or a library call; built as written",
                     name)
        return func.with_attrs({SCHEDULED_ATTR: True, RULE_ATTR: AS_WRITTEN})
    try:
        sch = Schedule(tidy_indices(func))
        blocks = describe_blocks(sch)
    except SCHEDULE_ERRORS as err:
        logger.info("schedule: %s has no block structure the rules read; keeping TVM's "
                    "default lowering (%s)", name, first_line(err))
        return None
    for rule in rules:
        if not rule.supports(cpu):
            continue
        found = rule.match(blocks)
        if found is None:
            continue
        try:
            sch = rule.apply(sch, found, cpu)
        except SCHEDULE_ERRORS as err:
            logger.info("schedule: the %s recipe failed on %s; keeping TVM's default lowering "
                        "(%s)", rule.name, name, first_line(err))
            return None
        except Exception:  # noqa: BLE001 - a bug in a recipe must not break the build
            logger.warning("schedule: the %s recipe crashed on %s (a bug, please report it); "
                           "keeping TVM's default lowering", rule.name, name, exc_info=True)
            return None
        out = sch.mod["main"]
        # a recipe that fell back to another rule's names that one
        used = str(out.attrs[RULE_ATTR]) if out.attrs is not None and RULE_ATTR in out.attrs \
            else rule.name
        logger.debug("schedule: %s scheduled by the %s rule", name, used)
        return out.with_attrs({SCHEDULED_ATTR: True, RULE_ATTR: used})
    logger.info("schedule: no rule matches %s; keeping TVM's default lowering", name)
    return None


@module_pass("tvm_distx.ScheduleCPU")
class ScheduleCPU:
    """Give every TIR kernel of a module a hand-written CPU schedule.

    Kernels already marked ``tirx.is_scheduled`` are skipped. Scheduled kernels
    get that mark and the opaque operator pattern, so that a later ``FuseOps``
    (the one inside ``tvm.compile``, say) does not merge them into kernels
    nobody scheduled. Fuse first if fusion is wanted (:func:`schedule_module`).

    Parameters
    ----------
    target : tvm.target.Target, optional
        The LLVM CPU target; :func:`x86_target` by default.
    rules : sequence of Rule, optional
        Tried in order for each kernel; :data:`DEFAULT_RULES` by default.
    """

    def __init__(self, target: tvm.target.Target | None = None,
                 rules: Sequence[Rule] = DEFAULT_RULES) -> None:
        self.target = target if target is not None else x86_target()
        self.rules = tuple(rules)

    def transform_module(self, mod: tvm.IRModule,
                         _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        mod = WidenHalves(self.target)(mod)
        scheduled = {}
        for gvar, func in mod.functions.items():
            if not isinstance(func, tirx.PrimFunc):
                continue
            if func.attrs is not None and bool(func.attrs.get(SCHEDULED_ATTR, False)):
                logger.debug("schedule: %s is scheduled already", gvar.name_hint)
            else:
                new = schedule_primfunc(func, self.target, name=gvar.name_hint,
                                        rules=self.rules)
                if new is not None:
                    scheduled[gvar] = new.with_attr("op_pattern", _OP_PATTERN_OPAQUE)
            # exp and sigmoid in vector arithmetic in every kernel, however scheduled (the
            # experts' silu included): LLVM would call libm once per lane
            rewritten = vector_exp(scheduled.get(gvar, func))
            if not rewritten.same_as(scheduled.get(gvar, func)):
                scheduled[gvar] = rewritten
        return with_functions(mod, scheduled)


@module_pass("tvm_distx.WidenHalves")
class WidenHalves:
    """Convert float16 to float32 with integer operations in every kernel, where needed.

    On a target without :attr:`CPUTraits.half_vectors` (RISC-V without
    ``Zvfhmin``), LLVM converts a float16 by a call whose argument TVM's own
    definition reads from the wrong register, so every kernel, scheduled or
    not, converts by :func:`~tvm_distx.compiler.schedule.base.widen_halves`
    instead. Other targets keep their kernels.

    Parameters
    ----------
    target : tvm.target.Target
        The LLVM CPU target.
    """

    def __init__(self, target: tvm.target.Target) -> None:
        self.target = target

    def transform_module(self, mod: tvm.IRModule,
                         _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        if CPUTraits.of(self.target).half_vectors:
            return mod
        widened = {gv: widen_halves(f) for gv, f in mod.functions.items()
                   if isinstance(f, tirx.PrimFunc)}
        return with_functions(mod, {gv: f for gv, f in widened.items()
                                    if not f.same_as(mod[gv])})


def schedule_module(mod: tvm.IRModule, target: tvm.target.Target | None = None, *,
                    fuse: bool = True) -> tvm.IRModule:
    """Implement, fuse and schedule the kernels of a lowered module for the CPU.

    Parameters
    ----------
    mod : tvm.IRModule
        A module whose operators are TIR kernels called with ``R.call_tir``,
        such as the output of :func:`tvm_distx.lower_to_ranks`. The kernels
        with two forms get their implementations first (:func:`implement_kernels`).
    target : tvm.target.Target, optional
        The LLVM CPU target; :func:`x86_target` by default.
    fuse : bool, default True
        First run :func:`fuse_kernels`, so that a matmul and its elementwise
        consumers become one kernel whose epilogue runs on the register tile,
        and each weight decode is the prologue of the kernel that reads it.

    Returns
    -------
    tvm.IRModule
        The module with scheduled kernels, ready for ``tvm.compile``.
    """
    mod = implement_kernels(mod)
    if fuse:
        mod = fuse_kernels(mod)
    return ScheduleCPU(target)(mod)


def implement_kernels(mod: tvm.IRModule) -> tvm.IRModule:
    """Every kernel that has a definition and an implementation given its implementation.

    The experts kernel runs as a sparse dispatch over each rank's experts
    (:class:`~tvm_distx.compiler.schedule.experts.SparseExperts`), attention as an
    online softmax over tiles of keys
    (:class:`~tvm_distx.compiler.schedule.attention.FlashAttention`), and the cache
    writes in place (:class:`~tvm_distx.compiler.schedule.cache_write.InPlaceCacheWrites`).
    Run on a rank-local module, before :func:`fuse_kernels`.
    """
    return InPlaceCacheWrites()(FlashAttention()(SparseExperts()(mod)))
