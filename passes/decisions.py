"""One value's decision, and one operator call's plan: the solver's units.

This module owns what the solver (:mod:`tvm_distx.passes.sharding_solver`)
decides and how it decides one operator call:

* :class:`Decision`: a value's sharding, how firmly it is held
  (:class:`Strength`), why, and the mesh axes on which it is a partial sum;
* :func:`decide_operands`: from the decisions known for some operands and
  results of an operator with an einsum-like signature
  (:mod:`tvm_distx.passes.op_signatures`), the layout of all of them
  (:class:`OperandPlan`);
* the small judgements made per call: whether a plan completes a partial sum
  (:func:`completes_a_partial_sum`), how firmly a relayout's result is held
  (:func:`relayout_strength`), and whether two sources disagree on the mesh
  (:func:`check_single_home`).

It holds no state; the worklist over a function lives in the solver.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

from tvm_distx.errors import ShardingConflictError
from tvm_distx.layout import Partial, Placement, Replicate, Shard, TensorSharding, replicated
from tvm_distx.layout.mesh import DeviceMesh

from tvm_distx.passes.op_signatures import OpSignature

__all__ = [
    "Strength",
    "Decision",
    "OperandPlan",
    "decide_operands",
    "check_single_home",
    "completes_a_partial_sum",
    "only_replicated",
    "relayout_strength",
    "partial_note",
    "replicated_plan",
]


class Strength(enum.IntEnum):
    """How firmly a decision is held; stronger decisions win conflicts."""

    DEFAULT = 0  #: nothing reached the value; replicated by default
    PROPAGATED = 1  #: derived from other values
    SOURCE = 2  #: an annotation, a DTensor type, a caller's signature, or a relayout of one


@dataclass(frozen=True)
class Decision:
    """The sharding of one value, how firmly it is held, and why.

    Parameters
    ----------
    sharding : TensorSharding
        The value's layout once complete.
    strength : Strength
    reason : str
    partial : tuple of int
        The mesh axes along which the operator that produces the value leaves a
        partial sum (``"P"``, :attr:`produced`): each rank of such an axis
        computes a full-shape addend and the value is their sum. ``sharding``
        replicates these axes (TVM's DTensor types cannot say ``P``);
        lowering completes the sum (an all-reduce, or a reduce-scatter when the
        value is redistributed to a split on that axis). Empty for a complete
        value.
    """

    sharding: TensorSharding
    strength: Strength
    reason: str
    partial: tuple[int, ...] = ()

    @property
    def produced(self) -> TensorSharding:
        """The layout as the operator leaves it: :class:`~tvm_distx.layout.Partial` on the
        partial axes (``"P"``, ``"S[0]P"``); :attr:`sharding` when the value is complete."""
        if not self.partial:
            return self.sharding
        entries = tuple(Partial() if axis in self.partial else entry
                        for axis, entry in enumerate(self.sharding.placement.entries))
        return TensorSharding(self.sharding.mesh, Placement(entries))


@dataclass(frozen=True)
class OperandPlan:
    """What one operator call needs of its operands and what it produces."""

    mesh: DeviceMesh
    operands: tuple[TensorSharding, ...]
    outputs: tuple[TensorSharding, ...]
    #: per output, the mesh axes that shard a label it does not have (a partial sum)
    partial: tuple[tuple[int, ...], ...] = ()
    #: where operands disagreed with equal strength, which split won and why (by cost)
    choice: str = ""


def _labelled(sig: OpSignature) -> list[tuple[str, ...]]:
    return list(sig.labels) + list(sig.output)


def decide_operands(
    sig: OpSignature,
    known: Sequence[Decision | None],
    shapes: Sequence[tuple[int | None, ...] | None],
) -> OperandPlan | None:
    """Decide an operator call's shardings from what is known of its operands.

    Parameters
    ----------
    sig : OpSignature
        The call's signature.
    known : sequence of Decision or None
        One per operand, then one per output (None: unknown).
    shapes : sequence of tuple or None
        Static shapes in the same order, to keep shards even.

    Returns
    -------
    OperandPlan or None
        None when nothing is known yet.
    """
    slots = _labelled(sig)
    order = sorted(
        (i for i, d in enumerate(known) if d is not None),
        key=lambda i: (-int(known[i].strength), i),
    )
    if not order:
        return None
    mesh = known[order[0]].sharding.mesh
    axis_label: list[str | None] = []
    choices: list[str] = []
    for axis in range(mesh.ndim):
        proposed: dict[str, Strength] = {}  # label -> the strongest decision proposing it
        for i in order:
            decision = known[i]
            if decision.sharding.mesh != mesh:
                continue
            entry = decision.sharding.placement.entries[axis]
            if isinstance(entry, Shard) and entry.dim < len(slots[i]):
                label = slots[i][entry.dim]
                if label not in sig.unshardable:
                    proposed.setdefault(label, decision.strength)
        top = max(proposed.values(), default=None)
        tied = [label for label, strength in proposed.items() if strength == top]
        chosen = tied[0] if tied else None
        if len(tied) > 1:
            costs = {label: _axis_cost(sig, label, axis, mesh, known, slots, shapes)
                     for label in tied}
            chosen = min(tied, key=lambda label: costs[label])  # ties: the earlier operand
            choices.append(_choice_note(axis, chosen, costs))
        axis_label.append(chosen)
    _drop_uneven(axis_label, mesh, slots, shapes)

    def placement_for(labels: tuple[str, ...]) -> TensorSharding:
        entries = []
        for label in axis_label:
            if label is not None and label in labels:
                entries.append(Shard(labels.index(label)))
            else:
                entries.append(Replicate())
        return TensorSharding(mesh, Placement(tuple(entries)))

    return OperandPlan(
        mesh=mesh,
        operands=tuple(placement_for(labels) for labels in sig.labels),
        outputs=tuple(placement_for(labels) for labels in sig.output),
        partial=tuple(tuple(axis for axis, label in enumerate(axis_label)
                            if label is not None and label not in labels)
                      for labels in sig.output),
        choice="; ".join(choices),
    )


def _axis_cost(sig: OpSignature, label: str, axis: int, mesh: DeviceMesh,
               known: Sequence[Decision | None], slots: list[tuple[str, ...]],
               shapes: Sequence[tuple[int | None, ...] | None]) -> tuple[float, float]:
    """What splitting ``label`` on mesh ``axis`` costs: (elements moved, elements held) per rank.

    Moved: every known value that is split on ``axis`` another way is gathered
    (``(p-1)/p`` of it) or exchanged (``(p-1)/p**2``); a replicated one is
    sliced for free; a reduction label leaves the outputs partial, completed by
    an all-reduce (``2(p-1)/p`` of each). Held: the elements of every operand and
    output on one rank. An unknown extent counts as unknown (infinite), so that
    a choice between unknowns falls back to the operands' order.
    """
    p = mesh.shape[axis]
    moved = held = 0.0
    for i, labels in enumerate(slots):
        size = _elements(shapes[i] if i < len(shapes) else None)
        held += size / p if label in labels else size
        decision = known[i]
        if decision is None or decision.sharding.mesh != mesh:
            continue
        entry = decision.sharding.placement.entries[axis]
        if not isinstance(entry, Shard):
            continue
        if label not in labels:
            moved += size * (p - 1) / p
        elif labels.index(label) != entry.dim:
            moved += size * (p - 1) / (p * p)
    if all(label not in out for out in sig.output):
        for j in range(len(sig.labels), len(slots)):
            moved += 2 * _elements(shapes[j] if j < len(shapes) else None) * (p - 1) / p
    return moved, held


def _elements(shape: tuple[int | None, ...] | None) -> float:
    if shape is None or any(d is None for d in shape):
        return float("inf")
    count = 1
    for d in shape:
        count *= d
    return float(count)


def _choice_note(axis: int, chosen: str, costs: dict[str, tuple[float, float]]) -> str:
    def text(label):
        moved, held = costs[label]
        return f"'{label}' moves {moved:,.0f} and holds {held:,.0f} elements per rank"

    others = [label for label in costs if label != chosen]
    how = "as cheap as" if any(costs[o] == costs[chosen] for o in others) else "cheaper than"
    return (f"mesh axis {axis}: split {text(chosen)}; {how} "
            + ", ".join(text(label) for label in others))


def _drop_uneven(axis_label, mesh, slots, shapes) -> None:
    """Replicate instead of sharding a label whose static extents do not divide."""
    for label in set(filter(None, axis_label)):
        parts = 1
        for axis, chosen in enumerate(axis_label):
            if chosen == label:
                parts *= mesh.shape[axis]
        for labels, shape in zip(slots, shapes):
            if shape is None or label not in labels:
                continue
            extent = shape[labels.index(label)]
            if extent is not None and extent % parts:
                for axis, chosen in enumerate(axis_label):
                    if chosen == label:
                        axis_label[axis] = None
                break


def check_single_home(
    known: Sequence[Decision | None], names: Sequence[str], *, function: str, site: str
) -> None:
    """Refuse a site whose strongest decisions are sources on two different meshes.

    Annotations win conflicts, but when two annotations (or caller signatures)
    put the operands of one operator or call on different meshes, no rule says
    where it runs.

    Raises
    ------
    ShardingConflictError
        Naming the function, the site and both shardings.
    """
    sources = [(n, d) for n, d in zip(names, known)
               if d is not None and d.strength == Strength.SOURCE]
    for name, decision in sources[1:]:
        first_name, first = sources[0]
        if decision.sharding.mesh != first.sharding.mesh:
            raise ShardingConflictError(
                f"{site} takes '{first_name}' as {first.sharding} and '{name}' as "
                f"{decision.sharding}; both are annotated, so no rule decides where it runs",
                function=function,
                var=name,
                placement=str(decision.sharding.placement),
                hint="redistribute one of them to the other's mesh with R.dist.redistribute, "
                "or drop one annotation",
            )


def completes_a_partial_sum(plan: OperandPlan, operands: Sequence[Decision | None],
                             outputs: Sequence[Decision | None]) -> bool:
    """Whether the plan would complete a partial operand by replicating the result.

    True when no result is decided yet, some operand is a partial sum on mesh
    axis ``a`` and every result of ``plan`` replicates ``a``: the results'
    layout on ``a`` is then free, and a use may still ask for a split there (a
    reduce-scatter instead of an all-reduce).
    """
    if any(d is not None for d in outputs):
        return False
    axes = {a for d in operands if d is not None for a in d.partial}
    return any(all(out.placement.entries[a].is_replicate() for out in plan.outputs)
               for a in axes if a < plan.mesh.ndim)


def only_replicated(known: Sequence[Decision | None]) -> bool:
    """Whether some of a call's values are unknown and every known one is replicated.

    Such a call is decided last: a replicated operand holds every slice, so it
    constrains neither the others nor the result.
    """
    decided = [d for d in known if d is not None]
    return (len(decided) < len(known) and all(
        not d.partial and not any(e.is_shard() for e in d.sharding.placement.entries)
        for d in decided))


def relayout_strength(sig: OpSignature | None, operands: Sequence[Decision | None]) -> Strength:
    """How firmly an operator's result is held: as its operand for a pure relayout.

    A transpose (or a reshape that keeps every axis) of one operand moves no
    value between ranks, so its result is held as firmly as the operand: the
    transposed weight of a ``Linear`` keeps its annotation's strength, and a
    matmul that meets it and a propagated activation keeps the weight split
    (Megatron gathers the activation, never the weight). Every other result is
    :attr:`Strength.PROPAGATED`.
    """
    if (sig is None or len(operands) != 1 or operands[0] is None or len(sig.output) != 1
            or set(sig.output[0]) != set(sig.labels[0])):
        return Strength.PROPAGATED
    return operands[0].strength


def partial_note(axes: tuple[int, ...]) -> str:
    """The reason's note for a partial sum on ``axes``."""
    if not axes:
        return ""
    which = ", ".join(str(a) for a in axes)
    return (f"; a partial sum (P) on mesh axis {which}, its summed axis being split there: "
            "completed by an all-reduce, or a reduce-scatter where a use splits it")


def replicated_plan(known: Sequence[Decision | None], n_operands: int,
                    n_outputs: int) -> OperandPlan | None:
    """Every operand and result replicated on the mesh of the strongest known decision."""
    decided = [d for d in known if d is not None]
    if not decided:
        return None
    mesh = max(decided, key=lambda d: int(d.strength)).sharding.mesh
    rep = replicated(mesh)
    return OperandPlan(mesh, (rep,) * n_operands, (rep,) * n_outputs)
