"""``comm_report``: every redistribute and collective of a module, with its bytes.

The rows come from the same planner that legalization uses
(:func:`tvm_distx.legalize.planner.plan_redistribute`), so the report is what
will run, not an estimate made separately. A partial sum (the all-reduce TVM's
local view adds after a kernel whose summed dimension is split) is planned from
its ``"P"`` layout by the same function legalization asks
(:func:`tvm_distx.legalize.partial_sums.plan_completion`): an ``all_reduce``
row, or a ``reduce_scatter`` row where its only use splits it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from tvm_distx.errors import ArgumentError
from tvm_distx.ir import helpers as _ir
from tvm_distx.layout import MeshTable, TensorSharding
from tvm_distx.legalize.legalize_redistribute import ALLOW_SEND_RECV
from tvm_distx.legalize.partial_sums import (ALLREDUCE_OP, fold_targets, partial_sum,
                                             plan_completion, true_sharding)
from tvm_distx.legalize.planner import plan_redistribute

if TYPE_CHECKING:  # TVM is loaded by the functions that use it (the CLI starts fast)
    import tvm

__all__ = ["CommRow", "CommReport", "comm_report"]


@dataclass(frozen=True)
class CommRow:
    """One collective step."""

    function: str
    value: str
    mesh_axis: int | None
    collective: str
    src: str
    dst: str
    bytes_per_rank: int
    #: Names of the symbolic extents the bytes are per unit of (``bytes_per_rank``
    #: times their product is the true count); empty for a static shape.
    per: tuple[str, ...] = ()

    @property
    def bytes_text(self) -> str:
        """``bytes_per_rank`` with thousands separators, ``x s`` per symbolic extent."""
        return f"{self.bytes_per_rank:,}" + "".join(f" x {name}" for name in self.per)


@dataclass(frozen=True)
class CommReport:
    """The rows of :func:`comm_report`; ``str()`` renders a table with the total."""

    rows: tuple[CommRow, ...]

    @property
    def total_bytes_per_rank(self) -> int:
        """The sum of the rows: each collective counted once where it appears in the IR.

        A function called several times runs its collectives on every call;
        the report lists the program text, not a trace. Rows of symbolic shapes
        count their bytes per unit of their symbolic extents (see ``total_text``).
        """
        return sum(r.bytes_per_rank for r in self.rows)

    @property
    def total_text(self) -> str:
        """The total, one term per set of symbolic extents (``"4,096 x s + 512"``)."""
        by_unit: dict[tuple[str, ...], int] = {}
        for r in self.rows:
            by_unit[r.per] = by_unit.get(r.per, 0) + r.bytes_per_rank
        if not by_unit:
            return "0"
        return " + ".join(f"{total:,}" + "".join(f" x {n}" for n in per)
                          for per, total in sorted(by_unit.items(), key=lambda kv: -len(kv[0])))

    def __str__(self) -> str:
        header = ("function", "value", "mesh axis", "collective", "from", "to", "bytes/rank")
        table = [header] + [
            (r.function, r.value, "-" if r.mesh_axis is None else str(r.mesh_axis),
             r.collective, r.src, r.dst, r.bytes_text)
            for r in self.rows
        ]
        widths = [max(len(row[i]) for row in table) for i in range(len(header))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                 for row in table]
        lines.append(f"total bytes received per rank: {self.total_text}")
        return "\n".join(lines) + "\n"


def comm_report(mod: tvm.IRModule) -> CommReport:
    """List the communication of a propagated (``R.DTensor``) module.

    Parameters
    ----------
    mod : tvm.IRModule
        After :class:`tvm_distx.passes.PropagateSharding`, or better after
        :class:`tvm_distx.legalize.LowerGlobalViewToLocalView`, which adds the
        all-reduces of sharded reductions and the moves around kernels on a
        dimension split by several mesh axes; those are reported too. The
        ``"local_view"`` stage of :func:`tvm_distx.compiler.pipeline.run_stages` is
        such a module (the CLI reports that one).

    Returns
    -------
    CommReport
        One row per step of every redistribute, and one per all-reduce (a
        partial sum completed by a reduce-scatter is one ``reduce_scatter`` row).

    Raises
    ------
    ArgumentError
        If ``mod`` still has ``R.dist.annotate_sharding`` calls: it has not been
        propagated, and its communication is not decided yet.
    """

    names = MeshTable(mod)
    rows: list[CommRow] = []
    for gv, func in _ir.relax_functions(mod):
        _check_propagated(gv.name_hint, func)
        bound: dict = {}
        folds = fold_targets(func)  # all-reduces that a redistribute completes instead
        completes = {redistribute: allreduce for allreduce, redistribute in folds.items()}
        for block in func.body.blocks:
            for binding in block.bindings:
                value, var = binding.value, binding.var
                bound[var] = value
                if var in folds:
                    continue  # reported with the redistribute that completes it
                if var in completes or _ir.is_call_to(value, ALLREDUCE_OP):
                    partial = partial_sum(bound[completes[var]] if var in completes else value,
                                          bound)
                    if partial is None:
                        continue
                    dst = TensorSharding.from_type(var.ty) if var in completes else None
                    shape, per, unit = _planned_shape(var.ty)
                    plan = plan_completion(partial, dst, shape,
                                           var.ty.tensor_ty.dtype,
                                           allow_send_recv=ALLOW_SEND_RECV)
                elif _ir.is_call_to(value, "relax.dist.redistribute"):
                    shape, per, unit = _planned_shape(var.ty)
                    plan = plan_redistribute(true_sharding(value.args[0], bound),
                                             TensorSharding.from_type(var.ty),
                                             shape, var.ty.tensor_ty.dtype,
                                             allow_send_recv=ALLOW_SEND_RECV)
                else:
                    continue
                for step in plan.steps:
                    between = step.src.mesh != step.dst.mesh
                    rows.append(CommRow(gv.name_hint, var.name, step.mesh_axis,
                                        step.collective.name.lower(),
                                        _where(step.src, names, between),
                                        _where(step.dst, names, between),
                                        step.bytes_received // unit, per))
    return CommReport(tuple(rows))


def _planned_shape(ty) -> tuple[tuple[int, ...], tuple[str, ...], int]:
    """``(shape to plan, symbolic extent names, unit)`` for a DTensor type.

    A symbolic extent is planned at the mesh's device count, which every split
    of it divides; the plan's steps do not depend on the extent, and its bytes
    are linear in it, so dividing them by ``unit`` (that count to the power of
    the number of symbolic extents) gives the bytes per unit of the extents.
    """

    shape = _ir.static_shape(ty)
    if shape is None or all(d is not None for d in shape):
        return shape, (), 1
    stand_in = int(np.prod([int(d) for d in ty.device_mesh.shape]))
    dims = ty.tensor_ty.shape.values
    per = tuple(str(dims[i]) for i, d in enumerate(shape) if d is None)
    planned = tuple(stand_in if d is None else d for d in shape)
    return planned, per, stand_in ** len(per)


def _check_propagated(function: str, func) -> None:
    """Refuse a function that still has annotations (its communication is not decided)."""

    for block in func.body.blocks:
        for binding in block.bindings:
            if _ir.is_call_to(binding.value, "relax.dist.annotate_sharding"):
                raise ArgumentError(
                    f"comm_report needs a propagated module, but '{binding.var.name}' in "
                    f"function '{function}' is still an R.dist.annotate_sharding",
                    hint="pass tvm_distx.compiler.pipeline.run_stages(mod)['local_view'], or run "
                    "tvm_distx.passes.PropagateSharding() on the module first")


def _where(step_sharding: TensorSharding, names: MeshTable, between: bool) -> str:
    """A step's placement; with its mesh's name when the move goes between meshes."""
    text = str(step_sharding.placement)
    if not between:
        return text
    mesh = step_sharding.mesh
    return f"{text} on {names.ref(mesh) or mesh.describe()}"
