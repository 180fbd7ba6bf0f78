"""CPU schedules for the rank-local kernels that ``distribute`` produces.

After :func:`tvm_distx.distribute` every operator is a TIR ``PrimFunc`` written
by ``relax.transform.LegalizeOps`` (possibly fused by ``FuseOps``/``FuseTIR``)
and called with ``R.call_tir``. TVM's default CPU pipeline builds those loop
nests as they are, so a matmul runs as three naive loops, about 80x slower than
numpy. :class:`ScheduleCPU` gives each kernel a hand-written
``tvm.s_tir.Schedule`` recipe, chosen by the kernel's block structure:

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

A kernel that no rule matches keeps TVM's default lowering, with an INFO log
line naming it. A rule whose recipe raises a :class:`tvm.s_tir.ScheduleError`
is abandoned the same way. Schedule primitives check their own legality, so a
recipe either yields an equivalent program or fails loudly.

TVM's runtime thread pool sizes itself to *half* the hardware threads on x86
(it assumes hyper-threading), so on a machine without SMT the parallel loops
use half the cores. Call :func:`use_cpu_threads` before the first kernel runs.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Sequence

import tvm
from tvm import relax, s_tir, tirx
from tvm.ir.expr import Call, Expr, TensorLoad
from tvm.s_tir import Schedule, ScheduleError

from ._pass import module_pass
from .targets import x86_target

__all__ = [
    "Block",
    "CPUTraits",
    "DEFAULT_RULES",
    "RULE_ATTR",
    "SCHEDULED_ATTR",
    "InjectiveRule",
    "MatmulRule",
    "ReductionRule",
    "Rule",
    "ScheduleCPU",
    "describe_blocks",
    "schedule_module",
    "schedule_primfunc",
    "use_cpu_threads",
    "x86_target",
]

logger = logging.getLogger(__name__)

#: Function attribute marking a kernel as scheduled (the one dlight also honours).
SCHEDULED_ATTR = "tirx.is_scheduled"

#: Function attribute naming the rule that scheduled a kernel.
RULE_ATTR = "tvm_distx.schedule_rule"

#: Injective kernels with fewer elements run serially: a parallel launch costs
#: more than spreading that little work saves.
MIN_PARALLEL_ELEMENTS = 1 << 14

_OP_PATTERN_OPAQUE = 8  # OpPatternKind::kOpaque: FuseOps leaves the kernel alone

#: What a failing recipe raises: schedule primitives raise ScheduleError, and
#: TVM's other C++ checks reach Python as RuntimeError (or InternalError).
_SCHEDULE_ERRORS = (ScheduleError, tvm.error.InternalError, RuntimeError)

_SPATIAL = tirx.IterVar.DataPar
_REDUCE = tirx.IterVar.CommReduce


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


@dataclass(frozen=True)
class CPUTraits:
    """What the recipes need to know about the target CPU.

    Attributes
    ----------
    vector_bits : int
        Width of one SIMD register: 512 with AVX-512, 256 with AVX2, else 128.
    cores : int
        Cores that parallel loops are spread over.
    """

    vector_bits: int
    cores: int

    @classmethod
    def of(cls, target: tvm.target.Target) -> "CPUTraits":
        """The traits of an LLVM ``target``."""
        bits = 128
        for feature, width in (("avx512f", 512), ("avx2", 256)):
            try:
                if tvm.target.codegen.target_has_features(feature, target):
                    bits = width
                    break
            except _SCHEDULE_ERRORS:  # not an x86 target
                break
        cores = int(target.attrs.get("num-cores", 0) or os.cpu_count() or 1)
        return cls(vector_bits=bits, cores=cores)

    def lanes(self, dtype: str) -> int:
        """Elements of ``dtype`` in one vector register."""
        return max(1, self.vector_bits // tvm.runtime.DataType(dtype).bits)


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
            if iv.iter_type != _SPATIAL:
                break
            count += 1
        return count

    def reads_own_output(self) -> bool:
        return any(load.source.same_as(self.output) for load in self.loads)


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


def _uses(expr: Expr, var: tirx.Var) -> bool:
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
    spatial = [iv.var for iv in stmt.iter_vars if iv.iter_type == _SPATIAL]
    reduce = [iv.var for iv in stmt.iter_vars if iv.iter_type == _REDUCE]
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


def _extent(sch: Schedule, loop: s_tir.schedule.LoopRV) -> int | None:
    extent = sch.get(loop).extent
    return int(extent) if isinstance(extent, tirx.IntImm) else None


def _trip_count(sch: Schedule, loops: Sequence[s_tir.schedule.LoopRV]) -> int | None:
    total = 1
    for loop in loops:
        extent = _extent(sch, loop)
        if extent is None:
            return None
        total *= extent
    return total


def _positions(indices: Sequence[Expr], var: tirx.Var) -> list[int]:
    """Where ``var`` appears as a whole index."""
    return [pos for pos, index in enumerate(indices)
            if isinstance(index, tirx.Var) and index.same_as(var)]


def _first_divisor(extent: int, candidates: Sequence[int]) -> int:
    return next((c for c in candidates if c > 0 and extent % c == 0), 1)


def _vectorize_innermost(sch: Schedule, block: s_tir.schedule.SBlockRV, lanes: int) -> bool:
    """Vectorize the innermost loop of ``block``, at most four registers wide.

    A loop that no width of four or more elements divides is left alone: its
    predicated tail would not vectorize. Returns whether a loop was vectorized.
    """
    loop = sch.get_loops(block)[-1]
    extent = _extent(sch, loop)
    if extent is None or extent < 4:
        return False
    if extent <= 4 * lanes and extent % 4 == 0:
        sch.vectorize(loop)
        return True
    width = _first_divisor(extent, [4 * lanes, 2 * lanes, lanes, lanes // 2, lanes // 4])
    if width < 4:
        return False
    _, inner = sch.split(loop, [None, width])
    sch.vectorize(inner)
    return True


def _schedule_flat(sch: Schedule, block: Block, cpu: CPUTraits) -> None:
    """Fuse a spatial block's loops; vectorize the inner part, parallelize the rest."""
    loops = sch.get_loops(block.rv)
    fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    total = _extent(sch, fused) or 0
    vectorized = _vectorize_innermost(sch, block.rv, cpu.lanes(block.output.dtype))
    loops = sch.get_loops(block.rv)
    if cpu.cores > 1 and total >= MIN_PARALLEL_ELEMENTS and (len(loops) > 1 or not vectorized):
        sch.parallel(loops[0])


