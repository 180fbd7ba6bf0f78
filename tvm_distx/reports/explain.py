"""``explain``: for every value, its mesh, placement, local shape and why.

Every sharding system is asked "why is this tensor sharded like that?". This
module answers from the solver's own records: each decision carries the
annotation or rule that made it. A partial sum shows as ``"P"`` on the mesh
axes its summed dimension is split on (``"P"``, ``"S[0]P"``), with the reason
saying how it is completed.

Under each function's table, the bytes of its weights that one rank holds
(:class:`ParamBytes`): the parameters after the inputs of a program imported
from PyTorch (``num_input``), or every parameter of a hand-written one, each in
its stored dtype (16-bit or quantized weights count their stored bytes, see
:func:`tvm_distx.quantize`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from tvm_distx.errors import ArgumentKeyError
from tvm_distx.ir import helpers as _ir
from tvm_distx.layout import TensorSharding
from tvm_distx.passes.propagate_sharding import propagate

if TYPE_CHECKING:  # TVM is loaded by the functions that use it (the CLI starts fast)
    import tvm

__all__ = ["ShardingRow", "ShardingReport", "explain"]


@dataclass(frozen=True)
class ShardingRow:
    """One value of one function."""

    function: str
    value: str
    global_shape: tuple
    mesh: str
    placement: str
    local_shape: tuple
    reason: str
    #: the value's layout as its producer leaves it (``mesh`` and ``placement`` as objects)
    sharding: TensorSharding


@dataclass(frozen=True)
class ParamBytes:
    """The bytes of one function's weights: on each rank that holds them, and in all."""

    function: str
    #: ``"weights"`` (the parameters after the inputs) or ``"parameters"`` (all of them)
    label: str
    per_rank: int
    total: int

    def __str__(self) -> str:
        share = f" ({self.per_rank / self.total:.1%})" if self.total else ""
        return (f"{self.label} per rank: {_bytes(self.per_rank)} of {_bytes(self.total)}"
                f"{share}")


def _bytes(count: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.2f} {unit}"
    return f"{count} B"


@dataclass(frozen=True)
class ShardingReport:
    """The rows of :func:`explain`; ``str()`` renders them as a table."""

    rows: tuple[ShardingRow, ...]
    #: per function, the bytes of its weights per rank (see the module doc)
    weights: tuple[ParamBytes, ...] = ()

    def for_function(self, name: str) -> tuple[ShardingRow, ...]:
        """The rows of one function."""
        return tuple(r for r in self.rows if r.function == name)

    def row(self, function: str, value: str) -> ShardingRow:
        """The row of one value.

        Raises
        ------
        ArgumentKeyError
            When ``function`` has no value ``value`` (also a ``KeyError``).
        """
        for r in self.rows:
            if (r.function, r.value) == (function, value):
                return r
        raise ArgumentKeyError(f"no value '{value}' in function '{function}'",
                               hint="see str(report) for the values of each function")

    def __str__(self) -> str:
        header = ("value", "global shape", "mesh", "placement", "local shape", "why")
        lines: list[str] = []
        functions = list(dict.fromkeys(r.function for r in self.rows))
        for name in functions:
            table = [header] + [
                (r.value, _shape(r.global_shape), r.mesh, r.placement, _shape(r.local_shape),
                 r.reason)
                for r in self.for_function(name)
            ]
            widths = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]
            lines.append(f"function {name}")
            for row in table:
                cells = [cell.ljust(width) for cell, width in zip(row, widths)] + [row[-1]]
                lines.append("  " + "  ".join(cells).rstrip())
            lines += [f"  {w}" for w in self.weights if w.function == name]
            lines.append("")
        return "\n".join(lines).rstrip() + "\n"


def _shape(shape) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + ")"


def explain(mod: tvm.IRModule) -> ShardingReport:
    """Explain how :class:`tvm_distx.passes.PropagateSharding` shards ``mod``.

    Parameters
    ----------
    mod : tvm.IRModule
        The annotated module (before propagation).

    Returns
    -------
    ShardingReport
        One row per tensor value (parameters first, then bindings) of every
        function that propagation writes, named as in the propagated module.
    """

    result = propagate(mod, warn_unlegalized=False)  # read, never lowered
    rows, weights = [], []
    for name, analysis in result.analyses.items():
        weights.append(_param_bytes(name, analysis))
        values = list(analysis.func.params) + [b.var for b in analysis.bindings]
        for var in values:
            for slot in range(analysis.tensor_slots(var)):
                decision = analysis.get(var, slot)
                if decision is None:
                    continue
                ty = var.ty.fields[slot] if analysis.tensor_slots(var) > 1 else var.ty
                shape = _ir.static_shape(ty) or ()
                label = var.name if analysis.tensor_slots(var) == 1 else f"{var.name}[{slot}]"
                sharding = decision.sharding
                rows.append(
                    ShardingRow(
                        function=name,
                        value=label,
                        global_shape=shape,
                        mesh=sharding.mesh.name or str(sharding.mesh.shape),
                        placement=str(decision.produced.placement),
                        local_shape=sharding.local_shape(shape),
                        reason=decision.reason,
                        sharding=decision.produced,
                    )
                )
    return ShardingReport(tuple(rows), tuple(w for w in weights if w is not None))


def _param_bytes(name: str, analysis) -> ParamBytes | None:
    """The bytes of a function's weights on one rank (the most any rank holds) and in all."""
    func = analysis.func
    attrs = func.attrs or {}
    count = int(attrs["num_input"]) if "num_input" in attrs else 0
    per_rank = total = 0
    for param in func.params[count:]:
        decision = analysis.get(param, 0) if analysis.tensor_slots(param) == 1 else None
        shape = _ir.static_shape(param.ty)
        if decision is None or not shape or None in shape:
            continue
        size = _itemsize(str(param.ty.dtype))
        total += int(np.prod(shape, dtype=np.int64)) * size
        per_rank += int(np.prod(decision.sharding.local_shape(shape), dtype=np.int64)) * size
    if not total:
        return None
    return ParamBytes(name, "weights" if count else "parameters", per_rank, total)


def _itemsize(dtype: str) -> int:
    """Bytes per element of a TVM dtype (``"bfloat16"`` included)."""
    bits = "".join(c for c in dtype if c.isdigit())
    return max(1, int(bits or 8) // 8)
