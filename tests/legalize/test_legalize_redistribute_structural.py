"""LegalizeRedistribute alone, in TVM's form: a Before module, the Expected one, structurally.

Each Before moves a DTensor with ``R.dist.redistribute``; each Expected is the
module written by hand from what the planner must choose. The pass keeps
``R.dist.DTensor`` types (each step typed with its destination sharding) and
writes every step as a destination-passing call of a ``tvm_distx.ccl.*``
runtime function:

- a group is ``(mesh ndim, *mesh shape, first device, *mesh axes)``;
- a placement in a send/recv spec is one code per mesh axis, ``S[k]`` -> ``k``,
  ``R`` -> ``-1``;
- a reduce kind is ``sum`` -> ``0``.

``R.call_dps_packed`` in TVMScript accepts only tensor result types, so the
Expected modules write these calls with :func:`dist_packed`, the same call with
a DTensor result type.
"""

from __future__ import annotations

import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tvm_distx.errors import UnsupportedProgramError
from tvm_distx.legalize import LegalizeRedistribute


def dist_packed(func: str, args, out_ty) -> relax.Call:
    """``R.call_dps_packed(func, args, out_ty)`` with a DTensor ``out_ty``."""
    return relax.Call(tvm.ir.Op.get("relax.call_dps_packed"),
                      [relax.ExternFunc(func), relax.Tuple(list(args))], ty_args=[out_ty])


# ------------------------------------------------------------------ 1-D mesh
def test_s0_to_r_on_a_1d_mesh_becomes_one_all_gather():
    """S[0] -> R on a 1-D mesh of 2: one all-gather along tensor dim 0, over mesh axis 0."""

    @I.ir_module
    class Before:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @R.function
        def main(x: R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]")
                 ) -> R.dist.DTensor((8, 4), "float32", "mesh[0]", "R"):
            y = R.dist.redistribute(x, device_mesh="mesh[0]", placement="R")
            return y

    @I.ir_module
    class Expected:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @R.function
        def main(x: R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]")
                 ) -> R.dist.DTensor((8, 4), "float32", "mesh[0]", "R"):
            y = dist_packed("tvm_distx.ccl.allgather", (x, R.shape([1, 2, 0, 0]), R.shape([0])),
                            out_ty=R.dist.DTensor((8, 4), "float32", "mesh[0]", "R"))
            return y

    tvm.ir.assert_structural_equal(LegalizeRedistribute()(Before), Expected)


def test_r_to_s1_becomes_one_local_slice():
    """R -> S[1]: every rank keeps its column block of its own copy, no traffic."""

    @I.ir_module
    class Before:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @R.function
        def main(x: R.dist.DTensor((8, 4), "float32", "mesh[0]", "R")
                 ) -> R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[1]"):
            y = R.dist.redistribute(x, device_mesh="mesh[0]", placement="S[1]")
            return y

    @I.ir_module
    class Expected:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @R.function
        def main(x: R.dist.DTensor((8, 4), "float32", "mesh[0]", "R")
                 ) -> R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[1]"):
            y = dist_packed("tvm_distx.ccl.local_slice",
                            (x, R.shape([1, 2, 0, 0]), R.shape([1])),
                            out_ty=R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[1]"))
            return y

    tvm.ir.assert_structural_equal(LegalizeRedistribute()(Before), Expected)


def test_s0_to_s1_becomes_an_all_to_all():
    """S[0] -> S[1] on a mesh of 4: one all-to-all, split along dim 1, concatenated along 0."""

    @I.ir_module
    class Before:
        I.module_global_infos({"mesh": [R.dist.device_mesh((4,), I.Range(0, 4))]})

        @R.function
        def main(x: R.dist.DTensor((8, 12), "float32", "mesh[0]", "S[0]")
                 ) -> R.dist.DTensor((8, 12), "float32", "mesh[0]", "S[1]"):
            y = R.dist.redistribute(x, device_mesh="mesh[0]", placement="S[1]")
            return y

    @I.ir_module
    class Expected:
        I.module_global_infos({"mesh": [R.dist.device_mesh((4,), I.Range(0, 4))]})

        @R.function
        def main(x: R.dist.DTensor((8, 12), "float32", "mesh[0]", "S[0]")
                 ) -> R.dist.DTensor((8, 12), "float32", "mesh[0]", "S[1]"):
            y = dist_packed("tvm_distx.ccl.alltoall",
                            (x, R.shape([1, 4, 0, 0]), R.shape([1, 0])),
                            out_ty=R.dist.DTensor((8, 12), "float32", "mesh[0]", "S[1]"))
            return y

    tvm.ir.assert_structural_equal(LegalizeRedistribute()(Before), Expected)


def test_a_redistribute_to_the_same_sharding_disappears():
    """S[0] -> S[0]: nothing moves, the redistribute's result is its operand."""

    @I.ir_module
    class Before:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @R.function
        def main(x: R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]")
                 ) -> R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]"):
            y = R.dist.redistribute(x, device_mesh="mesh[0]", placement="S[0]")
            return y

    @I.ir_module
    class Expected:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @R.function
        def main(x: R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]")
                 ) -> R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]"):
            return x

    tvm.ir.assert_structural_equal(LegalizeRedistribute()(Before), Expected)


