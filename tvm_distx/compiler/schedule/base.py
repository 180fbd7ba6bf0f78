"""What every CPU schedule recipe shares (see :mod:`tvm_distx.compiler.schedule`).

This module owns:

* the target: :class:`CPUTraits` (vector width, cores) and
  :func:`use_cpu_threads` (the size of TVM's runtime thread pool);
* the kernel as the rules see it: :class:`Block` and :func:`describe_blocks`;
* the :class:`Rule` interface that each kernel family implements
  (:mod:`.matmul`, :mod:`.injective`, :mod:`.reduction`);
* the loop primitives the recipes are built from: flattening and vectorizing a
  spatial block, moving a reduction's init out of its loops, loop extents;
* :func:`quick_macros`, for the kernels written in TVMScript with macros.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Sequence

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.ir.expr import Call, Expr, Range, TensorLoad
from tvm.s_tir import Schedule, ScheduleError
from tvm.script.parser.core.parser import ScriptMacro
from tvm.sym import Analyzer

from tvm_distx.ir.helpers import called_kernels
from tvm_distx.ir.weight_decode import is_decode_block

__all__ = [
    "Block",
    "CPUTraits",
    "MIN_PARALLEL_ELEMENTS",
    "RULE_ATTR",
    "implement_definitions",
    "Rule",
    "SCHEDULE_ERRORS",
    "SCHEDULED_ATTR",
    "describe_blocks",
    "use_cpu_threads",
    # primitives for recipes
    "REDUCE",
    "SPATIAL",
    "block_binding",
    "decompose_init",
    "first_divisor",
    "first_line",
    "index_positions",
    "tidy_indices",
    "inline_decodes",
    "loop_extent",
    "loops_over",
    "schedule_flat",
    "trip_count",
    "uses_var",
    "vectorize_innermost",
    "widen_halves",
    "quick_macros",
]

logger = logging.getLogger(__name__)

#: Injective kernels with fewer elements run serially: a parallel launch costs
#: more than spreading that little work saves.
MIN_PARALLEL_ELEMENTS = 1 << 14

#: What a failing recipe raises: schedule primitives raise ScheduleError, and
#: TVM's other C++ checks reach Python as RuntimeError (or InternalError).
SCHEDULE_ERRORS = (ScheduleError, tvm.error.InternalError, RuntimeError)

#: The kinds of a block's iteration variables: spatial (data parallel) and reduction.
SPATIAL = tirx.IterVar.DataPar
REDUCE = tirx.IterVar.CommReduce


# --------------------------------------------------------------------------- target


def use_cpu_threads(num_threads: int | None = None) -> int:
    """Make TVM's runtime thread pool use ``num_threads`` threads.

    TVM reads ``TVM_NUM_THREADS`` when a thread creates its pool (each calling
    thread has its own), and without it uses half the hardware threads on x86.
    This sets the variable unless the user already did, and reports the size
    of the calling thread's pool.

    Parameters
    ----------
    num_threads : int, optional
        ``os.cpu_count()`` by default.

    Returns
    -------
    int
        The number of threads of the calling thread's pool. It is smaller than
        asked when that pool existed before the call: pools do not grow.
    """
    wanted = num_threads if num_threads is not None else (os.cpu_count() or 1)
    os.environ.setdefault("TVM_NUM_THREADS", str(wanted))
    actual = int(tvm.get_global_func("runtime.NumThreads")())
    if actual < wanted:
        logger.warning("TVM's thread pool runs %d thread(s), %d asked: call use_cpu_threads() "
                       "before any kernel runs, or set TVM_NUM_THREADS", actual, wanted)
    return actual


#: Function attribute marking a kernel as scheduled (the one dlight also honours).
SCHEDULED_ATTR = "tirx.is_scheduled"

#: Function attribute naming the rule (or the hand-written kernel) that scheduled a kernel.
RULE_ATTR = "tvm_distx.schedule_rule"


@dataclass(frozen=True)
class CPUTraits:
    """What the recipes need to know about the target CPU.

    Attributes
    ----------
    vector_bits : int
        Width of one SIMD register: 512 with AVX-512, 256 with AVX2, else 128.
    cores : int
        Cores that parallel loops are spread over.
    half_vectors : bool
        Whether vectors of 16-bit floats (``float16``, ``bfloat16``) convert to
        float32 in vector registers: x86 with F16C does; RISC-V without the
        ``Zvfhmin`` extension does not (LLVM cannot build such a conversion for
        RVV, and TVM's bfloat16 legalization of a vector fails), so a decode
        from 16-bit floats runs scalar there, once per weight row.
    """

    vector_bits: int
    cores: int
    half_vectors: bool = True

    @classmethod
    def of(cls, target: tvm.target.Target) -> "CPUTraits":
        """The traits of an LLVM ``target``."""
        bits = 128
        for feature, width in (("avx512f", 512), ("avx2", 256)):
            try:
                if tvm.target.codegen.target_has_features(feature, target):
                    bits = width
                    break
            except SCHEDULE_ERRORS:  # not an x86 target
                break
        cores = int(target.attrs.get("num-cores", 0) or os.cpu_count() or 1)
        return cls(vector_bits=bits, cores=cores, half_vectors=_half_vectors(target))

    def lanes(self, dtype: str) -> int:
        """Elements of ``dtype`` in one vector register."""
        return max(1, self.vector_bits // tvm.runtime.DataType(dtype).bits)


def _half_vectors(target: tvm.target.Target) -> bool:
    """Whether ``target`` converts vectors of 16-bit floats (see :class:`CPUTraits`)."""
    if "riscv" not in str(target.attrs.get("mtriple", "")):
        return True
    mattr = [str(a) for a in target.attrs.get("mattr", [])]
    return any(a in mattr for a in ("+zvfhmin", "+zvfh"))


def widen_halves(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with every float16 to float32 conversion written as integer operations.

    For targets without :attr:`CPUTraits.half_vectors` (RISC-V without
    ``Zvfhmin``). There LLVM converts a float16 by calling ``__extendhfsf2``
    with the value in a float register, while the definition TVM links reads it
    from an integer register: the result is wrong whenever the two differ.
    The integer form is exact for every float16 (normal, subnormal, zero,
    infinite, NaN) and needs no call.
    """

    def convert(node):
        if str(node.ty) == "float32" and str(node.value.ty) == "float16":
            return _half_to_float(node.value)
        return node

    return tvm_ffi.structural_map(func, [(tirx.Cast, convert)])


def _half_to_float(value: Expr) -> Expr:
    """The float32 of a float16 expression, from its bits."""

    def u32(v: int) -> Expr:
        return tirx.const(v, "uint32")

    bits = tirx.Cast("uint32", tirx.reinterpret("uint16", value))
    magnitude = tirx.bitwise_and(bits, u32(0x7FFF))
    shifted = tirx.shift_left(magnitude, u32(13))
    normal = tirx.reinterpret("float32", shifted + u32(112 << 23))     # exponent 15 -> 127
    special = tirx.reinterpret("float32", shifted + u32(224 << 23))    # infinity, NaN
    tiny = tirx.Cast("float32", magnitude) * tirx.const(2.0 ** -24, "float32")  # subnormal
    value32 = tirx.Select(magnitude >= u32(0x7C00), special,
                          tirx.Select(magnitude >= u32(0x0400), normal, tiny))
    sign = tirx.shift_left(tirx.bitwise_and(bits, u32(0x8000)), u32(16))
    return tirx.reinterpret("float32", tirx.reinterpret("uint32", value32) | sign)


def tidy_indices(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with every block's buffer indices simplified within its iteration ranges.

    ``LegalizeOps`` writes a reshape's index as the flattened offset split again
    (``((v1 * 32 + v2) // 256 + v0) % 64``), correct for any index but simplified
    only where the ranges of the block's variables are known. A fused kernel
    chains several (a weight decode does), and inlining them into a matmul
    composes them into an expression no later pass can bound: a buffer computed
    per row then keeps the size of the whole matrix. Simplified block by block,
    where ``v0 < 64`` and ``v2 < 32`` are known, each index is the plain one.
    """

    def block(node: s_tir.SBlock) -> s_tir.SBlock:
        if not node.iter_vars:
            return node
        analyzer = Analyzer()
        for iv in node.iter_vars:
            analyzer.bind(iv.var, iv.dom)

        def simple(indices) -> list:  # a plain variable stays itself, unit extent or not
            return [i if isinstance(i, (tirx.Var, tirx.IntImm)) else analyzer.simplify(i)
                    for i in indices]

        def load(expr: TensorLoad) -> Expr:
            return tirx.BufferLoad(expr.source, simple(expr.indices))

        def store(stmt: tirx.BufferStore) -> tirx.BufferStore:
            return tirx.BufferStore(stmt.buffer, stmt.value, simple(stmt.indices))

        def region(r):
            return tirx.BufferRegion(r.source, [Range.from_min_extent(
                analyzer.simplify(x.min), analyzer.simplify(x.extent)) for x in r.region])

        body = tvm_ffi.structural_map(node.body, [(TensorLoad, load), (tirx.BufferStore, store)])
        return s_tir.SBlock(node.iter_vars, [region(r) for r in node.reads],
                            [region(r) for r in node.writes], node.name_hint, body, node.init,
                            node.alloc_buffers, node.match_buffers, node.annotations)

    return tvm_ffi.structural_map(func, [(s_tir.SBlock, block)])


# --------------------------------------------------------------------------- analysis


@dataclass
class Block:
    """One block of a kernel, as the rules see it.

    Attributes
    ----------
    rv : SBlockRV
        The block in the schedule being built.
    stmt : tvm.s_tir.SBlock
        The block as it was before scheduling.
    spatial, reduce : list of tirx.Var
        Its iteration variables by kind, in order.
    store : tirx.BufferStore or None
        Its body, when that is a single store (``None`` otherwise: no rule
        understands such a block).
    loads : list of TensorLoad
        The loads of the stored value.
    trivial_binding : bool
        Each iteration variable is bound to exactly one loop, in loop order.
    """

    rv: s_tir.schedule.SBlockRV
    stmt: s_tir.SBlock
    spatial: list[tirx.Var]
    reduce: list[tirx.Var]
    store: tirx.BufferStore | None
    loads: list[TensorLoad] = field(default_factory=list)
    trivial_binding: bool = False

    @property
    def name(self) -> str:
        return self.stmt.name_hint

    @property
    def is_spatial(self) -> bool:
        return not self.reduce

    @property
    def output(self) -> tirx.Var:
        return self.store.buffer

    @property
    def leading_spatial(self) -> int:
        """How many of the outermost iteration variables are spatial."""
        count = 0
        for iv in self.stmt.iter_vars:
            if iv.iter_type != SPATIAL:
                break
            count += 1
        return count

    def reads_own_output(self) -> bool:
        return any(load.source.same_as(self.output) for load in self.loads)

    @property
    def decode(self) -> bool:
        """Whether the block is part of a weight decode fused into this kernel.

        :func:`tvm_distx.ir.weight_decode.is_decode_block` says so; such a block
        is computed where its value is read, never into a buffer of its own.
        """
        return is_decode_block(self.stmt)


def _walk(expr: Expr, visit) -> None:
    """Call ``visit`` on ``expr`` and on every sub-expression, parents first."""
    visit(expr)
    if isinstance(expr, TensorLoad):
        children = list(expr.indices)
    elif isinstance(expr, Call):
        children = list(expr.args)
    else:
        children = [getattr(expr, name, None)
                    for name in ("a", "b", "value", "condition", "true_value", "false_value",
                                 "body")]
    for child in children:
        if isinstance(child, Expr):
            _walk(child, visit)


def _buffer_loads(expr: Expr) -> list[TensorLoad]:
    """Every load (``TensorLoad``) inside a TIR expression."""
    found: list[TensorLoad] = []
    _walk(expr, lambda node: found.append(node) if isinstance(node, TensorLoad) else None)
    return found


def uses_var(expr: Expr, var: tirx.Var) -> bool:
    """Whether ``var`` occurs in ``expr``."""
    found = []
    _walk(expr, lambda node: found.append(node) if isinstance(node, tirx.Var)
          and node.same_as(var) else None)
    return bool(found)


def describe_blocks(sch: Schedule) -> list[Block]:
    """The blocks directly under the kernel's root block, in program order."""
    return [_describe(sch, rv) for rv in sch.get_child_blocks(sch.get_sblock("root"))]


def _describe(sch: Schedule, rv: s_tir.schedule.SBlockRV) -> Block:
    stmt = sch.get(rv)
    kinds = [iv.iter_type for iv in stmt.iter_vars]
    spatial = [iv.var for iv in stmt.iter_vars if iv.iter_type == SPATIAL]
    reduce = [iv.var for iv in stmt.iter_vars if iv.iter_type == REDUCE]
    store = stmt.body if isinstance(stmt.body, tirx.BufferStore) else None
    if len(spatial) + len(reduce) != len(kinds):
        store = None  # an opaque or scan iterator
    loads = _buffer_loads(store.value) if store is not None else []
    loops = sch.get_loops(rv)
    trivial = False
    if loops and len(loops) == len(kinds):
        realize = sch.get(loops[-1]).body
        trivial = isinstance(realize, s_tir.SBlockRealize) and all(
            value.same_as(sch.get(loop).loop_var)
            for value, loop in zip(realize.iter_values, loops))
    return Block(rv, stmt, spatial, reduce, store, loads, trivial)


def inline_decodes(sch: Schedule, blocks: Sequence[Block]) -> list[Block]:
    """Inline the weight-decode blocks of ``blocks`` into their readers; the blocks left.

    Every decode block is computed where it is read: a lookup then decodes only
    the rows it reads. Raises :class:`~tvm.s_tir.ScheduleError` when a block
    cannot be inlined (the recipe is then abandoned).
    """
    decodes = [b for b in blocks if b.decode]
    for block in decodes:
        sch.compute_inline(block.rv)
    if not decodes:
        return list(blocks)
    return describe_blocks(sch)


def loop_extent(sch: Schedule, loop: s_tir.schedule.LoopRV) -> int | None:
    """The static extent of a loop; None when it is symbolic."""
    extent = sch.get(loop).extent
    return int(extent) if isinstance(extent, tirx.IntImm) else None


def trip_count(sch: Schedule, loops: Sequence[s_tir.schedule.LoopRV]) -> int | None:
    """The product of the extents of ``loops``; None when one of them is symbolic."""
    total = 1
    for loop in loops:
        extent = loop_extent(sch, loop)
        if extent is None:
            return None
        total *= extent
    return total


def index_positions(indices: Sequence[Expr], var: tirx.Var) -> list[int]:
    """Where ``var`` appears as a whole index."""
    return [pos for pos, index in enumerate(indices)
            if isinstance(index, tirx.Var) and index.same_as(var)]


def first_divisor(extent: int, candidates: Sequence[int]) -> int:
    """The first of ``candidates`` that divides ``extent`` (1 when none does)."""
    return next((c for c in candidates if c > 0 and extent % c == 0), 1)


def vectorize_innermost(sch: Schedule, block: s_tir.schedule.SBlockRV, lanes: int) -> bool:
    """Vectorize the innermost loop of ``block``, at most four registers wide.

    A loop that no width of four or more elements divides is left alone: its
    predicated tail would not vectorize. A block that writes booleans is left
    alone too: TVM stores a vector of them as ``int8`` lanes into a ``bool``
    buffer, which does not build (OPT's causal mask). Returns whether a loop
    was vectorized.
    """
    if any(str(region.source.dtype) == "bool" for region in sch.get(block).writes):
        return False
    loop = sch.get_loops(block)[-1]
    extent = loop_extent(sch, loop)
    if extent is None or extent < 4:
        return False
    if extent <= 4 * lanes and extent % 4 == 0:
        sch.vectorize(loop)
        return True
    width = first_divisor(extent, [4 * lanes, 2 * lanes, lanes, lanes // 2, lanes // 4])
    if width < 4:
        return False
    _, inner = sch.split(loop, [None, width])
    sch.vectorize(inner)
    return True


def schedule_flat(sch: Schedule, block: Block, cpu: CPUTraits) -> None:
    """Fuse a spatial block's loops; vectorize the inner part, parallelize the rest.

    With a run-time extent (a prompt's tokens), the loops after the last run-time
    one are fused apart, so that the vectorized inner loop has a static extent
    (a row of features) and the run-time part runs around it.
    """
    loops = sch.get_loops(block.rv)
    if not loops:  # a 0-d result (one element): nothing to fuse or split
        return
    if any(loop_extent(sch, loop) == 0 for loop in loops):
        return  # an empty result (a slice of nothing): its loops never run
    static = [loop_extent(sch, loop) is not None for loop in loops]
    if not all(static) and static[-1]:
        tail = len(loops) - static[::-1].index(False)  # the loops after the last run-time one
        outer = sch.fuse(*loops[:tail]) if tail > 1 else loops[0]
        if len(loops) - tail > 1:
            sch.fuse(*loops[tail:])
        vectorize_innermost(sch, block.rv, cpu.lanes(block.output.dtype))
        if cpu.cores > 1:
            sch.parallel(outer)
        return
    fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    total = loop_extent(sch, fused) or 0
    vectorized = vectorize_innermost(sch, block.rv, cpu.lanes(block.output.dtype))
    loops = sch.get_loops(block.rv)
    if cpu.cores > 1 and total >= MIN_PARALLEL_ELEMENTS and (len(loops) > 1 or not vectorized):
        sch.parallel(loops[0])


def block_binding(sch: Schedule, block: s_tir.schedule.SBlockRV) -> list[Expr]:
    """The expressions the block's iteration variables are bound to."""
    realize = sch.get(sch.get_loops(block)[-1]).body
    if not isinstance(realize, s_tir.SBlockRealize):
        raise ScheduleError(f"{sch.get(block).name_hint}: the innermost loop holds more than "
                            "the block")
    return list(realize.iter_values)


def loops_over(sch: Schedule, block: s_tir.schedule.SBlockRV,
                kind: int) -> list[s_tir.schedule.LoopRV]:
    """The loops around ``block`` that drive one of its ``kind`` iteration variables."""
    stmt = sch.get(block)
    values = [value for iv, value in zip(stmt.iter_vars, block_binding(sch, block))
              if iv.iter_type == kind]
    return [loop for loop in sch.get_loops(block)
            if any(uses_var(value, sch.get(loop).loop_var) for value in values)]


def decompose_init(sch: Schedule, block: s_tir.schedule.SBlockRV) -> None:
    """Move a reduction's init out of its reduction loops; vectorize the init.

    It comes last in every recipe: ``parallel`` and ``vectorize`` refuse loops
    that hold a decomposed init.
    """
    reduction_loops = loops_over(sch, block, REDUCE)
    if sch.get(block).init is None or not reduction_loops:
        return
    outer = sch.get_loops(block)
    init = sch.decompose_reduction(block, reduction_loops[0])
    init_loops = sch.get_loops(init)
    if not init_loops:  # a reduction to a scalar: the init is one store
        return
    inner = init_loops[-1]
    own = not any(sch.get(inner).same_as(sch.get(loop)) for loop in outer)
    extent = loop_extent(sch, inner) or 0
    if own and extent >= 4 and extent % 4 == 0:
        sch.vectorize(inner)


# --------------------------------------------------------------------------- rules


class Rule:
    """A recipe and the block pattern it applies to.

    :meth:`match` inspects the kernel's blocks and returns what :meth:`apply`
    needs, or ``None``. :meth:`apply` schedules and returns the schedule to
    keep; it may raise :class:`tvm.s_tir.ScheduleError`, which leaves the
    kernel unscheduled.
    """

    name = "rule"

    def supports(self, cpu: CPUTraits) -> bool:
        """Whether the recipe can be built for ``cpu`` (every target, unless a rule says not)."""
        return True

    def match(self, blocks: list[Block]) -> object | None:
        raise NotImplementedError

    def apply(self, sch: Schedule, found, cpu: CPUTraits) -> Schedule:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def implement_definitions(mod: tvm.IRModule, attr: str, implement) -> tvm.IRModule:
    """``mod`` with each kernel's definition (marked ``attr``, not scheduled) implemented.

    ``implement(name, func)`` gives the implementation of a definition. A
    definition that no Relax function calls (the global-view one that the local
    view replaced by its rank's copy) is dropped. ``mod`` itself when there is
    none; otherwise a copy.
    """
    out, called = mod, None
    for gv, func in mod.functions.items():
        if not isinstance(func, tirx.PrimFunc) or func.attrs is None \
                or attr not in func.attrs or SCHEDULED_ATTR in func.attrs:
            continue
        if out is mod:
            out, called = mod.clone(), called_kernels(mod)
        if gv.name_hint in called:
            out[gv] = implement(gv.name_hint, func)
        else:
            del out[gv]
    return out


def first_line(err: BaseException) -> str:
    """The first line of an error's message (its type's name when it has none), for logs."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


@contextlib.contextmanager
def quick_macros():
    """TVMScript macros expanded meanwhile find their parser without reading source files.

    At each call, a ``T.macro`` of this TVM looks for the parser among its callers'
    frames with ``inspect.getouterframes``, which reads a line of source for every
    frame of the call stack; each lookup of a frame's file may scan all of
    ``sys.modules``. Inside a compile (torch and transformers loaded, a deep stack)
    that made the attention kernels' parse take about a second. Here the frames are
    walked directly, which finds the same parser. Use it as a decorator of the
    functions that build kernels with macros.
    """
    name = getattr(ScriptMacro, "parser_object_name", None)
    kept = ScriptMacro.__dict__.get("_find_parser_def")
    if name is None or kept is None:  # another TVM: its own lookup
        yield
        return

    def find_parser(self):
        frame = sys._getframe(1)
        while frame is not None:
            parser = frame.f_globals.get(name)
            if parser is not None:
                return parser
            frame = frame.f_back
        return kept(self)  # raises TVM's own error

    ScriptMacro._find_parser_def = find_parser
    try:
        yield
    finally:
        ScriptMacro._find_parser_def = kept
