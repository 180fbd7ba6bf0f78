"""The redistribution planner: the cheapest valid way to move a tensor between shardings.

:func:`plan_redistribute` turns one change of sharding (``src`` to ``dst``, a
static shape and a dtype) into a :class:`RedistPlan`: a sequence of
:class:`RedistStep` collectives, each run by the sub-groups of one mesh axis,
or one point-to-point :attr:`Collective.SEND_RECV`. The module is pure Python
and numpy; it imports no TVM, and its results are cached. All geometry (the
layout convention, placement codes, each device's box, the transfers of a
send/recv) is :mod:`tvm_distx.layout`'s; shapes are static and every sharded
dimension must divide evenly.

Steps and their cost
--------------------
A step along mesh axis ``a`` runs in every sub-group of the ranks that differ
only in their coordinate along ``a`` (``p = mesh.shape[a]`` ranks, in coordinate
order). ``s`` is the size in bytes of the step's input on one rank
(local elements times the dtype's item size). The algorithms are ring ones:

==================  ==========================  ==========================  =======================
collective          placement change on axis a  ``tensor_axes``             bytes sent = received
==================  ==========================  ==========================  =======================
``LOCAL_SLICE``     ``R -> S[j]``               ``(j,)``                    0
``ALL_GATHER``      ``S[i] -> R``               ``(i,)``                    ``s * (p - 1)``
``ALL_TO_ALL``      ``S[i] -> S[j]``            ``(j, i)`` (split, concat)  ``s * (p - 1) / p``
``ALL_REDUCE``      ``P -> R``                  ``()``                      ``2 * s * (p - 1) / p``
``REDUCE_SCATTER``  ``P -> S[j]``               ``(j,)``                    ``s * (p - 1) / p``
``SEND_RECV``       the whole sharding          ``()``                      see below
==================  ==========================  ==========================  =======================

* ``LOCAL_SLICE``: every rank splits its block along ``j`` into ``p`` pieces and
  keeps piece ``c_a``.
* ``ALL_GATHER``: every rank concatenates the blocks of its group along ``i``, in
  group order.
* ``ALL_TO_ALL``: every rank splits its block along ``j`` into ``p`` pieces and
  sends piece ``k`` to group member ``k``; it concatenates what it receives
  along ``i``, in group order.
* ``ALL_REDUCE``: every rank ends with the sum of its group's addends.
* ``REDUCE_SCATTER``: member ``k`` of a group ends with block ``k`` along ``j``
  of the sum of the group's addends.
* ``SEND_RECV`` (``mesh_axis=None``): every destination rank receives exactly the
  elements of its destination block that it does not already hold (when the two
  meshes share devices, data a device already holds is never sent); each
  element comes from one of the source ranks holding it (the least loaded one,
  so that replicas share the sending). A rank sends what others take from it.
  :func:`send_recv_transfers` lists the transfers.

Because of the nested-split convention, a single-axis step is *valid* (its
result is again a correct layout) only when it touches the innermost split of a
dimension: ``ALL_GATHER`` on ``a`` of dimension ``i`` needs ``a`` to be the
highest-numbered mesh axis sharding ``i``; ``LOCAL_SLICE`` onto ``j`` needs ``a``
to be higher-numbered than every axis already sharding ``j``; ``ALL_TO_ALL`` needs
both; ``REDUCE_SCATTER`` onto ``j`` adds a split like ``LOCAL_SLICE`` and needs
what it needs. (Mesh axes of size 1 never matter.) A partial sum on other axes
does not restrict a step: every collective here is linear, so it moves addends
as it moves values.

A step's ``bytes_sent`` / ``bytes_received`` are per rank, the maximum over
ranks. A plan's ``bytes_received`` (``bytes_sent``) is the **sum over its steps of
each step's per-rank maximum**. For collectives every rank moves the same
amount, so this is exactly what each rank receives; for a plan of one
``SEND_RECV`` it is the maximum over ranks.

Lower bound
-----------
Whatever the algorithm, rank ``r`` must receive every element of its destination
block ``D(r)`` that is not in its source block ``S(r)``::

    lower_bound = itemsize * max_r |D(r) \\ S(r)| = itemsize * max_r (|D(r)| - |D(r) ∩ S(r)|)

Boxes intersect dimension by dimension, so ``|D(r) ∩ S(r)| = prod_d ov_d(r)``
with ``ov_d(r)`` the overlap of the two intervals along ``d``. On one mesh
this has a closed form in the placements alone. Write ``A_src(d)`` and
``A_dst(d)`` for the mesh axes (of size > 1, in increasing order) that shard
dimension ``d``, and ``L_src(d) = n_d / P_src(d)``, ``L_dst(d) = n_d / P_dst(d)``
for the block lengths (``P`` the product of those axes' sizes). Then

* if ``A_src(d)`` is a prefix of ``A_dst(d)``, the destination split refines the
  source one: ``D`` lies inside ``S`` along ``d`` on every rank, ``ov_d = L_dst(d)``;
* if ``A_dst(d)`` is a prefix of ``A_src(d)``, ``ov_d = L_src(d)`` on every rank;
* otherwise the sequences first differ at some position; the smaller of the
  two axes found there, ``x``, shards ``d`` on one side only, so its coordinate
  moves that side's block freely while the other side's block stays put. Setting
  the other side's remaining coordinates to 0 and ``c_x = p_x - 1`` makes the two
  intervals disjoint (``1/Q + 1/p_x <= 1`` for ``Q, p_x >= 2``): ``min_r ov_d(r) = 0``.

Since every ``|D(r)|`` equals ``|dst block| = prod_d L_dst(d)``, and a product of
non-negative factors is 0 as soon as one factor can be made 0, the bound on one
mesh is::

    lower_bound = itemsize * prod_d L_dst(d) * (1 - prod_d rho_d)

    rho_d = 1                         if A_src(d) is a prefix of A_dst(d)
          = P_dst(d) / P_src(d)       if A_dst(d) is a (proper) prefix of A_src(d)
          = 0                         otherwise

For example ``"S[0]"`` to ``"S[1]"`` on ``p`` ranks gives
``|T| / p * (1 - 1/p) = |T| (p - 1) / p^2``, and ``"S[0]S[1]"`` to ``"S[1]S[0]"``
gives a whole block. Between two different meshes, ``S(r)`` is empty on a
device outside the source mesh (so disjoint meshes give ``itemsize * |dst
block|``); otherwise the per-device formula above is evaluated with the
intervals of both meshes.

Partial sums
------------
Write ``G`` for the product of the sizes of the mesh axes that are ``P`` in
``src`` and not in ``dst`` (the reduced axes), ``M`` for those ``P`` on both
sides, ``B`` for those ``R`` in ``dst``, ``n`` for the mesh size and ``N`` for
the elements of the tensor. Two bounds hold, and the bound is their maximum:

* reading ``P`` as ``R`` on both sides, the bound above: a rank that holds no
  addend of an element of its destination block must receive a value for it;
* when ``G >= 2``, counting the whole mesh: an element's sum over ``G``
  distinct addends, held on different ranks, reaches one rank only after
  ``G - 1`` messages (each message merges at most two partial sums), and each
  of the other ``B - 1`` ranks that must hold it needs one more message
  arriving after that (the one-way gossip count, ``2(p - 1)`` for an
  all-reduce). The ``N * M`` (element, unreduced-axis coordinate) pairs are
  independent, so all ranks together receive at least
  ``N * M * (G + B - 2)`` values, and the busiest rank at least the average::

    lower_bound >= itemsize * ceil(N * M * (G + B - 2) / n)

On one axis of ``p`` ranks this is ``2 (p - 1) / p`` of the tensor for
``P -> R``, which a ring all-reduce receives, and ``(p - 1) / p`` for
``P -> S[j]``, which a reduce-scatter receives. On a 2x2 mesh ``"PP" -> "RR"``
gives ``1.5`` tensors: reduce-scatter, all-reduce on the other axis, all-gather
meets it, where two all-reduces receive 2. The count assumes messages carry
values of single elements (no coding across elements) and that an axis that
stays ``P`` keeps its addends (a ``P -> P`` axis is left alone).

Planning
--------
On one mesh, compare the entries axis by axis: ``R->R`` and ``S[i]->S[i]`` need
nothing, ``R->S[j]`` is a ``LOCAL_SLICE``, ``S[i]->R`` an ``ALL_GATHER`` and
``S[i]->S[j]`` an ``ALL_TO_ALL`` (when valid, never a gather and a slice), ``P->R`` an
``ALL_REDUCE``, ``P->S[j]`` a ``REDUCE_SCATTER`` and ``P->P`` nothing. The order of the
steps, and any detour through other placements that the nesting rule makes
necessary (``"S[2]S[1]" -> "S[0]R"`` is an all-to-all on axis 0 then a gather on
axis 1), is found by a shortest-path search over the placements of the mesh that
divide the shape, with edges the valid single-axis steps above, ordered by
(bytes received, number of steps, then a fixed order of the steps). The search
never passes through an unnecessary ``R``, since a gather that is not needed
costs bytes. Partial sums only disappear: a step never makes a ``P``, an axis
that stays ``P`` is never reduced, and a ``dst`` with ``P`` on an axis where
``src`` has none is refused (only an operator makes partial sums). The search
reduces where the data is smallest, so ``"PR" -> "RS[0]"`` slices first and
all-reduces half the tensor.

If that sequence of collectives receives exactly the lower bound, it is the
plan. Otherwise no sequence of single-axis collectives reaches the bound, and a
single ``SEND_RECV`` over the ranks of the mesh, which always receives exactly
the bound, is chosen instead unless ``allow_send_recv=False``. That happens when
data must be relayed across two mesh axes (``"S[0]S[1]" -> "S[1]S[0]"`` on 2x2:
rank (0, 1) needs the block of rank (1, 0)), when a split must be put outside
one that stays (``"RS[0]" -> "S[0]S[0]"``: a slice only adds an inner split), or
when a split moves between axes of different sizes (``"S[0]R" -> "RS[0]"`` on
2x4: the gather over 2 ranks brings half the tensor, the rank keeps a quarter).
Collectives move the same amount on every rank while the bound is a maximum
over ranks, so any detour shows. Between two different meshes the plan is one
``SEND_RECV``. A source with partial sums is always planned as collectives (a
send/recv copies and cannot add), so on N-D meshes such a plan may receive more
than the bound; a move of a partial sum between meshes is refused.

Plans are cached (:func:`functools.lru_cache`): equal arguments return the same
:class:`RedistPlan` object. Meshes that differ only by name are equal, so a
cached plan may carry the names of the meshes it was first asked with.
"""