def test_a_move_inside_a_dataflow_block_keeps_its_output_variable():
    """The gather is a dataflow value; the block's output ``y`` stays bound to it."""

    @I.ir_module
    class Before:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @R.function
        def main(x: R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]")
                 ) -> R.dist.DTensor((8, 4), "float32", "mesh[0]", "R"):
            with R.dataflow():
                y = R.dist.redistribute(x, device_mesh="mesh[0]", placement="R")
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @R.function
        def main(x: R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]")
                 ) -> R.dist.DTensor((8, 4), "float32", "mesh[0]", "R"):
            with R.dataflow():
                gathered = dist_packed(
                    "tvm_distx.ccl.allgather", (x, R.shape([1, 2, 0, 0]), R.shape([0])),
                    out_ty=R.dist.DTensor((8, 4), "float32", "mesh[0]", "R"))
                y = gathered
                R.output(y)
            return y

    tvm.ir.assert_structural_equal(LegalizeRedistribute()(Before), Expected)


def test_tvm_forms_write_a_local_slice_as_tvms_replica_to_shard():
    """With ``tvm_forms=True``, R -> S[0] on a mesh of all devices is TVM's own op."""

    @I.ir_module
    class Before:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @R.function
        def main(x: R.dist.DTensor((8, 4), "float32", "mesh[0]", "R")
                 ) -> R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]"):
            y = R.dist.redistribute(x, device_mesh="mesh[0]", placement="S[0]")
            return y

    @I.ir_module
    class Expected:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @R.function
        def main(x: R.dist.DTensor((8, 4), "float32", "mesh[0]", "R")
                 ) -> R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]"):
            y = R.dist.redistribute_replica_to_shard(x, num_workers=2, axis=0)
            return y

    tvm.ir.assert_structural_equal(LegalizeRedistribute(tvm_forms=True)(Before), Expected)


