"""Run a redistribution plan on numpy data, as every rank would (a test helper).

:func:`simulate` executes each step of a
:class:`~tvm_distx.legalize.planner.RedistPlan` on per-device numpy blocks:
collectives run in every sub-group of their mesh axis (members in coordinate
order), a send/recv copies the boxes of
:func:`tvm_distx.layout.send_recv_transfers`. A source with partial sums starts
from one full-shape addend per coordinate along its partial axes; all-reduce
and reduce-scatter add the group's addends in member order.
"""

from __future__ import annotations

import itertools

import numpy as np

from tvm_distx.layout import TensorSharding, device_boxes, encode_placement, send_recv_transfers
from tvm_distx.layout.geometry import intersect
from tvm_distx.legalize.planner import Collective, RedistPlan, RedistStep

__all__ = ["simulate", "groups", "partial_coords", "split_into_addends"]


def groups(mesh, axis: int) -> np.ndarray:
    """Rows of global device ids that form the sub-groups along ``axis``, in group order."""
    grid = np.arange(mesh.size).reshape(mesh.shape) + mesh.device_range.start
    return np.moveaxis(grid, axis, -1).reshape(-1, mesh.shape[axis])


def partial_coords(sharding: TensorSharding, device: int) -> tuple[int, ...]:
    """``device``'s coordinates along the partial axes of ``sharding`` (which addend it holds)."""
    coord = np.unravel_index(device - sharding.mesh.device_range.start, sharding.mesh.shape)
    return tuple(int(coord[a]) for a in sharding.placement.partial_axes())


def split_into_addends(sharding: TensorSharding, array: np.ndarray,
                       rng: np.random.Generator) -> dict[tuple[int, ...], np.ndarray]:
    """Random integer-valued addends, one per coordinate of the partial axes, summing to ``array``."""
    sizes = [sharding.mesh.shape[a] for a in sharding.placement.partial_axes()]
    keys = list(itertools.product(*[range(n) for n in sizes]))
    addends = {k: rng.integers(-50, 50, array.shape).astype(array.dtype) for k in keys[1:]}
    addends[keys[0]] = array - sum(addends.values(), np.zeros_like(array))
    return addends


def _boxes(sharding: TensorSharding, shape):
    return device_boxes(sharding.mesh, encode_placement(sharding.placement), tuple(shape))


def _within(box, block) -> tuple[slice, ...]:
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(box, block))


def _send_recv(step: RedistStep, local: dict[int, np.ndarray], shape) -> dict[int, np.ndarray]:
    wanted, own = _boxes(step.dst, shape), _boxes(step.src, shape)
    dtype = next(iter(local.values())).dtype
    out, filled = {}, {}
    for device, box in wanted.items():
        out[device] = np.empty([b - a for a, b in box], dtype)
        filled[device] = np.zeros(out[device].shape, bool)
        held = own.get(device)
        common = intersect(box, held) if held is not None else None
        if common is not None:
            out[device][_within(common, box)] = local[device][_within(common, held)]
            filled[device][_within(common, box)] = True
    for t in send_recv_transfers(step.src, step.dst, shape):
        box, held = wanted[t.receiver], own[t.sender]
        out[t.receiver][_within(t.bounds, box)] = local[t.sender][_within(t.bounds, held)]
        filled[t.receiver][_within(t.bounds, box)] = True
    missing = [d for d, mask in filled.items() if not mask.all()]
    assert not missing, f"send/recv leaves devices {missing} incomplete"
    return out


def _apply(step: RedistStep, local: dict[int, np.ndarray], shape) -> dict[int, np.ndarray]:
    if step.collective is Collective.SEND_RECV:
        return _send_recv(step, local, shape)
    out = dict(local)
    p = step.src.mesh.shape[step.mesh_axis]
    for group in groups(step.src.mesh, step.mesh_axis):
        members = [int(d) for d in group]
        kind = step.collective
        if kind is Collective.LOCAL_SLICE:
            for k, d in enumerate(members):
                out[d] = np.split(local[d], p, axis=step.tensor_axes[0])[k]
        elif kind is Collective.ALL_GATHER:
            whole = np.concatenate([local[d] for d in members], axis=step.tensor_axes[0])
            for d in members:
                out[d] = whole
        elif kind is Collective.ALL_TO_ALL:
            split, concat = step.tensor_axes
            pieces = [np.split(local[d], p, axis=split) for d in members]
            for k, d in enumerate(members):
                out[d] = np.concatenate([pieces[m][k] for m in range(p)], axis=concat)
        elif kind in (Collective.ALL_REDUCE, Collective.REDUCE_SCATTER):
            total = local[members[0]].copy()
            for d in members[1:]:
                total += local[d]
            for k, d in enumerate(members):
                out[d] = (total if kind is Collective.ALL_REDUCE
                          else np.split(total, p, axis=step.tensor_axes[0])[k])
        else:  # pragma: no cover - a collective the simulator does not know
            raise AssertionError(f"unknown collective {kind}")
    return out


def simulate(plan: RedistPlan, array: np.ndarray,
             addends: dict[tuple[int, ...], np.ndarray] | None = None) -> dict[int, np.ndarray]:
    """Run a plan on real data.

    Parameters
    ----------
    plan : RedistPlan
    array : numpy.ndarray
        The global tensor, of ``plan.shape``.
    addends : dict, optional
        For a source with partial sums: the full-shape addend held at each
        coordinate along the partial axes (:func:`split_into_addends`); they
        should sum to ``array``.

    Returns
    -------
    dict of int to numpy.ndarray
        Per device of the destination mesh, the block it ends with.
    """
    array = np.asarray(array)
    if tuple(array.shape) != plan.shape:
        raise ValueError(f"the array has shape {array.shape}, the plan {plan.shape}")
    if plan.src.placement.has_partial() and addends is None:
        raise ValueError("a source with partial sums needs its addends")
    local = {}
    for device, box in _boxes(plan.src, plan.shape).items():
        whole = addends[partial_coords(plan.src, device)] if addends is not None else array
        local[device] = np.array(whole[tuple(slice(a, b) for a, b in box)])
    for step in plan.steps:
        local = _apply(step, local, plan.shape)
    return local
