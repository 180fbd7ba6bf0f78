"""LowerDistIR alone, in TVM's form: a DTensor module in, the rank-local module out.

Each Before is a module after the local view and LegalizeRedistribute
(``call_tir_local_view`` on kernels with local buffers, TVM's
``R.ccl.allreduce``, collective calls typed with DTensors); each Expected is
written by hand: every parameter and value with the local shape one rank
holds, the kernels called with ``R.call_tir``, and every collective a
``tvm_distx.ccl.*`` call whose group is ``(mesh ndim, *mesh shape, first
device, *mesh axes)``.
"""

from __future__ import annotations

import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tvm_distx.errors import UnsupportedProgramError
from tvm_distx.legalize import LowerDistIR


def dist_packed(func: str, args, out_ty) -> relax.Call:
    """``R.call_dps_packed(func, args, out_ty)`` with a DTensor ``out_ty`` (as LegalizeRedistribute writes)."""
    return relax.Call(tvm.ir.Op.get("relax.call_dps_packed"),
                      [relax.ExternFunc(func), relax.Tuple(list(args))], ty_args=[out_ty])


# ------------------------------------------------------------------ kernels
def test_a_kernel_on_split_rows_takes_and_returns_the_local_rows():
    """S[0] on a mesh of 2: (8, 4) parameters become (4, 4), call_tir_local_view call_tir."""

    @I.ir_module
    class Before:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @T.prim_func(private=True, s_tir=True)
        def relu(x: T.Buffer((T.int64(4), T.int64(4)), "float32"),
                 y: T.Buffer((T.int64(4), T.int64(4)), "float32")):
            for i, j in T.grid(T.int64(4), T.int64(4)):
                with T.sblock("relu"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    y[vi, vj] = T.max(x[vi, vj], T.float32(0.0))

        @R.function
        def main(x: R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]")
                 ) -> R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]"):
            cls = Before
            with R.dataflow():
                y = R.dist.call_tir_local_view(
                    cls.relu, (x,), out_ty=R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]"))
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @T.prim_func(private=True, s_tir=True)
        def relu(x: T.Buffer((T.int64(4), T.int64(4)), "float32"),
                 y: T.Buffer((T.int64(4), T.int64(4)), "float32")):
            for i, j in T.grid(T.int64(4), T.int64(4)):
                with T.sblock("relu"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    y[vi, vj] = T.max(x[vi, vj], T.float32(0.0))

        @R.function
        def main(x: R.Tensor((4, 4), "float32")) -> R.Tensor((4, 4), "float32"):
            cls = Expected
            with R.dataflow():
                y = R.call_tir(cls.relu, (x,), out_ty=R.Tensor((4, 4), "float32"))
                R.output(y)
            return y

    tvm.ir.assert_structural_equal(LowerDistIR()(Before), Expected)


def test_tvms_allreduce_after_a_split_sum_becomes_ours_over_mesh_axis_0():
    """R.ccl.allreduce after a row-parallel product on 1-D: tvm_distx.ccl.allreduce, sum."""

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
                 w: R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]")
                 ) -> R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"):
            cls = Before
            addend = R.dist.call_tir_local_view(
                cls.matmul, (x, w), out_ty=R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"))
            y = R.ccl.allreduce(addend, op_type="sum", in_group=False)
            return y

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
        def main(x: R.Tensor((4, 4), "float32"), w: R.Tensor((4, 8), "float32")
                 ) -> R.Tensor((4, 8), "float32"):
            cls = Expected
            addend = R.call_tir(cls.matmul, (x, w), out_ty=R.Tensor((4, 8), "float32"))
            y = R.call_dps_packed("tvm_distx.ccl.allreduce",
                                  (addend, R.prim_value(0), R.shape([1, 2, 0, 0])),
                                  out_ty=R.Tensor((4, 8), "float32"))
            return y

    tvm.ir.assert_structural_equal(LowerDistIR()(Before), Expected)


def test_2d_mesh_an_allreduce_runs_over_the_mesh_axis_that_split_the_sum_only():
    """2x2 mesh, rows on axis 0 and the sum on axis 1: the group is mesh axis 1, not all 4."""

    @I.ir_module
    class Before:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2, 2), I.Range(0, 4))]})

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
        def main(x: R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]S[1]"),
                 w: R.dist.DTensor((8, 8), "float32", "mesh[0]", "RS[0]")):
            cls = Before
            addend = R.dist.call_tir_local_view(
                cls.matmul, (x, w),
                out_ty=R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]R"))
            y = R.ccl.allreduce(addend, op_type="sum", in_group=False)
            return y

    @I.ir_module
    class Expected:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2, 2), I.Range(0, 4))]})

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
        def main(x: R.Tensor((4, 4), "float32"), w: R.Tensor((4, 8), "float32")
                 ) -> R.Tensor((4, 8), "float32"):
            cls = Expected
            addend = R.call_tir(cls.matmul, (x, w), out_ty=R.Tensor((4, 8), "float32"))
            # (ndim 2, shape 2x2, first device 0, axis 1): devices {0, 1} and {2, 3}
            y = R.call_dps_packed("tvm_distx.ccl.allreduce",
                                  (addend, R.prim_value(0), R.shape([2, 2, 2, 0, 1])),
                                  out_ty=R.Tensor((4, 8), "float32"))
            return y

    tvm.ir.assert_structural_equal(LowerDistIR()(Before), Expected)


