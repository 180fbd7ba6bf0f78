"""The matrix-vector recipe: one token (or a few) times a weight stored ``(out, in)``.

Decoding one token multiplies a few rows of activations by every weight once:
``C[i, j] = sum_k A[i, k] * W[j, k]`` with ``i`` tiny. The work is bound by
reading ``W``, so the recipe reads each weight row once, contiguously, with no
packing (packing would write ``W`` again on every call, tripling the traffic):

* ``k`` is split by the vector width and the sum is *rfactored* over the lanes:
  each output element accumulates one vector register along its weight row;
* the output columns ``j`` are the parallel loop, in groups of ``rows`` so
  that one load of ``A``'s vector feeds several independent accumulators;
* the lanes are summed (the rfactor's second block) and the epilogue applied
  per group of columns, while they are still in cache.

:class:`MatvecRule` matches what :class:`~tvm_distx.schedule.matmul.MatmulRule`
matches, restricted to a static handful of rows and a right operand whose
reduction axis is innermost (``torch.nn.Linear``'s layout, which
:class:`tvm_distx.legalize.linear.LegalizeLinear` keeps); otherwise the matmul
recipe applies.
"""

from __future__ import annotations

import logging

from tvm import tirx
from tvm.s_tir import Schedule

from .base import Block, CPUTraits, decompose_init, first_divisor, index_positions, loop_extent
from .matmul import MatmulMatch, MatmulRule

__all__ = ["MatvecRule"]

logger = logging.getLogger(__name__)


class MatvecRule(MatmulRule):
    """Matrix-vector products (a few rows) with ``(out, in)`` weights.

    Parameters
    ----------
    max_rows : int, default 4
        The most rows of ``A`` (batch axes included) the recipe takes; more rows
        are a matrix product.
    rows : int, default 4
        Output columns computed together, each in its own vector accumulator.
    """

    name = "matvec"

    def __init__(self, max_rows: int = 4, rows: int = 4) -> None:
        super().__init__()
        self.max_rows = max_rows
        self.group = rows

    def __repr__(self) -> str:
        return f"MatvecRule(max_rows={self.max_rows}, rows={self.group})"

    def match(self, blocks: list[Block]) -> MatmulMatch | None:
        found = super().match(blocks)
        if found is None:
            return None
        rhs = found.rhs
        if index_positions(rhs.indices, found.k) != [len(rhs.indices) - 1]:
            return None  # the weight's reduction axis is not contiguous
        extents = {iv.var: iv.dom.extent for iv in found.block.stmt.iter_vars}
        static = {var: int(e) for var, e in extents.items() if isinstance(e, tirx.IntImm)}
        if len(static) != len(extents):
            return None  # a symbolic row count (a prompt) is a matrix product
        rows = 1
        for var in found.block.spatial[:-1]:
            rows *= static[var]
        if rows > self.max_rows or static[found.k] % _MIN_LANES:
            return None
        return found

    def apply(self, sch: Schedule, found: MatmulMatch, cpu: CPUTraits) -> Schedule:
        mm = found.block.rv
        for producer in found.prologue:
            sch.compute_inline(producer.rv)  # raises: the recipe is abandoned
        for producer in found.side:
            sch.compute_inline(producer.rv)
        *_, j, k = sch.get_loops(mm)
        n, depth = loop_extent(sch, j), loop_extent(sch, k)
        full = cpu.lanes(found.block.output.dtype)
        lanes = first_divisor(depth, [full, full // 2, full // 4, _MIN_LANES])

        ko, kv = sch.split(k, [None, lanes])
        partial = sch.rfactor(kv, factor_axis=len(found.block.spatial))
        group = first_divisor(n, [self.group, 2, 1])
        *p_batch, p_j, p_ko, p_kv = sch.get_loops(partial)
        jo, ji = sch.split(p_j, [None, group])
        sch.reorder(jo, *p_batch, p_ko, ji, p_kv)
        sch.vectorize(p_kv)
        if group > 1:
            sch.unroll(ji)
        # the lanes are summed, and the epilogue applied, per group of columns
        sch.reverse_compute_at(mm, jo)
        for consumer in found.epilogue:
            sch.reverse_compute_at(consumer.rv, jo)
        if cpu.cores > 1 and n // group > 1:
            sch.parallel(jo)
        decompose_init(sch, partial)
        return sch


#: The narrowest vector the recipe uses (four float32 lanes: SSE, NEON, RVV at VLEN 128).
_MIN_LANES = 4