from __future__ import annotations

import enum
import functools
import heapq
import logging
import math
import re
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from tvm_distx.errors import InternalError, ShardingError
from tvm_distx.layout import TensorSharding
from tvm_distx.layout.geometry import (
    PARTIAL,
    REPLICATE,
    Code,
    Transfer,
    box_volume,
    check_sharding,
    decode_placement,
    device_boxes,
    divides,
    encode_placement,
    intersect,
    same_blocks_code,
    local_elements,
    send_recv_transfers,
    shard_bounds,
    sharding_axes,
    split_parts,
    static_shape,
    transfers,
)

__all__ = [
    "Collective",
    "RedistStep",
    "RedistPlan",
    "plan_redistribute",
    "lower_bound_bytes",
    "dtype_itemsize",
    # geometry, re-exported from tvm_distx.layout for callers of the planner
    "Transfer",
    "shard_bounds",
    "send_recv_transfers",
]

logger = logging.getLogger(__name__)


class Collective(enum.Enum):
    """The kinds of redistribution step."""

    LOCAL_SLICE = "local_slice"
    ALL_GATHER = "all_gather"
    ALL_TO_ALL = "all_to_all"
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    SEND_RECV = "send_recv"


@dataclass(frozen=True)
class RedistStep:
    """One step of a plan.

    Parameters
    ----------
    mesh_axis : int or None
        The mesh axis whose sub-groups run the collective; None for a
        ``SEND_RECV``.
    collective : Collective
        What runs.
    tensor_axes : tuple of int
        ``(gather_dim,)`` for an all-gather, ``(split_dim,)`` for a local slice
        or a reduce-scatter, ``(split_dim, concat_dim)`` for an all-to-all,
        ``()`` for an all-reduce or a send/recv.
    src, dst : TensorSharding
        The sharding before and after the step.
    bytes_sent, bytes_received : int
        Per rank, the maximum over ranks.
    """

    mesh_axis: int | None
    collective: Collective
    tensor_axes: tuple[int, ...]
    src: TensorSharding
    dst: TensorSharding
    bytes_sent: int
    bytes_received: int