# ------------------------------------------------------------------ collectives
def test_a_planned_collective_gets_its_local_result_type():
    """The all-gather LegalizeRedistribute writes, typed (8, 4) "R": (4, 4) in, (8, 4) out."""

    @I.ir_module
    class Before:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @R.function
        def main(x: R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]")
                 ) -> R.dist.DTensor((8, 4), "float32", "mesh[0]", "R"):
            y = dist_packed("tvm_distx.ccl.allgather", (x, R.shape([1, 2, 0, 0]), R.shape([0])),
                            out_ty=R.dist.DTensor((8, 4), "float32", "mesh[0]", "R"))
            return y

    @I.ir_module
    class Expected:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @R.function
        def main(x: R.Tensor((4, 4), "float32")) -> R.Tensor((8, 4), "float32"):
            y = R.call_dps_packed("tvm_distx.ccl.allgather",
                                  (x, R.shape([1, 2, 0, 0]), R.shape([0])),
                                  out_ty=R.Tensor((8, 4), "float32"))
            return y

    tvm.ir.assert_structural_equal(LowerDistIR()(Before), Expected)


def test_tvms_replica_to_shard_becomes_our_local_slice():
    """TVM's redistribute_replica_to_shard (R -> S[1] on 2): a local slice of dim 1."""

    @I.ir_module
    class Before:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @R.function
        def main(x: R.dist.DTensor((8, 4), "float32", "mesh[0]", "R")
                 ) -> R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[1]"):
            y = R.dist.redistribute_replica_to_shard(x, num_workers=2, axis=1)
            return y

    @I.ir_module
    class Expected:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @R.function
        def main(x: R.Tensor((8, 4), "float32")) -> R.Tensor((8, 2), "float32"):
            y = R.call_dps_packed("tvm_distx.ccl.local_slice",
                                  (x, R.shape([1, 2, 0, 0]), R.shape([1])),
                                  out_ty=R.Tensor((8, 2), "float32"))
            return y

    tvm.ir.assert_structural_equal(LowerDistIR()(Before), Expected)


def test_tuples_and_their_fields_get_local_types():
    """A tuple of a split and a replicated tensor, and a field of it: each field is local."""

    @I.ir_module
    class Before:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @R.function
        def main(x: R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]"),
                 w: R.dist.DTensor((8, 4), "float32", "mesh[0]", "R")):
            pair = (x, w)
            first = pair[0]
            return (first, w)

    @I.ir_module
    class Expected:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @R.function
        def main(x: R.Tensor((4, 4), "float32"), w: R.Tensor((8, 4), "float32")
                 ) -> R.Tuple(R.Tensor((4, 4), "float32"), R.Tensor((8, 4), "float32")):
            pair = (x, w)
            first = pair[0]
            return (first, w)

    tvm.ir.assert_structural_equal(LowerDistIR()(Before), Expected)


# ------------------------------------------------------------------ calls between functions
def test_a_call_of_another_distributed_function_is_lowered_on_both_sides():
    """main passes its row block to a private function on DTensors: both take (4, 4)."""

    @I.ir_module
    class Before:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @R.function(private=True)
        def gathered(x: R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]")
                     ) -> R.dist.DTensor((8, 4), "float32", "mesh[0]", "R"):
            y = dist_packed("tvm_distx.ccl.allgather", (x, R.shape([1, 2, 0, 0]), R.shape([0])),
                            out_ty=R.dist.DTensor((8, 4), "float32", "mesh[0]", "R"))
            return y

        @R.function
        def main(x: R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]")
                 ) -> R.dist.DTensor((8, 4), "float32", "mesh[0]", "R"):
            cls = Before
            y = cls.gathered(x)
            return y

    @I.ir_module
    class Expected:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @R.function(private=True)
        def gathered(x: R.Tensor((4, 4), "float32")) -> R.Tensor((8, 4), "float32"):
            y = R.call_dps_packed("tvm_distx.ccl.allgather",
                                  (x, R.shape([1, 2, 0, 0]), R.shape([0])),
                                  out_ty=R.Tensor((8, 4), "float32"))
            return y

        @R.function
        def main(x: R.Tensor((4, 4), "float32")) -> R.Tensor((8, 4), "float32"):
            cls = Expected
            y: R.Tensor((8, 4), "float32") = cls.gathered(x)
            return y

    tvm.ir.assert_structural_equal(LowerDistIR()(Before), Expected)