# ------------------------------------------------------------------ partial sums
@I.ir_module
class PartialSumThenRows:
    """x columns and w rows split: each rank's product is an addend; the result wants rows."""

    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @T.prim_func(private=True, s_tir=True)
    def matmul(a: T.Buffer((T.int64(4), T.int64(4)), "float32"),
               b: T.Buffer((T.int64(4), T.int64(8)), "float32"),
               c: T.Buffer((T.int64(4), T.int64(8)), "float32")):
        for i, j, k in T.grid(T.int64(4), T.int64(8), T.int64(4)):
            with T.sblock("matmul"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                with T.init():
                    c[vi, vj] = T.float32(0.0)
                c[vi, vj] = c[vi, vj] + a[vi, vk] * b[vk, vj]

    @R.function
    def main(x: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[1]"),
             w: R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]")
             ) -> R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[0]"):
        cls = PartialSumThenRows
        addend = R.dist.call_tir_local_view(
            cls.matmul, (x, w), out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"))
        total = R.ccl.allreduce(addend, op_type="sum", in_group=False)
        y = R.dist.redistribute(total, device_mesh="mesh[0]", placement="S[0]")
        return y


def test_partial_sum_to_s0_becomes_one_reduce_scatter():
    """partial sum -> S[0]: the all-reduce and the slice after it are one reduce-scatter."""

    @I.ir_module
    class Expected:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @T.prim_func(private=True, s_tir=True)
        def matmul(a: T.Buffer((T.int64(4), T.int64(4)), "float32"),
                   b: T.Buffer((T.int64(4), T.int64(8)), "float32"),
                   c: T.Buffer((T.int64(4), T.int64(8)), "float32")):
            for i, j, k in T.grid(T.int64(4), T.int64(8), T.int64(4)):
                with T.sblock("matmul"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    with T.init():
                        c[vi, vj] = T.float32(0.0)
                    c[vi, vj] = c[vi, vj] + a[vi, vk] * b[vk, vj]

        @R.function
        def main(x: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[1]"),
                 w: R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]")
                 ) -> R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[0]"):
            cls = Expected
            addend = R.dist.call_tir_local_view(
                cls.matmul, (x, w), out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"))
            # no all-reduce: kind sum, the group of mesh axis 0, rows (dim 0) scattered
            y = dist_packed("tvm_distx.ccl.reducescatter",
                            (addend, R.prim_value(0), R.shape([1, 2, 0, 0]), R.shape([0])),
                            out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[0]"))
            return y

    tvm.ir.assert_structural_equal(LegalizeRedistribute()(PartialSumThenRows), Expected)


# ------------------------------------------------------------------ 2-D mesh
def test_2d_mesh_gathers_along_the_second_mesh_axis_only():
    """RS[1] -> RR on a 2x2 mesh: the all-gather's group is mesh axis 1."""

    @I.ir_module
    class Before:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2, 2), I.Range(0, 4))]})

        @R.function
        def main(x: R.dist.DTensor((8, 4), "float32", "mesh[0]", "RS[1]")
                 ) -> R.dist.DTensor((8, 4), "float32", "mesh[0]", "RR"):
            y = R.dist.redistribute(x, device_mesh="mesh[0]", placement="RR")
            return y

    @I.ir_module
    class Expected:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2, 2), I.Range(0, 4))]})

        @R.function
        def main(x: R.dist.DTensor((8, 4), "float32", "mesh[0]", "RS[1]")
                 ) -> R.dist.DTensor((8, 4), "float32", "mesh[0]", "RR"):
            y = dist_packed("tvm_distx.ccl.allgather",
                            (x, R.shape([2, 2, 2, 0, 1]), R.shape([1])),
                            out_ty=R.dist.DTensor((8, 4), "float32", "mesh[0]", "RR"))
            return y

    tvm.ir.assert_structural_equal(LegalizeRedistribute()(Before), Expected)


def test_2d_mesh_both_axes_change_an_all_to_all_then_a_gather():
    """S[2]S[1] -> S[0]R on 2x2: all-to-all on axis 0 (2 -> 0), then gather dim 1 on axis 1."""

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
        def main(x: R.dist.DTensor((8, 12, 4), "float32", "mesh[0]", "S[2]S[1]")
                 ) -> R.dist.DTensor((8, 12, 4), "float32", "mesh[0]", "S[0]R"):
            # the intermediate value never passes through a replicated layout
            rows = dist_packed("tvm_distx.ccl.alltoall",
                               (x, R.shape([2, 2, 2, 0, 0]), R.shape([0, 2])),
                               out_ty=R.dist.DTensor((8, 12, 4), "float32", "mesh[0]", "S[0]S[1]"))
            y = dist_packed("tvm_distx.ccl.allgather",
                            (rows, R.shape([2, 2, 2, 0, 1]), R.shape([1])),
                            out_ty=R.dist.DTensor((8, 12, 4), "float32", "mesh[0]", "S[0]R"))
            return y

    tvm.ir.assert_structural_equal(LegalizeRedistribute()(Before), Expected)