@dataclass(frozen=True)
class RedistPlan:
    """How to move a tensor from ``src`` to ``dst``.

    Parameters
    ----------
    src, dst : TensorSharding
        The shardings before and after.
    shape : tuple of int
        The tensor's global shape.
    dtype : str
        Its element type.
    steps : tuple of RedistStep
        In order; empty when nothing moves.
    bytes_received, bytes_sent : int
        Per rank over the whole plan: the sum over the steps of each step's
        per-rank maximum.
    lower_bound : int
        The bytes that some rank must receive whatever the algorithm
        (:func:`lower_bound_bytes`).
    """

    src: TensorSharding
    dst: TensorSharding
    shape: tuple[int, ...]
    dtype: str
    steps: tuple[RedistStep, ...]
    bytes_received: int
    bytes_sent: int
    lower_bound: int

    @property
    def meets_lower_bound(self) -> bool:
        """True when the plan receives no more than the lower bound."""
        return self.bytes_received == self.lower_bound


# ---------------------------------------------------------------------- inputs
_FLOAT8 = re.compile(r"float8(_[A-Za-z0-9]+)?")


def dtype_itemsize(dtype) -> int:
    """The size in bytes of one element of ``dtype``.

    Parameters
    ----------
    dtype : str or numpy dtype
        ``"float32"``, ``"float16"``, ``"int8"``, ``"bool"``, ``"bfloat16"`` (2
        bytes), ``"float8_e4m3fn"`` (1 byte), ...

    Raises
    ------
    ShardingError
        For a type that is not a whole number of bytes or is unknown.
    """
    name = _dtype_name(dtype)
    if name == "bfloat16":
        return 2
    if _FLOAT8.fullmatch(name):
        return 1
    try:
        parsed = np.dtype(name)
    except TypeError:
        parsed = None
    if parsed is None or parsed.kind not in "biufc":
        raise ShardingError(
            f"cannot size elements of dtype {name!r}",
            hint='use a numeric dtype such as "float32", "float16", "bfloat16" or "int8"',
        )
    return int(parsed.itemsize)