def _binding(sch: Schedule, block: s_tir.schedule.SBlockRV) -> list[Expr]:
    """The expressions the block's iteration variables are bound to."""
    realize = sch.get(sch.get_loops(block)[-1]).body
    if not isinstance(realize, s_tir.SBlockRealize):
        raise ScheduleError(f"{sch.get(block).name_hint}: the innermost loop holds more than "
                            "the block")
    return list(realize.iter_values)


def _loops_over(sch: Schedule, block: s_tir.schedule.SBlockRV,
                kind: int) -> list[s_tir.schedule.LoopRV]:
    """The loops around ``block`` that drive one of its ``kind`` iteration variables."""
    stmt = sch.get(block)
    values = [value for iv, value in zip(stmt.iter_vars, _binding(sch, block))
              if iv.iter_type == kind]
    return [loop for loop in sch.get_loops(block)
            if any(_uses(value, sch.get(loop).loop_var) for value in values)]


def _decompose(sch: Schedule, block: s_tir.schedule.SBlockRV) -> None:
    """Move a reduction's init out of its reduction loops; vectorize the init.

    It comes last in every recipe: ``parallel`` and ``vectorize`` refuse loops
    that hold a decomposed init.
    """
    reduction_loops = _loops_over(sch, block, _REDUCE)
    if sch.get(block).init is None or not reduction_loops:
        return
    outer = sch.get_loops(block)
    init = sch.decompose_reduction(block, reduction_loops[0])
    init_loops = sch.get_loops(init)
    if not init_loops:  # a reduction to a scalar: the init is one store
        return
    inner = init_loops[-1]
    own = not any(sch.get(inner).same_as(sch.get(loop)) for loop in outer)
    extent = _extent(sch, inner) or 0
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

    def match(self, blocks: list[Block]) -> object | None:
        raise NotImplementedError

    def apply(self, sch: Schedule, found, cpu: CPUTraits) -> Schedule:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