def test_2d_mesh_a_nested_split_is_two_local_slices_outer_axis_first():
    """RR -> S[0]S[0] on 2x2: slice rows along mesh axis 0, then again along axis 1."""

    @I.ir_module
    class Before:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2, 2), I.Range(0, 4))]})

        @R.function
        def main(x: R.dist.DTensor((8, 4), "float32", "mesh[0]", "RR")
                 ) -> R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]S[0]"):
            y = R.dist.redistribute(x, device_mesh="mesh[0]", placement="S[0]S[0]")
            return y

    @I.ir_module
    class Expected:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2, 2), I.Range(0, 4))]})

        @R.function
        def main(x: R.dist.DTensor((8, 4), "float32", "mesh[0]", "RR")
                 ) -> R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]S[0]"):
            half = dist_packed("tvm_distx.ccl.local_slice",
                               (x, R.shape([2, 2, 2, 0, 0]), R.shape([0])),
                               out_ty=R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]R"))
            y = dist_packed("tvm_distx.ccl.local_slice",
                            (half, R.shape([2, 2, 2, 0, 1]), R.shape([0])),
                            out_ty=R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]S[0]"))
            return y

    tvm.ir.assert_structural_equal(LegalizeRedistribute()(Before), Expected)


# ------------------------------------------------------------------ between meshes
def test_a_move_between_two_meshes_is_one_send_recv():
    """S[0] on devices 0-1 -> S[1] on devices 2-3: one send/recv whose spec names both."""

    @I.ir_module
    class Before:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2)),
                                        R.dist.device_mesh((2,), I.Range(2, 4))]})

        @R.function
        def main(x: R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]")
                 ) -> R.dist.DTensor((8, 4), "float32", "mesh[1]", "S[1]"):
            y = R.dist.redistribute(x, device_mesh="mesh[1]", placement="S[1]")
            return y

    @I.ir_module
    class Expected:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2)),
                                        R.dist.device_mesh((2,), I.Range(2, 4))]})

        @R.function
        def main(x: R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]")
                 ) -> R.dist.DTensor((8, 4), "float32", "mesh[1]", "S[1]"):
            # shape (8, 4); from mesh (2,)@0 "S[0]"; to mesh (2,)@2 "S[1]"
            y = dist_packed("tvm_distx.ccl.send_recv",
                            (x, R.shape([2, 8, 4, 1, 2, 0, 0, 1, 2, 2, 1])),
                            out_ty=R.dist.DTensor((8, 4), "float32", "mesh[1]", "S[1]"))
            return y

    tvm.ir.assert_structural_equal(LegalizeRedistribute()(Before), Expected)


# ------------------------------------------------------------------ symbolic extents
def test_a_symbolic_extent_is_kept_while_a_static_dimension_is_sliced():
    """R -> S[1] of an (n, 4) tensor: the local slice cuts the static dim, n stays symbolic."""

    @I.ir_module
    class Before:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @R.function
        def main(x: R.dist.DTensor(("n", 4), "float32", "mesh[0]", "R")
                 ) -> R.dist.DTensor(("n", 4), "float32", "mesh[0]", "S[1]"):
            n = T.int64()
            y = R.dist.redistribute(x, device_mesh="mesh[0]", placement="S[1]")
            return y

    @I.ir_module
    class Expected:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @R.function
        def main(x: R.dist.DTensor(("n", 4), "float32", "mesh[0]", "R")
                 ) -> R.dist.DTensor(("n", 4), "float32", "mesh[0]", "S[1]"):
            n = T.int64()
            y = dist_packed("tvm_distx.ccl.local_slice",
                            (x, R.shape([1, 2, 0, 0]), R.shape([1])),
                            out_ty=R.dist.DTensor((n, 4), "float32", "mesh[0]", "S[1]"))
            return y

    tvm.ir.assert_structural_equal(LegalizeRedistribute()(Before), Expected)


