"""The injective recipe: kernels of spatial blocks only (elementwise, broadcast, layout)."""

from __future__ import annotations

from tvm.s_tir import Schedule, ScheduleError

from tvm_distx.compiler.schedule.base import Block, CPUTraits, Rule, schedule_flat

__all__ = ["InjectiveRule"]


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
            schedule_flat(sch, block, cpu)
        return sch
