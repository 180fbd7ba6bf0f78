"""The lowered IR of every kind of redistribution, checked structurally.

Each Before module moves ``x`` (8x12x4 float32) from one sharding to another
with ``R.dist.redistribute``. ``LegalizeRedistribute`` then ``LowerDistIR`` must
give exactly the Expected rank-local module: which runtime function runs, along
which mesh axis (the group ``(mesh ndim, *mesh shape, first device, *axes)``),
on which tensor dimensions, and with which local shapes.
"""

from __future__ import annotations

import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from tvm_distx.legalize import LegalizeRedistribute, LowerDistIR


def lowered(mod: tvm.IRModule) -> tvm.IRModule:
    return LowerDistIR()(LegalizeRedistribute()(mod))


# ------------------------------------------------------------------ 1-D meshes
class GatherOn1D:
    @I.ir_module
    class Before:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @R.function
        def main(x: R.dist.DTensor((8, 12, 4), "float32", "mesh[0]", "S[0]")
                 ) -> R.dist.DTensor((8, 12, 4), "float32", "mesh[0]", "R"):
            y = R.dist.redistribute(x, device_mesh="mesh[0]", placement="R")
            return y

    @I.ir_module
    class Expected:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @R.function
        def main(x: R.Tensor((4, 12, 4), "float32")) -> R.Tensor((8, 12, 4), "float32"):
            # all-gather over mesh axis 0 of mesh (2,) at device 0, along tensor dim 0
            y_all_gather = R.call_dps_packed(
                "tvm_distx.ccl.allgather", (x, R.shape([1, 2, 0, 0]), R.shape([0])),
                out_ty=R.Tensor((8, 12, 4), "float32"))
            return y_all_gather


class SliceOn1D:
    @I.ir_module
    class Before:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @R.function
        def main(x: R.dist.DTensor((8, 12, 4), "float32", "mesh[0]", "R")
                 ) -> R.dist.DTensor((8, 12, 4), "float32", "mesh[0]", "S[1]"):
            y = R.dist.redistribute(x, device_mesh="mesh[0]", placement="S[1]")
            return y

    @I.ir_module
    class Expected:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @R.function
        def main(x: R.Tensor((8, 12, 4), "float32")) -> R.Tensor((8, 6, 4), "float32"):
            y_local_slice = R.call_dps_packed(
                "tvm_distx.ccl.local_slice", (x, R.shape([1, 2, 0, 0]), R.shape([1])),
                out_ty=R.Tensor((8, 6, 4), "float32"))
            return y_local_slice


class AllToAllOn1D:
    @I.ir_module
    class Before:
        I.module_global_infos({"mesh": [R.dist.device_mesh((4,), I.Range(0, 4))]})

        @R.function
        def main(x: R.dist.DTensor((8, 12, 4), "float32", "mesh[0]", "S[0]")
                 ) -> R.dist.DTensor((8, 12, 4), "float32", "mesh[0]", "S[1]"):
            y = R.dist.redistribute(x, device_mesh="mesh[0]", placement="S[1]")
            return y

    @I.ir_module
    class Expected:
        I.module_global_infos({"mesh": [R.dist.device_mesh((4,), I.Range(0, 4))]})

        @R.function
        def main(x: R.Tensor((2, 12, 4), "float32")) -> R.Tensor((8, 3, 4), "float32"):
            # one all-to-all: split along dim 1, concatenate along dim 0
            y_all_to_all = R.call_dps_packed(
                "tvm_distx.ccl.alltoall", (x, R.shape([1, 4, 0, 0]), R.shape([1, 0])),
                out_ty=R.Tensor((8, 3, 4), "float32"))
            return y_all_to_all


# ------------------------------------------------------------------ 2-D meshes
class SliceAlongSecondAxis:
    @I.ir_module
    class Before:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2, 2), I.Range(0, 4))]})

        @R.function
        def main(x: R.dist.DTensor((8, 12, 4), "float32", "mesh[0]", "S[0]R")
                 ) -> R.dist.DTensor((8, 12, 4), "float32", "mesh[0]", "S[0]S[1]"):
            y = R.dist.redistribute(x, device_mesh="mesh[0]", placement="S[0]S[1]")
            return y

    @I.ir_module
    class Expected:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2, 2), I.Range(0, 4))]})

        @R.function
        def main(x: R.Tensor((4, 12, 4), "float32")) -> R.Tensor((4, 6, 4), "float32"):
            # the group runs along mesh axis 1 only
            y_local_slice = R.call_dps_packed(
                "tvm_distx.ccl.local_slice", (x, R.shape([2, 2, 2, 0, 1]), R.shape([1])),
                out_ty=R.Tensor((4, 6, 4), "float32"))
            return y_local_slice