def test_a_split_symbolic_extent_that_always_divides_is_sliced():
    """R -> S[0] of a (2 * n, 4) tensor on 2 devices: 2 always divides 2 * n, one local slice."""

    @I.ir_module
    class Before:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @R.function
        def main(x: R.dist.DTensor(("n * 2", 4), "float32", "mesh[0]", "R"),
                 lengths: R.dist.DTensor(("n",), "int64", "mesh[0]", "R")
                 ) -> R.dist.DTensor(("n * 2", 4), "float32", "mesh[0]", "S[0]"):
            n = T.int64()
            y = R.dist.redistribute(x, device_mesh="mesh[0]", placement="S[0]")
            return y

    @I.ir_module
    class Expected:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @R.function
        def main(x: R.dist.DTensor(("n * 2", 4), "float32", "mesh[0]", "R"),
                 lengths: R.dist.DTensor(("n",), "int64", "mesh[0]", "R")
                 ) -> R.dist.DTensor(("n * 2", 4), "float32", "mesh[0]", "S[0]"):
            n = T.int64()
            y = dist_packed("tvm_distx.ccl.local_slice",
                            (x, R.shape([1, 2, 0, 0]), R.shape([0])),
                            out_ty=R.dist.DTensor((n * 2, 4), "float32", "mesh[0]", "S[0]"))
            return y

    tvm.ir.assert_structural_equal(LegalizeRedistribute()(Before), Expected)


@I.ir_module
class GatherOfSymbolicRows:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.dist.DTensor(("n", 4), "float32", "mesh[0]", "S[0]")
             ) -> R.dist.DTensor(("n", 4), "float32", "mesh[0]", "R"):
        y = R.dist.redistribute(x, device_mesh="mesh[0]", placement="R")
        return y


def test_moving_a_symbolic_extent_between_ranks_is_refused():
    """S[0] -> R of (n, 4): an all-gather of blocks of unknown size is not supported."""
    with pytest.raises(UnsupportedProgramError, match="symbolic") as info:
        LegalizeRedistribute()(GatherOfSymbolicRows)
    assert (info.value.function, info.value.var) == ("main", "y")


def test_a_completed_sum_with_another_use_keeps_its_allreduce_then_slices():
    """partial sum -> S[0], the sum also returned: the all-reduce stays, then a local slice."""

    @I.ir_module
    class Before:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @T.prim_func(private=True, s_tir=True)
        def matmul(a: T.Buffer((T.int64(4), T.int64(4)), "float32"),
                   b: T.Buffer((T.int64(4), T.int64(8)), "float32"),
                   c: T.Buffer((T.int64(4), T.int64(8)), "float32")):
            for i, j, k in T.grid(T.int64(4), T.int64(8), T.int64(4)):
                with T.sblock("matmul"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    with T.init():
                        c[vi, vj] = T.float32(0.0)
                    c[vi, vj] = c[vi, vj] + a[vi, vk] * b[vk, vj]

        @R.function
        def main(x: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[1]"),
                 w: R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]")):
            cls = Before
            addend = R.dist.call_tir_local_view(
                cls.matmul, (x, w), out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"))
            total = R.ccl.allreduce(addend, op_type="sum", in_group=False)
            y = R.dist.redistribute(total, device_mesh="mesh[0]", placement="S[0]")
            return (total, y)

    @I.ir_module
    class Expected:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @T.prim_func(private=True, s_tir=True)
        def matmul(a: T.Buffer((T.int64(4), T.int64(4)), "float32"),
                   b: T.Buffer((T.int64(4), T.int64(8)), "float32"),
                   c: T.Buffer((T.int64(4), T.int64(8)), "float32")):
            for i, j, k in T.grid(T.int64(4), T.int64(8), T.int64(4)):
                with T.sblock("matmul"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    with T.init():
                        c[vi, vj] = T.float32(0.0)
                    c[vi, vj] = c[vi, vj] + a[vi, vk] * b[vk, vj]

        @R.function
        def main(x: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[1]"),
                 w: R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]")):
            cls = Expected
            addend = R.dist.call_tir_local_view(
                cls.matmul, (x, w), out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"))
            total = R.ccl.allreduce(addend, op_type="sum", in_group=False)
            y = dist_packed("tvm_distx.ccl.local_slice",
                            (total, R.shape([1, 2, 0, 0]), R.shape([0])),
                            out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[0]"))
            return (total, y)

    tvm.ir.assert_structural_equal(LegalizeRedistribute()(Before), Expected)