@dataclass
class MatmulMatch:
    """A matmul block with the role of each variable and operand."""

    block: Block
    prologue: list[Block]
    epilogue: list[Block]
    i: tirx.Var
    j: tirx.Var
    k: tirx.Var
    lhs: TensorLoad
    rhs: TensorLoad


class MatmulRule(Rule):
    """Matmul and batch matmul, with injective prologues and epilogues.

    Parameters
    ----------
    rows : int, optional
        Rows ``mr`` of the register tile.
    vectors : int, optional
        Columns ``nr`` of the register tile, in vector registers. By default
        the tile is 4 x 4 registers with AVX-512 (16 of the 32 vector
        registers accumulate; only four rows of ``A`` are streamed, which
        avoids cache-set conflicts at power-of-two row strides) and 6 x 2
        otherwise (12 of 16).
    pack : bool, default True
        Pack each ``nr``-wide panel of the right operand contiguously before
        the micro-kernel reads it. It removes the strided panel reads whose
        cache-set conflicts halve the speed of large matmuls.
    """

    name = "matmul"

    def __init__(self, rows: int | None = None, vectors: int | None = None,
                 pack: bool = True) -> None:
        self.rows = rows
        self.vectors = vectors
        self.pack = pack

    def __repr__(self) -> str:
        return f"MatmulRule(rows={self.rows}, vectors={self.vectors}, pack={self.pack})"

    def match(self, blocks: list[Block]) -> MatmulMatch | None:
        reductions = [b for b in blocks if not b.is_spatial]
        if len(reductions) != 1:
            return None
        mm = reductions[0]
        if mm.store is None or not mm.trivial_binding or len(mm.reduce) != 1:
            return None
        if not 2 <= len(mm.spatial) <= 3 or mm.leading_spatial != len(mm.spatial):
            return None
        if not isinstance(mm.store.value, tirx.Add):
            return None
        others = [b for b in blocks if b is not mm]
        if any(b.store is None or b.reads_own_output() for b in others):
            return None
        out = mm.store.indices
        if len(out) != len(mm.spatial) or any(
                not (isinstance(index, tirx.Var) and index.same_as(var))
                for index, var in zip(out, mm.spatial)):
            return None
        i, j = mm.spatial[-2:]
        (k,) = mm.reduce
        operands = [load for load in mm.loads if not load.source.same_as(mm.output)]
        if len(operands) != 2 or not all(isinstance(index, (tirx.Var, tirx.IntImm))
                                         for load in operands for index in load.indices):
            return None

        def shape(load: TensorLoad) -> tuple[int, int, int]:
            return tuple(len(_positions(load.indices, v)) for v in (i, j, k))

        lhs = [op for op in operands if shape(op) == (1, 0, 1)]
        rhs = [op for op in operands if shape(op) == (0, 1, 1)]
        if len(lhs) != 1 or len(rhs) != 1:
            return None
        at = blocks.index(mm)
        return MatmulMatch(mm, blocks[:at], blocks[at + 1:], i, j, k, lhs[0], rhs[0])

    def tile(self, m: int, n: int, cpu: CPUTraits, dtype: str) -> tuple[int, int]:
        """The register tile ``(mr, nr)`` for an ``m x n`` output.

        The largest preferred sizes that divide the output, so that no loop
        needs a predicated tail.
        """
        lanes = cpu.lanes(dtype)
        wide = cpu.vector_bits >= 512
        rows = self.rows or (4 if wide else 6)
        mr = _first_divisor(m, [rows] + [r for r in (8, 6, 4, 3, 2) if r < rows])
        cols = (self.vectors or (4 if wide else 2)) * lanes
        nr = _first_divisor(n, [cols] + [c for c in (4 * lanes, 2 * lanes, lanes, lanes // 2,
                                                     lanes // 4) if c < cols])
        return mr, nr

    def apply(self, sch: Schedule, found: MatmulMatch, cpu: CPUTraits) -> Schedule:
        mm = found.block.rv
        dtype = found.block.output.dtype
        for producer in found.prologue:
            try:
                sch.compute_inline(producer.rv)
            except ScheduleError:
                logger.debug("matmul: prologue %s stays a loop nest of its own", producer.name)
                _schedule_flat(sch, producer, cpu)
        # The accumulator tile; the epilogue then reads it instead of memory.
        acc_store = sch.cache_write(mm, 0, "local")
        separate = []
        for consumer in found.epilogue:
            try:
                sch.reverse_compute_inline(consumer.rv)
            except ScheduleError:
                separate.append(consumer)

        *batch, i, j, k = sch.get_loops(mm)
        m, n = _extent(sch, i), _extent(sch, j)
        if n is None:
            raise ScheduleError("matmul: the recipe needs a static number of columns")
        # A symbolic row count (tokens, say) gets one-row tiles: no tail to predicate.
        mr, nr = self.tile(m if m is not None else 1, n, cpu, dtype)
        io, ii = sch.split(i, [None, mr]) if mr > 1 else (i, None)
        jo, ji = sch.split(j, [None, nr])
        sch.reorder(*batch, jo, io, k, *([ii] if ii is not None else []), ji)

        # The packed panel sits between jo and io, so jo (with the batch) is then
        # the parallel loop: pack only when it has work for every core.
        panels = (n // nr) * (_trip_count(sch, batch) or 1)
        pack = self.pack and nr > 1 and panels >= cpu.cores
        if pack:
            self._pack_panel(sch, found, nr, jo)
        sch.reverse_compute_at(acc_store, io)
        _vectorize_innermost(sch, acc_store, cpu.lanes(dtype))
        for consumer in separate:
            sch.reverse_compute_at(consumer.rv, io)
            _vectorize_innermost(sch, consumer.rv, cpu.lanes(consumer.output.dtype))
        outer = sch.fuse(*batch, jo) if batch else jo
        if not pack:
            outer = sch.fuse(outer, io)
        if cpu.cores > 1:
            sch.parallel(outer)
        if ii is not None:
            sch.unroll(ii)
        if nr > 1:
            sch.vectorize(ji)
        _decompose(sch, mm)
        return sch

    @staticmethod
    def _pack_panel(sch: Schedule, found: MatmulMatch, nr: int,
                    panel_loop: s_tir.schedule.LoopRV) -> None:
        """Copy the right operand into ``[.., n / nr, k, nr]``, one panel per ``jo``."""
        rhs = found.rhs
        (j_at,) = _positions(rhs.indices, found.j)
        (k_at,) = _positions(rhs.indices, found.k)
        rest = [d for d in range(len(rhs.indices)) if d not in (j_at, k_at)]

        def packed(*index):
            return [index[d] for d in rest] + [index[j_at] // nr, index[k_at], index[j_at] % nr]

        pack = sch.cache_read(found.block.rv, rhs.source.name, "global")
        sch.transform_layout(pack, ("write", 0),
                             tirx.IndexMap.from_func(packed, ndim=len(rhs.indices)))
        sch.compute_at(pack, panel_loop)
        inner = sch.get_loops(pack)[-1]
        if _extent(sch, inner) == nr:
            sch.vectorize(inner)


class InjectiveRule(Rule):
    """Kernels made only of spatial blocks: elementwise, broadcast, layout changes."""

    name = "injective"

    def match(self, blocks: list[Block]) -> list[Block] | None:
        if not blocks or any(not b.is_spatial or b.store is None or b.reads_own_output()
                             for b in blocks):
            return None
        return blocks

    def apply(self, sch: Schedule, found: list[Block], cpu: CPUTraits) -> Schedule:
        kept = []
        for block in found[:-1]:
            try:
                sch.compute_inline(block.rv)
            except ScheduleError:
                kept.append(block)
        for block in kept + found[-1:]:
            _schedule_flat(sch, block, cpu)
        return sch


class ReductionRule(Rule):
    """Reductions and their elementwise companions: sum, max, softmax, norms."""

    name = "reduction"

    def match(self, blocks: list[Block]) -> list[Block] | None:
        if not blocks or all(b.is_spatial for b in blocks):
            return None
        for b in blocks:
            if b.store is None or not b.trivial_binding:
                return None
            if b.is_spatial and b.reads_own_output():
                return None
        return blocks

    def apply(self, sch: Schedule, found: list[Block], cpu: CPUTraits) -> Schedule:
        rows = min([b.leading_spatial for b in found if not b.is_spatial]
                   + [found[-1].leading_spatial])
        # Rows are worth sharing when the reductions run along them; a reduction
        # over a leading axis vectorizes across its output columns instead.
        if rows and not any(self._reduces_columns(b) for b in found):
            per_row = self._per_row(sch.copy(), found, rows, cpu)
            if per_row is not None:
                return per_row
        reductions = []
        for block in found:
            if block.is_spatial:
                _schedule_flat(sch, block, cpu)
                continue
            partial = self._rfactor(sch, block, cpu)
            if partial is None and self._vectorize_columns(sch, block, cpu):
                reductions.append(block.rv)
                continue
            for rv in ([partial] if partial is not None else []) + [block.rv]:
                loops = sch.get_loops(rv)[:block.leading_spatial]
                if cpu.cores > 1 and (_trip_count(sch, loops) or 0) > 1:
                    sch.parallel(sch.fuse(*loops) if len(loops) > 1 else loops[0])
                reductions.append(rv)
            if partial is not None:
                self._vectorize_lanes(sch, partial)
        for rv in reductions:
            _decompose(sch, rv)
        return sch

    def _per_row(self, sch: Schedule, blocks: list[Block], rows: int,
                 cpu: CPUTraits) -> Schedule | None:
        """Compute every block per row of the output block, in one parallel loop.

        Gives up (``None``) when ``compute_at`` refuses, or when a block would be
        recomputed for every row because its rows are not the output's rows
        (a softmax over a leading axis, say).
        """
        partials = [p for p in (self._rfactor(sch, b, cpu) for b in blocks if not b.is_spatial)
                    if p is not None]
        row_loops = sch.get_loops(blocks[-1].rv)[:rows]
        for rv in reversed(sch.get_child_blocks(sch.get_sblock("root"))[:-1]):
            before = _trip_count(sch, sch.get_loops(rv))
            try:
                sch.compute_at(rv, row_loops[-1])
            except ScheduleError:
                return None
            after = _trip_count(sch, sch.get_loops(rv))
            if before is None or after is None or after > before:
                logger.debug("reduction: %s would be recomputed for every row",
                             sch.get(rv).name_hint)
                return None
        for block in blocks:
            if block.is_spatial and len(sch.get_loops(block.rv)) > rows:
                inner = sch.get_loops(block.rv)[rows:]
                if len(inner) > 1:
                    sch.fuse(*inner)
                _vectorize_innermost(sch, block.rv, cpu.lanes(block.output.dtype))
        for partial in partials:
            self._vectorize_lanes(sch, partial)
        if cpu.cores > 1 and (_trip_count(sch, row_loops) or 0) > 1:
            sch.parallel(sch.fuse(*row_loops) if rows > 1 else row_loops[0])
        for rv in partials + [b.rv for b in blocks if not b.is_spatial]:
            _decompose(sch, rv)
        return sch

    @staticmethod
    def _rfactor(sch: Schedule, block: Block, cpu: CPUTraits) -> s_tir.schedule.SBlockRV | None:
        """Split a contiguous innermost reduction into vector lanes.

        ``acc[r] = sum_k x[r, k]`` becomes ``part[r, l] = sum_ko x[r, ko * L + l]``
        followed by ``acc[r] = sum_l part[r, l]``. Only a single reduction
        variable that is innermost, and the last index of every operand it
        indexes, qualifies; other reductions stay scalar.

        Returns the new partial-reduction block, or ``None``.
        """
        if len(block.reduce) != 1 or block.leading_spatial != len(block.stmt.iter_vars) - 1:
            return None
        (k,) = block.reduce
        operands = [load for load in block.loads
                    if not load.source.same_as(block.output) and _positions(load.indices, k)]
        if not operands or any(_positions(load.indices, k) != [len(load.indices) - 1]
                               for load in operands):
            return None
        lanes = cpu.lanes(block.output.dtype)
        extent = _extent(sch, sch.get_loops(block.rv)[-1])
        if extent is None or extent % lanes or extent < 2 * lanes:
            return None
        _, lane = sch.split(sch.get_loops(block.rv)[-1], [None, lanes])
        try:
            return sch.rfactor(lane, factor_axis=len(block.spatial))
        except ScheduleError as err:  # e.g. a reducer rfactor does not know
            logger.debug("reduction: %s stays scalar (%s)", block.name, _first_line(err))
            return None

    @staticmethod
    def _reduces_columns(block: Block) -> bool:
        """Whether the innermost spatial variable is the last index of every operand."""
        if block.is_spatial or not block.spatial or block.leading_spatial != len(block.spatial):
            return False
        column = block.spatial[-1]
        operands = [load for load in block.loads if not load.source.same_as(block.output)]
        return bool(operands) and all(
            load.indices and isinstance(load.indices[-1], tirx.Var)
            and load.indices[-1].same_as(column) for load in operands)

    @staticmethod
    def _vectorize_columns(sch: Schedule, block: Block, cpu: CPUTraits) -> bool:
        """Reduce over a leading axis with the contiguous output axis in vector lanes.

        ``acc[j] = sum_k x[k, j]`` runs as ``for jo: for k: acc[jo, :] += x[k, jo, :]``,
        the lane loop vectorized and the ``jo`` loops parallel. It applies when
        the innermost spatial variable is the last index of every operand, and
        no reduction variable is. Returns whether it was applied.
        """
        if not ReductionRule._reduces_columns(block):
            return False
        loops = sch.get_loops(block.rv)
        spatial, reduction = loops[:len(block.spatial)], loops[len(block.spatial):]
        lanes = cpu.lanes(block.output.dtype)
        extent = _extent(sch, spatial[-1])
        width = _first_divisor(extent or 0, [4 * lanes, 2 * lanes, lanes])
        if extent is None or width < 4:
            return False
        outer, lane = sch.split(spatial[-1], [None, width])
        sch.reorder(outer, *reduction, lane)
        sch.vectorize(lane)
        parallel = spatial[:-1] + [outer]
        if cpu.cores > 1 and (_trip_count(sch, parallel) or 0) > 1:
            sch.parallel(sch.fuse(*parallel) if len(parallel) > 1 else outer)
        return True

    @staticmethod
    def _vectorize_lanes(sch: Schedule, partial: s_tir.schedule.SBlockRV) -> None:
        """Vectorize the lane loop of a partial reduction, inside its reduction loop."""
        stmt = sch.get(partial)
        lane_var = stmt.body.indices[-1]
        values = _binding(sch, partial)
        (lane_value,) = [value for iv, value in zip(stmt.iter_vars, values)
                         if iv.var.same_as(lane_var)]
        lane = [loop for loop in sch.get_loops(partial)
                if _uses(lane_value, sch.get(loop).loop_var)]
        reduction = _loops_over(sch, partial, _REDUCE)
        if len(lane) != 1 or len(reduction) != 1:
            return
        sch.reorder(reduction[0], lane[0])
        sch.vectorize(lane[0])


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


#: The rules, tried in order; the first that matches schedules the kernel.
DEFAULT_RULES: tuple[Rule, ...] = (MatmulRule(), InjectiveRule(), ReductionRule())


# --------------------------------------------------------------------------- driver


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
    try:
        sch = Schedule(func)
        blocks = describe_blocks(sch)
    except _SCHEDULE_ERRORS as err:
        logger.info("schedule: %s has no block structure the rules read; keeping TVM's "
                    "default lowering (%s)", name, _first_line(err))
        return None
    for rule in rules:
        found = rule.match(blocks)
        if found is None:
            continue
        try:
            sch = rule.apply(sch, found, cpu)
        except _SCHEDULE_ERRORS as err:
            logger.info("schedule: the %s recipe failed on %s; keeping TVM's default lowering "
                        "(%s)", rule.name, name, _first_line(err))
            return None
        except Exception:  # noqa: BLE001 - a bug in a recipe must not break the build
            logger.warning("schedule: the %s recipe crashed on %s (a bug, please report it); "
                           "keeping TVM's default lowering", rule.name, name, exc_info=True)
            return None
        logger.debug("schedule: %s scheduled by the %s rule", name, rule.name)
        return sch.mod["main"].with_attrs({SCHEDULED_ATTR: True, RULE_ATTR: rule.name})
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
        scheduled = {}
        for gvar, func in mod.functions.items():
            if not isinstance(func, tirx.PrimFunc):
                continue
            if func.attrs is not None and bool(func.attrs.get(SCHEDULED_ATTR, False)):
                logger.debug("schedule: %s is scheduled already", gvar.name_hint)
                continue
            new = schedule_primfunc(func, self.target, name=gvar.name_hint, rules=self.rules)
            if new is not None:
                scheduled[gvar] = new.with_attr("op_pattern", _OP_PATTERN_OPAQUE)
        if not scheduled:
            return mod
        mod = mod.clone()  # never update the caller's module in place
        for gvar, func in scheduled.items():
            mod.update_func(gvar, func)
        return mod


def schedule_module(mod: tvm.IRModule, target: tvm.target.Target | None = None, *,
                    fuse: bool = True) -> tvm.IRModule:
    """Fuse the kernels of a lowered module, then schedule them for the CPU.

    Parameters
    ----------
    mod : tvm.IRModule
        A module whose operators are TIR kernels called with ``R.call_tir``,
        such as the output of :func:`tvm_distx.distribute`.
    target : tvm.target.Target, optional
        The LLVM CPU target; :func:`x86_target` by default.
    fuse : bool, default True
        First run ``AnnotateTIROpPattern``, ``FuseOps`` and ``FuseTIR``, so that
        a matmul and its elementwise consumers become one kernel whose epilogue
        runs on the register tile.

    Returns
    -------
    tvm.IRModule
        The module with scheduled kernels, ready for ``tvm.compile``.
    """
    if fuse and any(isinstance(func, relax.Function) for func in mod.functions.values()):
        mod = tvm.transform.Sequential([relax.transform.AnnotateTIROpPattern(),
                                        relax.transform.FuseOps(),
                                        relax.transform.FuseTIR(),
                                        relax.transform.DeadCodeElimination()])(mod)
    return ScheduleCPU(target)(mod)
