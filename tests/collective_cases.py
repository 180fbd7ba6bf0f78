"""Rank programs that call every ``tvm_distx.ccl.*`` collective, and what numpy says they give.

A *case* is one call: a collective over the groups of a mesh along some axes,
on an input of a dtype and shape. :func:`rank_module` writes one Relax function
per mesh that makes every case's call in turn (``R.call_dps_packed`` on the
ABI names, as lowered programs do) and returns their results as a tuple;
:meth:`Case.expected` computes each device's results with numpy. A backend test
compiles the module once, runs the function on every device of the mesh (the
emulator, disco workers or MPI ranks) and compares.

Inputs are small integers, exact in every dtype and under every reduction, so
results compare exactly; each device's input is derived from the case name.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax

from tvm_distx import ccl
from tvm_distx.ccl import CollectiveGroup
from tvm_distx.layout.mesh import DeviceMesh

REDUCE = {"sum": lambda a: np.sum(a, axis=0), "prod": lambda a: np.prod(a, axis=0),
          "min": lambda a: np.min(a, axis=0), "max": lambda a: np.max(a, axis=0),
          "avg": lambda a: np.sum(a, axis=0) / len(a)}


@dataclass(frozen=True)
class Case:
    """One collective call: ``op`` over ``mesh`` along ``axes``.

    ``dims`` are the ABI's tensor axes (``(dim,)``, or ``(split, concat)`` for
    an all-to-all); ``kind`` a key of :data:`REDUCE` for the reductions.
    """

    op: str
    mesh_shape: tuple[int, ...]
    axes: tuple[int, ...]
    dtype: str = "float32"
    dims: tuple[int, ...] = ()
    kind: str = ""
    shape: tuple[int, ...] = (4, 8, 4)  # every device's input

    @property
    def name(self) -> str:
        return (f"{self.op}-{self.kind}-{self.dtype}-dims{self.dims}-mesh{self.mesh_shape}"
                f"-axes{self.axes}")

    def group(self) -> CollectiveGroup:
        return CollectiveGroup(self.mesh_shape, 0, self.axes)

    def inputs(self) -> np.ndarray:
        """Every device's input, stacked (device ``d`` at index ``d``)."""
        size = int(np.prod(self.mesh_shape))
        rng = np.random.default_rng(zlib.crc32(self.name.encode()))
        low = 1 if self.kind == "prod" else -3  # products of small positive values stay exact
        return rng.integers(low, 4, size=(size, *self.shape)).astype(self.dtype)

    def out_shape(self) -> tuple[int, ...]:
        p = len(self.group().members(0))
        shape = list(self.shape)
        if self.op == "allgather":
            shape[self.dims[0]] *= p
        elif self.op in ("reducescatter", "local_slice"):
            shape[self.dims[0]] //= p
        elif self.op == "alltoall":
            shape[self.dims[0]] //= p
            shape[self.dims[1]] *= p
        return tuple(shape)

    def expected(self, device: int) -> np.ndarray:
        everyone = self.inputs()
        members = self.group().members(device)
        me = members.index(device)
        mine = everyone[list(members)]
        if self.op == "allreduce":
            want = REDUCE[self.kind](mine)
        elif self.op == "reducescatter":
            want = np.split(REDUCE[self.kind](mine), len(members), axis=self.dims[0])[me]
        elif self.op == "allgather":
            want = np.concatenate(list(mine), axis=self.dims[0])
        elif self.op == "alltoall":
            split, concat = self.dims
            want = np.concatenate([np.split(x, len(members), axis=split)[me] for x in mine],
                                  axis=concat)
        elif self.op == "broadcast":
            want = everyone[members[self.dims[0]]]
        elif self.op == "local_slice":
            want = np.split(everyone[device], len(members), axis=self.dims[0])[me]
        else:
            raise ValueError(self.op)
        return want.astype(self.dtype)


_NAMES = {"allreduce": ccl.ALLREDUCE, "reducescatter": ccl.REDUCE_SCATTER,
          "allgather": ccl.ALLGATHER, "alltoall": ccl.ALLTOALL, "broadcast": ccl.BROADCAST,
          "local_slice": ccl.LOCAL_SLICE}


def cases_for(mesh_shape: tuple[int, ...]) -> list[Case]:
    """Every collective on the groups of ``mesh_shape`` along each axis (and all axes)."""
    axes_list = [(a,) for a in range(len(mesh_shape))]
    if len(mesh_shape) > 1:
        axes_list.append(tuple(range(len(mesh_shape))))
    out = []
    for axes in axes_list:
        for kind in REDUCE:
            out.append(Case("allreduce", mesh_shape, axes, kind=kind))
            for dim in (0, 1):
                out.append(Case("reducescatter", mesh_shape, axes, dims=(dim,), kind=kind))
        for dtype in ("float16", "int32"):
            out.append(Case("allreduce", mesh_shape, axes, dtype, kind="sum"))
            out.append(Case("reducescatter", mesh_shape, axes, dtype, (2,), "sum"))
        out.append(Case("reducescatter", mesh_shape, axes, "int32", (1,), "avg"))
        for dim in (0, 1, 2):
            out.append(Case("allgather", mesh_shape, axes, dims=(dim,)))
            out.append(Case("local_slice", mesh_shape, axes, "int32", (dim,)))
        out.append(Case("allgather", mesh_shape, axes, "float16", (1,)))
        for split, concat in ((1, 0), (0, 1), (2, 1)):
            out.append(Case("alltoall", mesh_shape, axes, dims=(split, concat)))
        out.append(Case("broadcast", mesh_shape, axes, dims=(0,)))
        out.append(Case("broadcast", mesh_shape, axes, "int32", (1,)))
    return out


def rank_module(programs: dict[str, list[Case]]) -> tvm.IRModule:
    """One function per entry of ``programs``, making every case's call in turn: parameters
    and results in case order."""
    bb = relax.BlockBuilder()
    for name, cases in programs.items():
        params = [relax.Var(f"x{i}", relax.TensorType(c.shape, c.dtype))
                  for i, c in enumerate(cases)]
        with bb.function(name, params):
            outs = []
            for case, x in zip(cases, params):
                args = [x]
                if case.kind:
                    args.append(relax.prim_value(ccl.REDUCE_KINDS[case.kind]))
                args.append(relax.ShapeExpr(case.group().encode()))
                if case.op != "allreduce":
                    args.append(relax.ShapeExpr(list(case.dims)))
                outs.append(bb.emit(relax.call_dps_packed(
                    _NAMES[case.op], relax.Tuple(args),
                    relax.TensorType(case.out_shape(), case.dtype))))
            bb.emit_func_output(relax.Tuple(outs))
    return bb.get()


def device_inputs(cases: list[Case], device: int) -> list[np.ndarray]:
    return [c.inputs()[device] for c in cases]


def check(cases: list[Case], device: int, outs) -> None:
    """Every result of ``device`` equals numpy's (exactly, with its dtype)."""
    assert len(outs) == len(cases)
    for case, got in zip(cases, outs):
        want = case.expected(device)
        assert got.dtype == want.dtype and got.shape == want.shape, (case.name, device)
        np.testing.assert_array_equal(got, want, err_msg=f"{case.name} on device {device}")


def mesh(shape: tuple[int, ...]) -> DeviceMesh:
    return DeviceMesh(shape, range(int(np.prod(shape))))