class GatherAlongSecondAxis:
    @I.ir_module
    class Before:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2, 2), I.Range(0, 4))]})

        @R.function
        def main(x: R.dist.DTensor((8, 12, 4), "float32", "mesh[0]", "RS[1]")
                 ) -> R.dist.DTensor((8, 12, 4), "float32", "mesh[0]", "RR"):
            y = R.dist.redistribute(x, device_mesh="mesh[0]", placement="RR")
            return y

    @I.ir_module
    class Expected:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2, 2), I.Range(0, 4))]})

        @R.function
        def main(x: R.Tensor((8, 6, 4), "float32")) -> R.Tensor((8, 12, 4), "float32"):
            y_all_gather = R.call_dps_packed(
                "tvm_distx.ccl.allgather", (x, R.shape([2, 2, 2, 0, 1]), R.shape([1])),
                out_ty=R.Tensor((8, 12, 4), "float32"))
            return y_all_gather


class AllToAllThenGather:
    """Two mesh axes change: an all-to-all on axis 0, then a gather on axis 1, never via R."""

    @I.ir_module
    class Before:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2, 2), I.Range(0, 4))]})

        @R.function
        def main(x: R.dist.DTensor((8, 12, 4), "float32", "mesh[0]", "S[2]S[1]")
                 ) -> R.dist.DTensor((8, 12, 4), "float32", "mesh[0]", "S[0]R"):
            y = R.dist.redistribute(x, device_mesh="mesh[0]", placement="S[0]R")
            return y

    @I.ir_module
    class Expected:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2, 2), I.Range(0, 4))]})

        @R.function
        def main(x: R.Tensor((8, 6, 2), "float32")) -> R.Tensor((4, 12, 4), "float32"):
            y_all_to_all = R.call_dps_packed(
                "tvm_distx.ccl.alltoall", (x, R.shape([2, 2, 2, 0, 0]), R.shape([0, 2])),
                out_ty=R.Tensor((4, 6, 4), "float32"))
            y_all_gather = R.call_dps_packed(
                "tvm_distx.ccl.allgather",
                (y_all_to_all, R.shape([2, 2, 2, 0, 1]), R.shape([1])),
                out_ty=R.Tensor((4, 12, 4), "float32"))
            return y_all_gather


class SwapAxes:
    """No sequence of collectives reaches the bound: one point-to-point exchange."""

    @I.ir_module
    class Before:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2, 2), I.Range(0, 4))]})

        @R.function
        def main(x: R.dist.DTensor((8, 12, 4), "float32", "mesh[0]", "S[0]S[1]")
                 ) -> R.dist.DTensor((8, 12, 4), "float32", "mesh[0]", "S[1]S[0]"):
            y = R.dist.redistribute(x, device_mesh="mesh[0]", placement="S[1]S[0]")
            return y

    @I.ir_module
    class Expected:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2, 2), I.Range(0, 4))]})

        @R.function
        def main(x: R.Tensor((4, 6, 4), "float32")) -> R.Tensor((4, 6, 4), "float32"):
            # spec: shape (8, 12, 4); from mesh (2, 2)@0 "S[0]S[1]" to mesh (2, 2)@0 "S[1]S[0]"
            y_send_recv = R.call_dps_packed(
                "tvm_distx.ccl.send_recv",
                (x, R.shape([3, 8, 12, 4, 2, 2, 2, 0, 0, 1, 2, 2, 2, 0, 1, 0])),
                out_ty=R.Tensor((4, 6, 4), "float32"))
            return y_send_recv


class NestedSplit:
    """Dimension 0 split by both mesh axes: two slices, the outer (axis 0) first."""

    @I.ir_module
    class Before:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2, 2), I.Range(0, 4))]})

        @R.function
        def main(x: R.dist.DTensor((8, 12, 4), "float32", "mesh[0]", "RR")
                 ) -> R.dist.DTensor((8, 12, 4), "float32", "mesh[0]", "S[0]S[0]"):
            y = R.dist.redistribute(x, device_mesh="mesh[0]", placement="S[0]S[0]")
            return y

    @I.ir_module
    class Expected:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2, 2), I.Range(0, 4))]})

        @R.function
        def main(x: R.Tensor((8, 12, 4), "float32")) -> R.Tensor((2, 12, 4), "float32"):
            y_local_slice = R.call_dps_packed(
                "tvm_distx.ccl.local_slice", (x, R.shape([2, 2, 2, 0, 0]), R.shape([0])),
                out_ty=R.Tensor((4, 12, 4), "float32"))
            y_local_slice1 = R.call_dps_packed(
                "tvm_distx.ccl.local_slice",
                (y_local_slice, R.shape([2, 2, 2, 0, 1]), R.shape([0])),
                out_ty=R.Tensor((2, 12, 4), "float32"))
            return y_local_slice1


