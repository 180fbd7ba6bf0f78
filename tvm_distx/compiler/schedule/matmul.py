"""The matmul recipe: a register-blocked micro-kernel with packed panels.

:class:`MatmulRule` matches one reduction block ``C[b.., i, j] += A[.., i, k] *
B[.., k, j]`` (either operand layout, optional batch axes) with injective
prologue and epilogue blocks. The micro-kernel accumulates a tile of ``C`` in
vector registers, in one of two orientations:

**Row panels** (the right operand is a weight stored ``(out, in)``, ``B[.., j,
k]``, as every linear layer of a language model): the vectors run along the
rows ``i`` (the prompt's tokens). The left operand is packed into panels of
``[k, P]`` rows (``P`` is two vectors; the copy also pads a run-time row count to
whole panels), the tile is ``mr`` weight rows by ``P`` tokens, and each step of
``k`` broadcasts one value from each of the ``mr`` weight rows, which are read
in place, contiguously, once per panel of tokens. The tile is written to a
transposed ``[j, i]`` buffer (whole vectors), and the epilogue runs in the copy
back to ``[i, j]``. Only the activations are packed, never the weight, so the
cost of a call is its arithmetic even for a few rows: the column-panel
orientation below has to transpose the whole weight into panels on every call.
The weight rows are taken in blocks of about 256 KiB
(:attr:`MatmulRule.WEIGHT_BLOCK_BYTES`), and every token panel passes over a
block while it sits in L2: a panel then comes from L3 once per block, not once
per ``mr`` rows, which is what lets two ranks on one chip each run at the speed
of one alone. A weight stored in another format is decoded once per block into
a buffer that the token panels share. With AVX-512 a kernel over a run-time row
count holds a second micro-kernel with panels of one vector and runs it for the
row counts that two-vector panels would pad most
(:meth:`MatmulRule.short_panels_cost_less`).

**Column panels** (any other layout): the vectors run along the columns ``j``;
each ``nr``-wide panel of ``B`` is packed into a contiguous ``[k, nr]`` buffer by
the thread that owns it, and the tile is ``mr`` rows by ``nr`` columns.

:mod:`tvm_distx.compiler.schedule` describes the rule's place among the others.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import tvm
from tvm import s_tir, tirx
from tvm.runtime import DataType
from tvm.ir.expr import TensorLoad
from tvm.s_tir import Schedule, ScheduleError

from tvm_distx.compiler.schedule.base import (Block, CPUTraits, Rule, decompose_init, describe_blocks,
                   first_divisor, first_line, index_positions, loop_extent, schedule_flat,
                   trip_count, vectorize_innermost)

__all__ = ["MatmulMatch", "MatmulRule"]

logger = logging.getLogger(__name__)


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
    #: blocks after the matmul that do not read its result (an epilogue's other
    #: operand, such as a broadcast bias); they are inlined into their consumers
    side: list[Block] = field(default_factory=list)


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
        Column panels: pack each ``nr``-wide panel of the right operand
        contiguously before the micro-kernel reads it. It removes the strided
        panel reads whose cache-set conflicts halve the speed of large matmuls.
    row_panels : bool, default True
        Use the row-panel micro-kernel when the right operand is stored ``(out,
        in)``; ``rows`` then sets its weight rows ``mr`` (8 with AVX-512, else 6).
    """

    name = "matmul"

    #: The most spatial axes (batch axes, rows, columns) of a matmul block the rule takes.
    max_spatial = 4

    #: Row panels: the bytes of weight rows (as float32) that one block of the tile loop
    #: covers; with one token panel they stay in a core's L2.
    WEIGHT_BLOCK_BYTES = 256 << 10

    def __init__(self, rows: int | None = None, vectors: int | None = None,
                 pack: bool = True, row_panels: bool = True) -> None:
        self.rows = rows
        self.vectors = vectors
        self.pack = pack
        self.row_panels = row_panels

    def __repr__(self) -> str:
        return (f"MatmulRule(rows={self.rows}, vectors={self.vectors}, pack={self.pack}, "
                f"row_panels={self.row_panels})")

    def match(self, blocks: list[Block]) -> MatmulMatch | None:
        reductions = [b for b in blocks if not b.is_spatial]
        if len(reductions) != 1:
            return None
        mm = reductions[0]
        if mm.store is None or not mm.trivial_binding or len(mm.reduce) != 1:
            return None
        if not 2 <= len(mm.spatial) <= self.max_spatial or mm.leading_spatial != len(mm.spatial):
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
            return tuple(len(index_positions(load.indices, v)) for v in (i, j, k))

        lhs = [op for op in operands if shape(op) == (1, 0, 1)]
        rhs = [op for op in operands if shape(op) == (0, 1, 1)]
        if len(lhs) != 1 or len(rhs) != 1:
            return None
        at = blocks.index(mm)
        # An epilogue block reads the matmul's result, directly or through another
        # epilogue block. A block that does not is a side producer: computed at the
        # tile loop it would cover every tile (all batches), and its consumers with it.
        derived, epilogue, side = {mm.output}, [], []
        for block in blocks[at + 1:]:
            if any(any(load.source.same_as(buf) for buf in derived) for load in block.loads):
                epilogue.append(block)
                derived.add(block.output)
            else:
                side.append(block)
        return MatmulMatch(mm, blocks[:at], epilogue, i, j, k, lhs[0], rhs[0], side)

    def tile(self, m: int, n: int, cpu: CPUTraits, dtype: str) -> tuple[int, int]:
        """The register tile ``(mr, nr)`` for an ``m x n`` output.

        The largest preferred sizes that divide the output, so that no loop
        needs a predicated tail.
        """
        lanes = cpu.lanes(dtype)
        wide = cpu.vector_bits >= 512
        rows = self.rows or (4 if wide else 6)
        mr = first_divisor(m, [rows] + [r for r in (8, 6, 4, 3, 2) if r < rows])
        cols = (self.vectors or (4 if wide else 2)) * lanes
        nr = first_divisor(n, [cols] + [c for c in (4 * lanes, 2 * lanes, lanes, lanes // 2,
                                                     lanes // 4) if c < cols])
        return mr, nr

    def apply(self, sch: Schedule, found: MatmulMatch, cpu: CPUTraits) -> Schedule:
        if self.row_panels and self.weight_rows(found):
            trial = sch.copy()
            try:
                long = self._apply_row_panels(trial, found, cpu)
            except ScheduleError as err:
                logger.debug("matmul: row panels do not fit %s (%s); column panels",
                             found.block.name, first_line(err))
            else:
                return self._with_short_panels(sch, found, cpu, long)
        return self._apply_column_panels(sch, found, cpu)

    def _with_short_panels(self, sch: Schedule, found: MatmulMatch, cpu: CPUTraits,
                           long: Schedule) -> Schedule:
        """Row panels of two vectors, and of one for the row counts they would pad most.

        A run-time row count is padded to whole panels. Panels of two vectors
        feed the micro-kernel best, but a prompt of 16 tokens would then compute
        32 rows. With AVX-512 a second micro-kernel of one vector of tokens by
        :attr:`SHORT_PANEL_ROWS` weight rows (about 0.88 of the speed of the
        long one, measured with ``scripts/bench/kernels.py --prefill``) takes the
        row counts where that costs less than the padding; the kernel chooses at
        run time (:meth:`short_panels_cost_less`). Static row counts, other
        vector widths and weights that the two variants would not share keep the
        long panels alone.
        """
        if cpu.vector_bits < 512:
            return long
        *_, i, _, _ = sch.get_loops(found.block.rv)
        rows = sch.get(i).extent
        if isinstance(rows, tirx.IntImm):
            return long
        try:
            short = self._apply_row_panels(sch.copy(), found, cpu, vectors=1)
        except ScheduleError as err:
            logger.debug("matmul: no short row panels for %s (%s)", found.block.name,
                         first_line(err))
            return long
        merged = _dispatch(short.mod["main"], long.mod["main"],
                           self.short_panels_cost_less(rows, cpu.lanes(found.block.output.dtype)))
        if merged is None:
            return long
        # the two bodies define the same loop variables: one definition each, renamed
        return Schedule(s_tir.transform.ConvertSSA()(tvm.IRModule({"main": merged})))

    #: Weight rows of the short row panels' tile (one vector of tokens each); a taller
    #: tile of 16 rows measured slower.
    SHORT_PANEL_ROWS = 8

    @staticmethod
    def short_panels_cost_less(rows: tirx.PrimExpr, lanes: int) -> tirx.PrimExpr:
        """Whether ``rows`` padded to one-vector panels cost less than to two-vector ones.

        The long panels run about 9/8 as fast: the short ones win when padding to
        two vectors adds more than an eighth to the rows of one-vector panels.
        """
        def padded(width: int) -> tirx.PrimExpr:
            return tirx.floordiv(rows + (width - 1), width) * width

        return padded(2 * lanes) * 8 > padded(lanes) * 9

    @staticmethod
    def weight_rows(found: MatmulMatch) -> bool:
        """Whether the right operand is read as rows ``B[.., j, k]``, ``k`` contiguous."""
        indices = found.rhs.indices
        (j_at,) = index_positions(indices, found.j)
        (k_at,) = index_positions(indices, found.k)
        return j_at < k_at == len(indices) - 1

    @staticmethod
    def _inline_prologue(sch: Schedule, found: MatmulMatch, cpu: CPUTraits) -> list[Block]:
        """Inline the prologue and side producers; the weight decodes, left for the recipe."""
        for producer in (p for p in found.prologue if not p.decode):
            try:
                sch.compute_inline(producer.rv)
            except ScheduleError:
                logger.debug("matmul: prologue %s stays a loop nest of its own", producer.name)
                schedule_flat(sch, producer, cpu)
        for producer in found.side:
            # raises ScheduleError when it cannot be inlined: the recipe is abandoned
            sch.compute_inline(producer.rv)
        return [p for p in found.prologue if p.decode]

    @staticmethod
    def _inline_epilogue(sch: Schedule, found: MatmulMatch) -> list[Block]:
        """Inline the epilogue chain into the block that stores the product; the rest.

        A value that a later block reads too (silu's ``x * sigmoid(x)``) must stay
        in memory, and TVM's ``reverse_compute_inline`` does not check that (it
        leaves a read of a buffer that nothing writes any more): the chain stops
        there, and the blocks after it are returned, to be scheduled on their own.
        """
        separate = []
        tail = found.block.output
        for consumer in found.epilogue:
            readers = [b for b in found.epilogue
                       if any(load.source.same_as(tail) for load in b.loads)]
            if separate or len(readers) != 1 or readers[0] is not consumer:
                separate.append(consumer)
                continue
            try:
                sch.reverse_compute_inline(consumer.rv)
                tail = consumer.output
            except ScheduleError:
                separate.append(consumer)
        return separate

    def _apply_row_panels(self, sch: Schedule, found: MatmulMatch, cpu: CPUTraits,
                          vectors: int = 2) -> Schedule:
        """The row-panel micro-kernel (the module's docstring describes it).

        ``vectors`` is the width of a token panel in vectors: 2, or 1 for the
        short panels of :meth:`_with_short_panels` (with a taller tile).
        """
        mm = found.block.rv
        dtype = found.block.output.dtype
        decodes = self._inline_prologue(sch, found, cpu)
        lanes = cpu.lanes(dtype)
        *batch, i, j, _ = sch.get_loops(mm)
        rows, n = loop_extent(sch, i), loop_extent(sch, j)
        if n is None:
            raise ScheduleError("matmul: the recipe needs a static number of columns")
        # one vector of tokens when the rows fit in one, else two
        panel = lanes if rows is not None and rows <= lanes else vectors * lanes
        wide = cpu.vector_bits >= 512
        tall = self.SHORT_PANEL_ROWS if vectors == 1 else self.rows or (8 if wide else 6)
        mr = first_divisor(n, [tall, 8, 6, 4, 3, 2])
        before = {b.name for b in describe_blocks(sch)}
        padded = rows is None or rows % panel != 0
        if padded:  # copies of the left operand and of the result with whole panels of rows
            sch.pad_einsum(mm, [1] * len(batch) + [panel, 1, 1])
        lhs = found.lhs
        pack = next((b.rv for b in describe_blocks(sch)
                     if b.name not in before and b.output.name == f"{lhs.source.name}_pad"),
                    None)
        if pack is None:
            pack = sch.cache_read(mm, lhs.source.name, "global")
        sch.transform_layout(pack, ("write", 0), _panels(lhs, found.i, found.k, panel))
        if not padded:
            sch.cache_write(mm, 0, "global")  # the transposed tile needs a buffer of its own
        sch.transform_layout(mm, ("write", 0), tirx.IndexMap.from_func(
            lambda *index: [*index[:-2], index[-1], index[-2]], ndim=len(batch) + 2))
        separate = self._inline_epilogue(sch, found)
        acc_store = sch.cache_write(mm, 0, "local")

        *batch, i, j, k = sch.get_loops(mm)
        io, ii = sch.split(i, [None, panel])
        # Blocks of weight rows that stay in L2 while every token panel passes over them,
        # so that a panel is read from L3 once per block rather than once per mr rows
        # (two ranks streaming panels from a shared L3 at once halve each other's speed)
        tiles, row_bytes = n // mr, (loop_extent(sch, k) or 1) * DataType(dtype).bits // 8
        largest = max(1, min(tiles, self.WEIGHT_BLOCK_BYTES // (mr * row_bytes)))
        group = first_divisor(tiles, range(largest, 0, -1))
        jb, jo, ji = sch.split(j, [None, group, mr])
        sch.reorder(*batch, jb, io, jo, k, ji, ii)
        if decodes:  # decoded once per block of weight rows, shared by the token panels
            rows_buffer = sch.cache_read(mm, found.rhs.source.name, "global")
            sch.compute_at(rows_buffer, jb)
            for producer in decodes:
                sch.compute_inline(producer.rv)
            # one vector at a time: it stays within a half of a q4 group, whose nibbles
            # then come from 16 consecutive bytes with one shift
            depth = sch.get_loops(rows_buffer)[-1]
            if (loop_extent(sch, depth) or 1) % lanes == 0:
                sch.vectorize(sch.split(depth, [None, lanes])[1])
            else:
                vectorize_innermost(sch, rows_buffer, lanes)
        sch.reverse_compute_at(acc_store, jo)
        vectorize_innermost(sch, acc_store, lanes)
        # the copy back to [i, j], with the epilogue, per block of weight rows while in cache
        (copy,) = sch.get_consumers(acc_store)
        sch.reverse_compute_at(copy, jb)
        vectorize_innermost(sch, copy, lanes)
        for consumer in separate:
            schedule_flat(sch, consumer, cpu)
        # the pack, one panel of tokens at a time, a vector of rows per k
        *_, rows_loop, depth = sch.get_loops(pack)
        po, pi = sch.split(rows_loop, [None, panel])
        sch.reorder(po, depth, pi)
        sch.vectorize(pi)
        if cpu.cores > 1:
            sch.parallel(sch.fuse(*sch.get_loops(pack)[:-2]))
        outer = sch.fuse(*batch, jb) if batch else jb
        if cpu.cores > 1:
            sch.parallel(outer)
        sch.unroll(ji)
        sch.vectorize(ii)
        decompose_init(sch, mm)
        return sch

    def _apply_column_panels(self, sch: Schedule, found: MatmulMatch,
                             cpu: CPUTraits) -> Schedule:
        """The column-panel micro-kernel (the module's docstring describes it)."""
        mm = found.block.rv
        dtype = found.block.output.dtype
        # a weight decode is computed where the packed panel is written (once per panel),
        # never per row tile: it waits until the panel exists
        decodes = self._inline_prologue(sch, found, cpu)
        # A run-time row count (a prompt's tokens): the rows are padded to whole register
        # tiles, so that every tile has mr rows and no row needs a predicate
        rows = self.rows or (4 if cpu.vector_bits >= 512 else 6)
        padding = self._pad_rows(sch, mm, rows)
        # The accumulator tile; the epilogue then reads it instead of memory.
        acc_store = sch.cache_write(mm, 0, "local")
        # The epilogue inlined into the tile store while it is a chain.
        separate = self._inline_epilogue(sch, found)

        *batch, i, j, k = sch.get_loops(mm)
        m, n = loop_extent(sch, i), loop_extent(sch, j)
        if n is None:
            raise ScheduleError("matmul: the recipe needs a static number of columns")
        mr, nr = self.tile(m if m is not None else (rows if padding is not None else 1), n,
                           cpu, dtype)
        io, ii = sch.split(i, [None, mr]) if mr > 1 else (i, None)
        jo, ji = sch.split(j, [None, nr])
        sch.reorder(*batch, jo, io, k, *([ii] if ii is not None else []), ji)

        # The packed panel sits between jo and io, so jo (with the batch) is then
        # the parallel loop: pack only when it has work for every core.
        panels = (n // nr) * (trip_count(sch, batch) or 1)
        pack = self.pack and nr > 1 and (panels >= cpu.cores or bool(decodes))
        if pack:
            self._pack_panel(sch, found, nr, jo)
        for producer in decodes:  # into the panel's copy, else into the micro-kernel
            sch.compute_inline(producer.rv)
        sch.reverse_compute_at(acc_store, io)
        vectorize_innermost(sch, acc_store, cpu.lanes(dtype))
        for consumer in separate:
            if padding:  # they read the valid rows' copy, made after every tile
                schedule_flat(sch, consumer, cpu)
                continue
            sch.reverse_compute_at(consumer.rv, io)
            vectorize_innermost(sch, consumer.rv, cpu.lanes(consumer.output.dtype))
        for block in padding or ():  # the operand's padded copy, the result's valid rows
            schedule_flat(sch, block, cpu)
        outer = sch.fuse(*batch, jo) if batch else jo
        if not pack:
            outer = sch.fuse(outer, io)
        if cpu.cores > 1:
            sch.parallel(outer)
        if ii is not None:
            sch.unroll(ii)
        if nr > 1:
            sch.vectorize(ji)
        decompose_init(sch, mm)
        return sch

    @staticmethod
    def _pad_rows(sch: Schedule, mm: s_tir.schedule.SBlockRV, rows: int) -> list[Block] | None:
        """Pad a run-time row count to a multiple of ``rows``; the blocks that adds.

        ``pad_einsum`` copies the left operand into a buffer of whole tiles (zero rows
        after the last), computes the product on it, and copies the valid rows of the
        result out; an epilogue chain is later inlined into that copy. A static row
        count needs none (:meth:`tile` picks a row count that divides it): ``[]``.
        None when the block cannot be padded (one-row tiles then need no predicate).
        """
        *batch, i, _, _ = sch.get_loops(mm)
        if loop_extent(sch, i) is not None:
            return []
        before = {sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))}
        try:
            sch.pad_einsum(mm, [1] * len(batch) + [rows, 1, 1])
        except ScheduleError:
            logger.debug("matmul: run-time rows not padded; one-row tiles")
            return None
        return [b for b in describe_blocks(sch) if b.name not in before]

    @staticmethod
    def _pack_panel(sch: Schedule, found: MatmulMatch, nr: int,
                    panel_loop: s_tir.schedule.LoopRV) -> None:
        """Copy the right operand into ``[.., n / nr, k, nr]``, one panel per ``jo``."""
        rhs = found.rhs
        (j_at,) = index_positions(rhs.indices, found.j)
        (k_at,) = index_positions(rhs.indices, found.k)
        pack = sch.cache_read(found.block.rv, rhs.source.name, "global")
        sch.transform_layout(pack, ("write", 0), _panels(rhs, found.j, found.k, nr))
        sch.compute_at(pack, panel_loop)
        inner = sch.get_loops(pack)[-1]
        if loop_extent(sch, inner) == nr:
            sch.vectorize(inner)
        elif j_at < k_at and loop_extent(sch, sch.get_loops(pack)[-2]) == nr:
            # an (out, in) weight: the panel's columns are rows of it; copy them across
            # (one vector store of nr values per k) rather than one value at a time
            rows, depth = sch.get_loops(pack)[-2:]
            sch.reorder(depth, rows)
            sch.vectorize(rows)


def _dispatch(short: tirx.PrimFunc, long: tirx.PrimFunc,
              use_short: tirx.PrimExpr) -> tirx.PrimFunc | None:
    """One kernel that runs ``short``'s body when ``use_short`` holds, else ``long``'s.

    Both are schedules of one kernel, so they share its parameters; their root
    blocks' buffers are all allocated (only the chosen body touches its own).
    None when the parameters differ.
    """
    same = len(short.params) == len(long.params) and all(
        a.same_as(b) for a, b in zip(short.params, long.params))
    roots = [f.body for f in (short, long)]
    if not same or not all(isinstance(r, s_tir.SBlockRealize) for r in roots):
        return None
    a, b = (r.block for r in roots)
    # a buffer both schedules kept from the kernel (an epilogue's input) is allocated once
    buffers = list(a.alloc_buffers)
    buffers += [buf for buf in b.alloc_buffers if not any(buf.same_as(x) for x in buffers)]
    root = s_tir.SBlock([], [], [], "root", tirx.IfThenElse(use_short, a.body, b.body),
                        alloc_buffers=buffers)
    return long.with_body(s_tir.SBlockRealize([], True, root))


def _panels(load: TensorLoad, across: tirx.Var, depth: tirx.Var, width: int) -> tirx.IndexMap:
    """The layout ``[.., across / width, depth, across % width]`` of an operand's copy.

    Panels of ``width`` along ``across`` (rows of the left operand, columns of the
    right one), each contiguous over ``depth`` (the reduction); other axes first.
    """
    (a_at,) = index_positions(load.indices, across)
    (k_at,) = index_positions(load.indices, depth)
    rest = [d for d in range(len(load.indices)) if d not in (a_at, k_at)]

    def packed(*index):
        return [index[d] for d in rest] + [index[a_at] // width, index[k_at],
                                           index[a_at] % width]

    return tirx.IndexMap.from_func(packed, ndim=len(load.indices))