def _dtype_name(dtype) -> str:
    if isinstance(dtype, str):
        return dtype
    try:
        return np.dtype(dtype).name
    except (TypeError, ValueError):  # e.g. a TVM DataType, whose text is its name
        return str(dtype)


def _check(sharding: TensorSharding, shape: tuple[int, ...], role: str) -> None:
    check_sharding(sharding, shape, f"{role} of a redistribution")


# ---------------------------------------------------------------------- lower bound
def _is_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return b[: len(a)] == a


def _lower_bound_elements(src: TensorSharding, dst: TensorSharding,
                          shape: tuple[int, ...]) -> int:
    """``max_r |D(r) \\ S(r)|``, with partial sums read as replicas."""
    dst_code = _as_replicas(encode_placement(dst.placement))
    dst_block = local_elements(dst_code, shape, dst.mesh.shape)
    if src.mesh == dst.mesh:
        mesh_shape = src.mesh.shape
        src_code = _as_replicas(encode_placement(src.placement))
        kept = 1  # min over ranks of |D(r) ∩ S(r)|, dimension by dimension
        for d, n in enumerate(shape):
            a_src = sharding_axes(src_code, d, mesh_shape)
            a_dst = sharding_axes(dst_code, d, mesh_shape)
            if _is_prefix(a_src, a_dst):
                kept *= n // split_parts(dst_code, d, mesh_shape)
            elif _is_prefix(a_dst, a_src):
                kept *= n // split_parts(src_code, d, mesh_shape)
            else:
                kept = 0
        return dst_block - kept
    src_devices = set(src.mesh.device_range)
    if not src_devices.intersection(dst.mesh.device_range):
        return dst_block
    src_boxes = device_boxes(src.mesh, encode_placement(src.placement), shape)
    worst = 0
    for device, box in device_boxes(dst.mesh, dst_code, shape).items():
        own = src_boxes.get(device)
        common = intersect(box, own) if own is not None else None
        worst = max(worst, box_volume(box) - (box_volume(common) if common is not None else 0))
    return worst


