"""The matrix-vector recipe: one token (or a few) times a weight stored ``(out, in)``.

Decoding one token multiplies a few rows of activations by every weight once:
``C[i, j] = sum_k A[i, k] * W[j, k]`` with ``i`` tiny. The work is bound by
reading ``W``, so the recipe reads ``W`` once, **as one sequential stream**,
with no packing (packing would write ``W`` again on every call, tripling the
traffic):

* the output columns ``j`` are the outer loop (parallel), and each weight row
  is read whole, front to back, before the next one. The hardware prefetchers
  then see one stream through the whole weight. Reading a group of rows side
  by side (one accumulator per row) makes as many streams, each restarting at
  every row; rows of 4 KiB (``in = 1024``) then run at about half the speed;
* ``k`` is split into ``unroll`` vectors of the register width and the sum is
  *rfactored* over them: each row accumulates in ``unroll`` independent
  vector registers (the unrolled loop hides the latency of the fused
  multiply-add), and the rows of ``A`` (batch axes) share each load of ``W``;
* the accumulators are summed (the rfactor's second block) and the epilogue
  applied per group of columns, while they are still in cache.

:class:`MatvecRule` matches what :class:`~tvm_distx.compiler.schedule.matmul.MatmulRule`
matches, restricted to a static handful of rows and a right operand whose
reduction axis is innermost (``torch.nn.Linear``'s layout, which
:class:`tvm_distx.legalize.linear.LegalizeLinear` keeps); otherwise the matmul
recipe applies.
"""

from __future__ import annotations

import logging

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir import Schedule

from tvm.s_tir.schedule import LoopRV

from tvm_distx.compiler.schedule.base import (REDUCE, Block, CPUTraits, block_binding, decompose_init, first_divisor,
                   index_positions, loop_extent, loops_over, uses_var,
                   vectorize_innermost)
from tvm_distx.compiler.schedule.matmul import MatmulMatch, MatmulRule
from tvm_distx.sources.formats import GROUP

__all__ = ["MatvecRule"]

logger = logging.getLogger(__name__)


