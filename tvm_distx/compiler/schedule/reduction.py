"""The reduction recipe: reductions that are not matmuls (sum, max, softmax, norms).

:class:`ReductionRule` vectorizes a reduction over a contiguous innermost axis
through ``rfactor``, a reduction over a leading axis across its output columns,
and computes every block per row in one parallel loop when the blocks work row
by row.
"""

from __future__ import annotations

import logging

from tvm import s_tir, tirx
from tvm.s_tir import Schedule, ScheduleError

from tvm_distx.compiler.schedule.base import (REDUCE, Block, CPUTraits, Rule, block_binding, decompose_init, first_divisor,
                   first_line, index_positions, inline_decodes, loop_extent, loops_over, schedule_flat,
                   trip_count, uses_var, vectorize_innermost)

__all__ = ["ReductionRule"]

logger = logging.getLogger(__name__)


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
        found = inline_decodes(sch, found)  # a lookup decodes only the rows it reads
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
                schedule_flat(sch, block, cpu)
                continue
            partial = self._rfactor(sch, block, cpu)
            if partial is None and self._vectorize_columns(sch, block, cpu):
                reductions.append(block.rv)
                continue
            for rv in ([partial] if partial is not None else []) + [block.rv]:
                loops = sch.get_loops(rv)[:block.leading_spatial]
                if cpu.cores > 1 and (trip_count(sch, loops) or 0) > 1:
                    sch.parallel(sch.fuse(*loops) if len(loops) > 1 else loops[0])
                reductions.append(rv)
            if partial is not None:
                self._vectorize_lanes(sch, partial)
        for rv in reductions:
            decompose_init(sch, rv)
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
            before = trip_count(sch, sch.get_loops(rv))
            try:
                sch.compute_at(rv, row_loops[-1])
            except ScheduleError:
                return None
            after = trip_count(sch, sch.get_loops(rv))
            if before is None or after is None or after > before:
                logger.debug("reduction: %s would be recomputed for every row",
                             sch.get(rv).name_hint)
                return None
        for block in blocks:
            if block.is_spatial and len(sch.get_loops(block.rv)) > rows:
                inner = sch.get_loops(block.rv)[rows:]
                if len(inner) > 1:
                    sch.fuse(*inner)
                vectorize_innermost(sch, block.rv, cpu.lanes(block.output.dtype))
        for partial in partials:
            self._vectorize_lanes(sch, partial)
        if cpu.cores > 1 and (trip_count(sch, row_loops) or 0) > 1:
            sch.parallel(sch.fuse(*row_loops) if rows > 1 else row_loops[0])
        for rv in partials + [b.rv for b in blocks if not b.is_spatial]:
            decompose_init(sch, rv)
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
                    if not load.source.same_as(block.output) and index_positions(load.indices, k)]
        if not operands or any(index_positions(load.indices, k) != [len(load.indices) - 1]
                               for load in operands):
            return None
        lanes = cpu.lanes(block.output.dtype)
        extent = loop_extent(sch, sch.get_loops(block.rv)[-1])
        if extent is None or extent % lanes or extent < 2 * lanes:
            return None
        _, lane = sch.split(sch.get_loops(block.rv)[-1], [None, lanes])
        try:
            return sch.rfactor(lane, factor_axis=len(block.spatial))
        except ScheduleError as err:  # e.g. a reducer rfactor does not know
            logger.debug("reduction: %s stays scalar (%s)", block.name, first_line(err))
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
        extent = loop_extent(sch, spatial[-1])
        width = first_divisor(extent or 0, [4 * lanes, 2 * lanes, lanes])
        if extent is None or width < 4:
            return False
        outer, lane = sch.split(spatial[-1], [None, width])
        sch.reorder(outer, *reduction, lane)
        sch.vectorize(lane)
        parallel = spatial[:-1] + [outer]
        if cpu.cores > 1 and (trip_count(sch, parallel) or 0) > 1:
            sch.parallel(sch.fuse(*parallel) if len(parallel) > 1 else outer)
        return True

    @staticmethod
    def _vectorize_lanes(sch: Schedule, partial: s_tir.schedule.SBlockRV) -> None:
        """Vectorize the lane loop of a partial reduction, inside its reduction loop."""
        stmt = sch.get(partial)
        lane_var = stmt.body.indices[-1]
        values = block_binding(sch, partial)
        (lane_value,) = [value for iv, value in zip(stmt.iter_vars, values)
                         if iv.var.same_as(lane_var)]
        lane = [loop for loop in sch.get_loops(partial)
                if uses_var(lane_value, sch.get(loop).loop_var)]
        reduction = loops_over(sch, partial, REDUCE)
        if len(lane) != 1 or len(reduction) != 1:
            return
        sch.reorder(reduction[0], lane[0])
        sch.vectorize(lane[0])