# ------------------------------------------------------------------ between meshes
class DisjointStages:
    """Stage 0 on devices 0-1 sends, stage 1 on devices 2-3 receives: one program each."""

    @I.ir_module
    class Before:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2)),
                                        R.dist.device_mesh((2,), I.Range(2, 4))]})

        @R.function
        def main(x: R.dist.DTensor((8, 12, 4), "float32", "mesh[0]", "S[0]")
                 ) -> R.dist.DTensor((8, 12, 4), "float32", "mesh[1]", "S[1]"):
            y = R.dist.redistribute(x, device_mesh="mesh[1]", placement="S[1]")
            return y

    @I.ir_module
    class Expected:
        I.module_attrs({"tvm_distx.rank_entries": {
            "main": ["main_rank0", "main_rank0", "main_rank2", "main_rank2"]}})
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2)),
                                        R.dist.device_mesh((2,), I.Range(2, 4))]})

        @R.function(pure=False)
        def main_rank0(x: R.Tensor((4, 12, 4), "float32")) -> R.Tuple:
            # spec: shape (8, 12, 4); from mesh (2,)@0 "S[0]" to mesh (2,)@2 "S[1]"
            y_send = R.call_packed("tvm_distx.ccl.send", x,
                                   R.shape([3, 8, 12, 4, 1, 2, 0, 0, 1, 2, 2, 1]),
                                   ty_args=(R.Any,))
            return R.tuple()

        @R.function
        def main_rank2() -> R.Tensor((8, 6, 4), "float32"):
            y_recv = R.call_dps_packed(
                "tvm_distx.ccl.recv", (R.shape([3, 8, 12, 4, 1, 2, 0, 0, 1, 2, 2, 1]),),
                out_ty=R.Tensor((8, 6, 4), "float32"))
            return y_recv


class OverlappingMeshes:
    """Devices 0-1 are in both meshes (send and receive), devices 2-3 only receive."""

    @I.ir_module
    class Before:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2)),
                                        R.dist.device_mesh((4,), I.Range(0, 4))]})

        @R.function
        def main(x: R.dist.DTensor((8, 12, 4), "float32", "mesh[0]", "R")
                 ) -> R.dist.DTensor((8, 12, 4), "float32", "mesh[1]", "S[0]"):
            y = R.dist.redistribute(x, device_mesh="mesh[1]", placement="S[0]")
            return y

    @I.ir_module
    class Expected:
        I.module_attrs({"tvm_distx.rank_entries": {
            "main": ["main_rank0", "main_rank0", "main_rank2", "main_rank2"]}})
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2)),
                                        R.dist.device_mesh((4,), I.Range(0, 4))]})

        @R.function
        def main_rank0(x: R.Tensor((8, 12, 4), "float32")) -> R.Tensor((2, 12, 4), "float32"):
            y_send_recv = R.call_dps_packed(
                "tvm_distx.ccl.send_recv",
                (x, R.shape([3, 8, 12, 4, 1, 2, 0, -1, 1, 4, 0, 0])),
                out_ty=R.Tensor((2, 12, 4), "float32"))
            return y_send_recv

        @R.function
        def main_rank2() -> R.Tensor((2, 12, 4), "float32"):
            y_recv = R.call_dps_packed(
                "tvm_distx.ccl.recv", (R.shape([3, 8, 12, 4, 1, 2, 0, -1, 1, 4, 0, 0]),),
                out_ty=R.Tensor((2, 12, 4), "float32"))
            return y_recv


CASES = [GatherOn1D, SliceOn1D, AllToAllOn1D, SliceAlongSecondAxis, GatherAlongSecondAxis,
         AllToAllThenGather, SwapAxes, NestedSplit, DisjointStages, OverlappingMeshes]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_lowered_ir_of_each_transition(case):
    tvm.ir.assert_structural_equal(lowered(case.Before), case.Expected)