def _as_replicas(code: Code) -> Code:
    return tuple(REPLICATE if c == PARTIAL else c for c in code)


def _reduction_bound_bytes(src: TensorSharding, dst: TensorSharding, shape: tuple[int, ...],
                           itemsize: int) -> int:
    """``itemsize * ceil(N * M * (G + B - 2) / n)`` when ``G >= 2``, else 0 (see above)."""
    mesh_shape = src.mesh.shape
    src_code, dst_code = encode_placement(src.placement), encode_placement(dst.placement)
    reduced = math.prod(p for p, a, b in zip(mesh_shape, src_code, dst_code)
                        if a == PARTIAL and b != PARTIAL)
    if reduced < 2:
        return 0
    kept = math.prod(p for p, a, b in zip(mesh_shape, src_code, dst_code)
                     if a == PARTIAL and b == PARTIAL)
    holders = math.prod(p for p, b in zip(mesh_shape, dst_code) if b == REPLICATE)
    values = math.prod(shape) * kept * (reduced + holders - 2) * itemsize
    return -(-values // src.mesh.size)


def _lower_bound(src: TensorSharding, dst: TensorSharding, shape: tuple[int, ...],
                 itemsize: int) -> int:
    copies = itemsize * _lower_bound_elements(src, dst, shape)
    if not src.placement.has_partial():
        return copies
    return max(copies, _reduction_bound_bytes(src, dst, shape, itemsize))


def _check_partial(src: TensorSharding, dst: TensorSharding) -> None:
    """Refuse what no redistribution can do with partial sums."""
    if not (src.placement.has_partial() or dst.placement.has_partial()):
        return
    if src.mesh != dst.mesh:
        raise ShardingError(
            f"cannot move {src} to {dst}: a partial sum moves only within its mesh",
            placement=str(src.placement),
            hint="redistribute it to R or S[k] on its own mesh first, then move it",
        )
    made = [a for a in dst.placement.partial_axes() if a not in src.placement.partial_axes()]
    if made:
        raise ShardingError(
            f"cannot redistribute {src} to {dst}: mesh axis {made[0]} would become a partial "
            "sum, and only an operator (a sharded reduction) makes partial sums",
            placement=str(dst.placement),
            hint="ask for R or S[k] on that mesh axis",
        )


def lower_bound_bytes(src: TensorSharding, dst: TensorSharding, shape: Sequence[int],
                      dtype) -> int:
    """The bytes some rank must receive to go from ``src`` to ``dst``, whatever the algorithm.

    ``itemsize * max_r |D(r) \\ S(r)|``, computed in closed form from the
    placements, and for a source with partial sums the reduction bound (see the
    module documentation).

    Parameters
    ----------
    src, dst : TensorSharding
        The shardings before and after.
    shape : sequence of int
        The static global shape.
    dtype : str
        The element type.

    Returns
    -------
    int
        Bytes per rank.

    Raises
    ------
    ShardingError
        (a subclass) for a placement that does not fit its mesh or the shape, or
        an unknown dtype.
    """
    shape = static_shape(shape)
    _check(src, shape, "source")
    _check(dst, shape, "destination")
    _check_partial(src, dst)
    return _lower_bound(src, dst, shape, dtype_itemsize(dtype))


# ---------------------------------------------------------------------- send/recv
def _send_recv_step(src: TensorSharding, dst: TensorSharding, shape: tuple[int, ...],
                    itemsize: int) -> RedistStep:
    sent: dict[int, int] = {}
    received: dict[int, int] = {}
    for t in transfers(src, dst, shape):
        sent[t.sender] = sent.get(t.sender, 0) + t.elements
        received[t.receiver] = received.get(t.receiver, 0) + t.elements
    return RedistStep(None, Collective.SEND_RECV, (), src, dst,
                      itemsize * max(sent.values(), default=0),
                      itemsize * max(received.values(), default=0))


# ---------------------------------------------------------------------- search
def _inner_ok(code: Code, axis: int, dim: int, mesh_shape: tuple[int, ...]) -> bool:
    """True if ``axis`` is (or would be) the innermost split of ``dim``."""
    if mesh_shape[axis] == 1:
        return True
    return all(a < axis for a in sharding_axes(code, dim, mesh_shape) if a != axis)


# Tie-break between plans of equal cost and length: the kinds in this order.
_KIND_ORDER = {Collective.ALL_TO_ALL: 0, Collective.ALL_GATHER: 1, Collective.LOCAL_SLICE: 2,
               Collective.REDUCE_SCATTER: 3, Collective.ALL_REDUCE: 4}


def _moves(code: Code, shape: tuple[int, ...], mesh_shape: tuple[int, ...], itemsize: int,
           keep: Code):
    """The valid single-axis steps out of ``code``: (axis, kind, tensor_axes, new code, bytes).

    Mesh axes where ``keep`` is :data:`PARTIAL` stay partial sums.
    """
    size = itemsize * local_elements(code, shape, mesh_shape)
    for axis, entry in enumerate(code):
        p = mesh_shape[axis]
        if entry == PARTIAL:
            if keep[axis] == PARTIAL:
                continue
            new = code[:axis] + (REPLICATE,) + code[axis + 1:]
            yield axis, Collective.ALL_REDUCE, (), new, 2 * size * (p - 1) // p
            for j in range(len(shape)):
                new = code[:axis] + (j,) + code[axis + 1:]
                if _inner_ok(code, axis, j, mesh_shape) and divides(new, shape, mesh_shape):
                    yield axis, Collective.REDUCE_SCATTER, (j,), new, size * (p - 1) // p
            continue
        if entry == REPLICATE:
            for j in range(len(shape)):
                new = code[:axis] + (j,) + code[axis + 1:]
                if _inner_ok(code, axis, j, mesh_shape) and divides(new, shape, mesh_shape):
                    yield axis, Collective.LOCAL_SLICE, (j,), new, 0
            continue
        if not _inner_ok(code, axis, entry, mesh_shape):
            continue
        new = code[:axis] + (REPLICATE,) + code[axis + 1:]
        yield axis, Collective.ALL_GATHER, (entry,), new, size * (p - 1)
        for j in range(len(shape)):
            if j == entry:
                continue
            new = code[:axis] + (j,) + code[axis + 1:]
            if _inner_ok(code, axis, j, mesh_shape) and divides(new, shape, mesh_shape):
                yield axis, Collective.ALL_TO_ALL, (j, entry), new, size * (p - 1) // p


@functools.lru_cache(maxsize=4096)
def _search(mesh_shape: tuple[int, ...], src: Code, dst: Code, shape: tuple[int, ...],
            itemsize: int) -> tuple[tuple[int, Collective, tuple[int, ...], Code, int], ...]:
    """The cheapest valid sequence of single-axis collectives (Dijkstra over placements).

    No step makes a partial sum, so ``dst``'s ``P`` axes must be ``P`` in ``src``
    (checked by the caller) and are never reduced.
    """
    # priority: (bytes received, steps, tie-break keys); the path rides along
    heap: list = [(0, 0, (), src, ())]
    done: set[Code] = set()
    while heap:
        cost, nsteps, keys, code, path = heapq.heappop(heap)
        if code in done:
            continue
        if code == dst:
            return path
        done.add(code)
        for axis, kind, tensor_axes, new, moved in _moves(code, shape, mesh_shape, itemsize,
                                                          dst):
            if new in done:
                continue
            key = (_KIND_ORDER[kind], axis, tensor_axes)
            heapq.heappush(heap, (cost + moved, nsteps + 1, keys + (key,), new,
                                  path + ((axis, kind, tensor_axes, new, moved),)))
    raise InternalError(f"no sequence of collectives from {src} to {dst}")  # pragma: no cover


# ---------------------------------------------------------------------- planning
def plan_redistribute(src: TensorSharding, dst: TensorSharding, shape: Sequence[int],
                      dtype, *, allow_send_recv: bool = True) -> RedistPlan:
    """Plan the cheapest valid redistribution of a tensor from ``src`` to ``dst``.

    Parameters
    ----------
    src, dst : TensorSharding
        The shardings before and after.
    shape : sequence of int
        The static global shape.
    dtype : str
        The element type, e.g. ``"float32"`` or ``"bfloat16"``.
    allow_send_recv : bool
        On one mesh, whether a ``SEND_RECV`` may replace a sequence of
        collectives that receives more than the lower bound. With False the
        plan is always collectives along mesh axes (what lowering emits today),
        as it is for a source with partial sums.
        Between two different meshes the plan is a ``SEND_RECV`` regardless.

    Returns
    -------
    RedistPlan
        Cached: equal arguments give the same object.

    Raises
    ------
    PlacementRankError, ShardDimError, IndivisibleShardError
        If a placement does not fit its mesh or the shape.
    ShardingError
        For a dynamic shape or an unknown dtype; for a destination with a
        partial sum where the source has none, or a partial sum moving
        between meshes.
    """
    shape = static_shape(shape)
    _check(src, shape, "source")
    _check(dst, shape, "destination")
    _check_partial(src, dst)
    dtype = _dtype_name(dtype)
    dtype_itemsize(dtype)
    return _plan(src, dst, shape, dtype, bool(allow_send_recv))


@functools.lru_cache(maxsize=4096)
def _plan(src: TensorSharding, dst: TensorSharding, shape: tuple[int, ...], dtype: str,
          allow_send_recv: bool) -> RedistPlan:
    itemsize = dtype_itemsize(dtype)
    bound = _lower_bound(src, dst, shape, itemsize)
    if src.mesh != dst.mesh:
        steps: tuple[RedistStep, ...] = (_send_recv_step(src, dst, shape, itemsize),)
    else:
        mesh = src.mesh
        # splits over one-device mesh axes are replicas: a 1-rank program moves nothing
        target = same_blocks_code(encode_placement(dst.placement), mesh.shape)
        path = _search(mesh.shape, same_blocks_code(encode_placement(src.placement), mesh.shape),
                       target, shape, itemsize)
        collectives = []
        before = src
        for axis, kind, tensor_axes, code, moved in path:
            after = dst if code == target else TensorSharding(mesh, decode_placement(code))
            collectives.append(RedistStep(axis, kind, tensor_axes, before, after, moved, moved))
            before = after
        steps = tuple(collectives)
        received = sum(s.bytes_received for s in steps)
        if received > bound and allow_send_recv and not src.placement.has_partial():
            logger.debug("collectives from %s to %s receive %d bytes > bound %d: send/recv",
                         src, dst, received, bound)
            steps = (_send_recv_step(src, dst, shape, itemsize),)
    plan = RedistPlan(src, dst, shape, dtype, steps,
                      sum(s.bytes_received for s in steps), sum(s.bytes_sent for s in steps),
                      bound)
    logger.debug("planned %s -> %s %s %s: %s, %d bytes received per rank (bound %d)", src, dst,
                 shape, dtype, [s.collective.name for s in steps], plan.bytes_received, bound)
    return plan