class MatvecRule(MatmulRule):
    """Matrix-vector products (a few rows) with ``(out, in)`` weights.

    Parameters
    ----------
    max_rows : int, default 4
        The most rows of ``A`` (batch axes included) the recipe takes; more rows
        are a matrix product.
    rows : int, default 1
        Output columns per parallel task (their accumulators are summed, and
        the epilogue applied, together).
    unroll : int, default 4
        Vector accumulators per row of ``A`` and output column (short rows).
    long_row : int, default 16384
        Weight rows of at least this many bytes are long: ``interleave`` of
        them are read side by side, one vector accumulator each (several
        long streams keep more loads in flight than one).
    interleave : int, default 4
        Long rows read side by side.
    """

    name = "matvec"

    def __init__(self, max_rows: int = 4, rows: int = 1, unroll: int = 4,
                 long_row: int = 16384, interleave: int = 4) -> None:
        super().__init__()
        self.max_rows = max_rows
        self.group = rows
        self.unroll = unroll
        self.long_row = long_row
        self.interleave = interleave

    def __repr__(self) -> str:
        return (f"MatvecRule(max_rows={self.max_rows}, rows={self.group}, unroll={self.unroll}, "
                f"long_row={self.long_row}, interleave={self.interleave})")

    #: Attention products have two batch axes (sequence, head) besides rows and columns.
    max_spatial = 4

    def match(self, blocks: list[Block]) -> MatmulMatch | None:
        found = super().match(blocks)
        if found is None:
            return None
        extents = {iv.var: iv.dom.extent for iv in found.block.stmt.iter_vars}
        static = {var: int(e) for var, e in extents.items() if isinstance(e, tirx.IntImm)}
        if len(static) != len(extents):
            return None  # a symbolic row count (a prompt) is a matrix product
        last = len(found.rhs.indices) - 1
        if _columns_contiguous(found):
            # (in, out): every row of A is its own product; only A's own axes are rows
            rows = 1
            for var in found.block.spatial[:-1]:
                if not index_positions(found.rhs.indices, var):
                    rows *= static[var]
            if rows > self.max_rows or static[found.j] % _MIN_LANES:
                return None
            return found
        if index_positions(found.rhs.indices, found.k) != [last]:
            return None  # the weight's reduction axis is not contiguous
        if len(found.block.spatial) > MatmulRule.max_spatial:
            return None
        rows = 1
        for var in found.block.spatial[:-1]:
            rows *= static[var]
        if rows > self.max_rows or static[found.k] % _MIN_LANES:
            return None
        return found

    def apply(self, sch: Schedule, found: MatmulMatch, cpu: CPUTraits) -> Schedule:
        mm = found.block.rv
        # a weight decode is computed in registers as the weight is read, except its
        # per-group values (the scales, converted to float32): those once per row
        per_row = _per_group_decodes(found) + _scalar_decodes(found, cpu)
        for producer in found.prologue:
            if producer not in per_row:
                sch.compute_inline(producer.rv)  # raises: the recipe is abandoned
        for producer in found.side:
            sch.compute_inline(producer.rv)
        if _columns_contiguous(found):
            return self._apply_columns(sch, found, cpu)
        *_, j, k = sch.get_loops(mm)
        n, depth = loop_extent(sch, j), loop_extent(sch, k)
        full = cpu.lanes(found.block.output.dtype)
        lanes = first_divisor(depth, [full, full // 2, full // 4, _MIN_LANES])
        # long rows: a few side by side, one accumulator each; short rows: one after the other
        # (a decoded weight's row is as long as its stored bytes)
        stored = _stored_weight(found)
        row_bytes = (depth * found.block.output.dtype.bits // 8 if stored is None else
                     int(stored.shape[1]) * tvm.runtime.DataType(str(stored.dtype)).bits // 8)
        side_by_side = row_bytes >= self.long_row
        group = first_divisor(n, [self.interleave, 2, 1] if side_by_side else [self.group, 2, 1])
        # a decoded weight's vectors cover whole groups: each unrolled vector then knows
        # its group's half (q4's low or high nibbles) when the kernel is built
        wanted = [self.unroll, 2, 1]
        if any(p.decode for p in found.prologue) and GROUP % lanes == 0:
            wanted = [max(self.unroll, GROUP // lanes)] + wanted
        unroll = 1 if side_by_side else first_divisor(depth // lanes, wanted)

        ko, kv = sch.split(k, [None, unroll * lanes])
        partial = sch.rfactor(kv, factor_axis=len(found.block.spatial))
        *p_batch, p_j, p_ko, p_kv = sch.get_loops(partial)
        jo, ji = sch.split(p_j, [None, group])
        ku, kl = sch.split(p_kv, [unroll, lanes])
        # the rows of A share each vector of W
        if side_by_side:
            sch.reorder(jo, p_ko, *p_batch, ji, ku, kl)
        else:
            sch.reorder(jo, ji, p_ko, *p_batch, ku, kl)
        sch.vectorize(kl)
        for loop in (*p_batch, ku) + ((ji,) if side_by_side else ()):
            sch.unroll(loop)
        # the accumulators are summed, and the epilogue applied, per group of columns:
        # first as vectors, then one vector's lanes
        summed = None
        # the accumulators are summed into half a register (LLVM reads a register's
        # upper half with one instruction, not a half it has to gather lane by lane)
        width = lanes // 2 if lanes >= 8 else lanes
        if unroll * lanes > width:
            *_, lane = sch.get_loops(mm)
            _, s_lane = sch.split(lane, [unroll * lanes // width, width])
            summed = sch.rfactor(s_lane, factor_axis=len(found.block.spatial))
            sch.reverse_compute_at(summed, jo)
        halves = self._halve(sch, mm, width, len(found.block.spatial), jo)
        sch.reverse_compute_at(mm, jo)
        for consumer in found.epilogue:
            sch.reverse_compute_at(consumer.rv, jo)
        for producer in reversed(per_row):  # consumers first
            sch.compute_at(producer.rv, jo)
            sch.set_scope(producer.rv, 0, "global")
            if cpu.half_vectors or not _reads_half(producer):
                vectorize_innermost(sch, producer.rv, cpu.lanes(producer.output.dtype))
        sch.set_scope(partial, 0, "global")
        if summed is not None:
            s_lane, (s_unroll,) = _lane_loop(sch, summed), loops_over(sch, summed, REDUCE)
            sch.reorder(s_unroll, s_lane)
            sch.vectorize(s_lane)
            sch.set_scope(summed, 0, "global")
        for half in halves:
            (h_pair,) = loops_over(sch, half, REDUCE)
            h_lane = _lane_loop(sch, half)
            if h_lane is not None:
                sch.reorder(h_pair, h_lane)
                sch.vectorize(h_lane)
            sch.unroll(h_pair)
            sch.set_scope(half, 0, "global")
        if cpu.cores > 1 and n // group > 1:
            sch.parallel(jo)
        decompose_init(sch, partial)
        if stored is None:
            return sch
        rows = [sch.get(jo).loop_var * group + sch.get(ji).loop_var] if not side_by_side else \
            [sch.get(jo).loop_var * group + g for g in range(group)]
        return _prefetched(sch, stored, rows, sch.get(p_ko), unroll * lanes, depth)

    @staticmethod
    def _halve(sch: Schedule, block, lanes: int, axis: int, at: LoopRV) -> list:
        """Sum a vector of ``lanes`` accumulators as a tree: each level adds two halves.

        ``block`` sums its last loop's ``lanes`` values; each level before it adds
        the upper half of a vector to its lower half (one vector instruction), so
        the lanes are summed in log2(lanes) steps instead of one after the other.
        Returns the levels' blocks, computed at ``at``.
        """
        levels = []
        width = lanes
        while width > 1 and width % 2 == 0:
            *_, lane = sch.get_loops(block)
            _, half = sch.split(lane, [2, width // 2])
            level = sch.rfactor(half, factor_axis=axis)
            sch.reverse_compute_at(level, at)
            levels.append(level)
            width //= 2
        return levels

    def _apply_columns(self, sch: Schedule, found: MatmulMatch, cpu: CPUTraits) -> Schedule:
        """A right operand stored ``(in, out)`` (attention's ``q @ k^T`` and ``p @ v``).

        Each row of it is read front to back and added, scaled by one element
        of ``A``, into a tile of up to four vector accumulators: one stream
        through the operand, no reduction across lanes. The other axes
        (batch, heads, rows) and the tiles are the parallel loop.
        """
        mm = found.block.rv
        *others, j, k = sch.get_loops(mm)
        n = loop_extent(sch, j)
        full = cpu.lanes(found.block.output.dtype)
        lanes = first_divisor(n, [full, full // 2, full // 4, _MIN_LANES])
        tile = first_divisor(n // lanes, [4, 2, 1])
        jo, jt, jv = sch.split(j, [None, tile, lanes])
        sch.reorder(*others, jo, k, jt, jv)
        outer = sch.fuse(*others, jo) if others else jo
        local = sch.cache_write(mm, 0, "local")
        sch.reverse_compute_at(local, outer)
        for consumer in found.epilogue:
            sch.reverse_compute_at(consumer.rv, outer)
        sch.vectorize(jv)
        sch.unroll(jt)
        for block in (local, *(c.rv for c in found.epilogue)):
            vectorize_innermost(sch, block, full)
        if cpu.cores > 1 and (loop_extent(sch, outer) or 1) > 1:
            sch.parallel(outer)
        decompose_init(sch, mm)
        return sch


def _per_group_decodes(found: MatmulMatch) -> list[Block]:
    """The decode blocks that compute a value per group of the weight from a parameter.

    A decode block that reads only the kernel's parameters (or such blocks) and
    writes at most one value per :data:`_PER_GROUP` weights (a row's scales,
    converted to float32, and ``q4``'s offsets) is computed once per row into a
    small buffer, which the weight's decode then reads with a broadcast load;
    every other decode block is inlined.
    """
    if _columns_contiguous(found):
        return []
    weight = _elements(found.rhs.source.shape)
    made = {b.output for b in found.prologue}
    out, small = [], set()
    for block in found.prologue:
        size = _elements(block.output.shape)
        if not block.decode or not weight or not size or size * _PER_GROUP > weight:
            continue
        if size < 2 * int(block.output.shape[0]):
            continue  # one group per row: nothing to share (and no loop to compute it in)
        if any(load.source in made and load.source not in small for load in block.loads):
            continue
        out.append(block)
        small.add(block.output)
    return out


def _stored_weight(found: MatmulMatch) -> tirx.Buffer | None:
    """The stored data of a decoded weight: the largest 2-D parameter its decode reads."""
    made = {b.output for b in found.prologue}
    read = {load.source for b in found.prologue if b.decode for load in b.loads
            if load.source not in made and len(load.source.shape) == 2}
    sized = [(_elements(buf.shape) or 0, buf) for buf in read]
    return max(sized, key=lambda item: item[0])[1] if sized else None


def _prefetched(sch: Schedule, data: tirx.Buffer, rows: list, chunk_loop, weights: int,
                depth: int) -> Schedule:
    """``sch``'s kernel with the stored weight prefetched :data:`_PREFETCH_BYTES` ahead.

    A decoded weight's rows are read one after the other, each with more
    instructions per byte than a float32 row, and the hardware prefetchers then
    do not run far enough ahead: a matvec from memory would take about its
    compute time plus its memory time. At the start of each chunk of
    ``weights`` values of a row, the kernel asks for the cache lines of the
    bytes :data:`_PREFETCH_BYTES` further on in the weight (the same row, or
    the next ones), one request per line of the chunk.
    """
    n, columns = (int(d) for d in data.shape)
    itemsize = max(1, tvm.runtime.DataType(str(data.dtype)).bits // 8)
    per_chunk = weights * columns // depth          # stored elements per chunk of a row
    lines = max(1, per_chunk * itemsize // _LINE)
    ahead = _PREFETCH_BYTES // itemsize
    last = n * columns - 1
    loop = chunk_loop.loop_var
    calls = []
    for row in rows:
        for line in range(lines):
            flat = (tirx.Cast("int64", row) * columns + tirx.Cast("int64", loop) * per_chunk
                    + line * _LINE // itemsize + ahead)
            flat = tirx.min(flat, tirx.const(last, "int64"))
            address = tirx.address_of(tirx.BufferLoad(data, [flat // columns, flat % columns]))
            calls.append(tirx.Evaluate(tirx.call_intrin("void", "tirx.prefetch", address,
                                                        0, 3, 1)))
    block = s_tir.SBlock([], [], [], "prefetch", calls[0] if len(calls) == 1 else
                         tirx.SeqStmt(calls))
    request = s_tir.SBlockRealize([], True, block)

    def add(node):
        if not node.loop_var.same_as(loop):
            return node
        return tirx.For(node.loop_var, node.min, node.extent, node.kind,
                        tirx.SeqStmt([request, node.body]), node.thread_binding,
                        node.annotations)

    return Schedule(tvm_ffi.structural_map(sch.mod["main"], [(tirx.For, add)]))


def _scalar_decodes(found: MatmulMatch, cpu: CPUTraits) -> list[Block]:
    """The decode blocks that convert 16-bit floats on a target that cannot in vectors.

    They decode each weight row into a small float32 buffer, with scalar
    instructions, before the vectorized product reads it (see
    :attr:`~tvm_distx.compiler.schedule.base.CPUTraits.half_vectors`). Only a decode
    of one block qualifies (``bf16`` and ``f16`` weights are one ``astype``).
    """
    decodes = [b for b in found.prologue if b.decode]
    if cpu.half_vectors or len(decodes) != 1 or not _reads_half(decodes[0]):
        return []
    return decodes


def _reads_half(block: Block) -> bool:
    """Whether a block reads 16-bit floats."""
    return any(str(load.source.dtype) in ("float16", "bfloat16") for load in block.loads)


def _elements(shape) -> int | None:
    total = 1
    for extent in shape:
        if not isinstance(extent, tirx.IntImm):
            return None
        total *= int(extent)
    return total


def _columns_contiguous(found: MatmulMatch) -> bool:
    """Whether the right operand is stored ``(.., in, out)``: its columns innermost."""
    last = len(found.rhs.indices) - 1
    return (index_positions(found.rhs.indices, found.j) == [last]
            and index_positions(found.rhs.indices, found.k) != [last])


def _lane_loop(sch: Schedule, block) -> LoopRV | None:
    """The loop over the last axis of the buffer ``block`` writes (its vector lanes).

    None when that axis has one element (no loop drives it).
    """
    stmt = sch.get(block)
    lane = stmt.writes[0].region[-1].min
    value = next(v for iv, v in zip(stmt.iter_vars, block_binding(sch, block))
                 if iv.var.same_as(lane))
    return next((loop for loop in sch.get_loops(block)
                 if uses_var(value, sch.get(loop).loop_var)), None)


#: A decode block writing at most one value per this many weights is computed per row.
_PER_GROUP = 16

#: How far ahead a decoded weight is prefetched, and the cache line size.
_PREFETCH_BYTES = 4096
_LINE = 64

#: The narrowest vector the recipe uses (four float32 lanes: SSE, NEON, RVV at VLEN 128).
_MIN_LANES = 4