# ------------------------------------------------------------------ pipeline stages
def test_a_function_spanning_two_meshes_gets_one_version_per_stage():
    """A send/recv from mesh (2,)@0 to (2,)@2: devices 0-1 send, 2-3 receive, entries say so."""

    @I.ir_module
    class Before:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2)),
                                        R.dist.device_mesh((2,), I.Range(2, 4))]})

        @R.function
        def main(x: R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]")
                 ) -> R.dist.DTensor((8, 4), "float32", "mesh[1]", "R"):
            y = dist_packed("tvm_distx.ccl.send_recv",
                            (x, R.shape([2, 8, 4, 1, 2, 0, 0, 1, 2, 2, -1])),
                            out_ty=R.dist.DTensor((8, 4), "float32", "mesh[1]", "R"))
            return y

    @I.ir_module
    class Expected:
        I.module_attrs({"tvm_distx.rank_entries": {
            "main": ["main_rank0", "main_rank0", "main_rank2", "main_rank2"]}})
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2)),
                                        R.dist.device_mesh((2,), I.Range(2, 4))]})

        @R.function(pure=False)
        def main_rank0(x: R.Tensor((4, 4), "float32")) -> R.Tuple:
            y_send = R.call_packed("tvm_distx.ccl.send", x,
                                   R.shape([2, 8, 4, 1, 2, 0, 0, 1, 2, 2, -1]),
                                   ty_args=(R.Any,))
            return R.tuple()

        @R.function
        def main_rank2() -> R.Tensor((8, 4), "float32"):
            y_recv = R.call_dps_packed("tvm_distx.ccl.recv",
                                       (R.shape([2, 8, 4, 1, 2, 0, 0, 1, 2, 2, -1]),),
                                       out_ty=R.Tensor((8, 4), "float32"))
            return y_recv

    tvm.ir.assert_structural_equal(LowerDistIR()(Before), Expected)


# ------------------------------------------------------------------ split symbolic extents
def test_a_split_symbolic_extent_is_local_and_its_extents_parameter_dropped():
    """Rows 2 * n_local split in 2: each rank holds n_local rows; the helper parameter goes."""

    @I.ir_module
    class Before:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @R.function
        def main(x: R.dist.DTensor(("n_local * 2", 4), "float32", "mesh[0]", "S[0]"),
                 tvm_distx_local_extents: R.Shape(["n_local"])
                 ) -> R.dist.DTensor(("n_local * 2", 4), "float32", "mesh[0]", "R"):
            n_local = T.int64()
            y = dist_packed("tvm_distx.ccl.allgather", (x, R.shape([1, 2, 0, 0]), R.shape([0])),
                            out_ty=R.dist.DTensor((n_local * 2, 4), "float32", "mesh[0]", "R"))
            return y

    @I.ir_module
    class Expected:
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @R.function
        def main(x: R.Tensor(("n_local", 4), "float32")
                 ) -> R.Tensor(("n_local * 2", 4), "float32"):
            n_local = T.int64()
            y = R.call_dps_packed("tvm_distx.ccl.allgather",
                                  (x, R.shape([1, 2, 0, 0]), R.shape([0])),
                                  out_ty=R.Tensor((n_local * 2, 4), "float32"))
            return y

    tvm.ir.assert_structural_equal(LowerDistIR()(Before), Expected)


# ------------------------------------------------------------------ refused
@I.ir_module
class Unlegalized:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.dist.DTensor((8, 4), "float32", "mesh[0]", "S[0]")
             ) -> R.dist.DTensor((8, 4), "float32", "mesh[0]", "R"):
        y = R.dist.redistribute(x, device_mesh="mesh[0]", placement="R")
        return y


def test_a_redistribute_that_is_not_legalized_is_refused():
    """LowerDistIR lowers collectives, it does not plan them: a redistribute is an error."""
    with pytest.raises(UnsupportedProgramError, match="LegalizeRedistribute") as info:
        LowerDistIR()(Unlegalized)
    assert (info.value.function, info.value.var) == ("main", "y")
