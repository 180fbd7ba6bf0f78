"""Tests of :mod:`tvm_distx.passes.tir_access`: ``call_tir`` signatures from PrimFunc access patterns.

Signatures are compared label-agnostically (:func:`signature_tools.canon`).
"""

from __future__ import annotations

from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from signature_tools import bindings, expect, operand_names, sig_of
from tvm_distx.passes import tir_access
from tvm_distx.passes.op_signatures import op_signature


# --------------------------------------------------------------------------- modules
@I.ir_module
class ToLegalize:
    @R.function
    def main(
        x: R.Tensor((4, 8), "float32"),
        w: R.Tensor((8, 16), "float32"),
        bias: R.Tensor((1, 16), "float32"),
        bx: R.Tensor((2, 4, 8), "float32"),
    ):
        with R.dataflow():
            mm = R.matmul(x, w)
            bmm = R.matmul(bx, w)
            add = R.add(mm, bias)
            red = R.sum(add, axis=[1])
            mean = R.mean(add, axis=[1])
            mx = R.max(add, axis=[1])
            var = R.variance(add, axis=[1])
            relu = R.nn.relu(add)
            sm = R.nn.softmax(add, axis=1)
            tr = R.permute_dims(add)
            heads = R.reshape(mm, R.shape([4, 4, 4]))
            merged = R.reshape(bx, R.shape([8, 8]))
            R.output(mm, bmm, add, red, mean, mx, var, relu, sm, tr, heads, merged)
        return mm


LEGALIZED = relax.transform.LegalizeOps()(ToLegalize)


@I.ir_module
class HandWritten:
    @T.prim_func(private=True, s_tir=True)
    def shift(A: T.Buffer((T.int64(9),), "float32"), B: T.Buffer((T.int64(8),), "float32")):
        for i in T.serial(T.int64(8)):
            with T.sblock("shift"):
                vi = T.axis.spatial(T.int64(8), i)
                B[vi] = A[vi + T.int64(1)]

    @T.prim_func(private=True, s_tir=True)
    def row_shift(A: T.Buffer((T.int64(4), T.int64(9)), "float32"),
                  B: T.Buffer((T.int64(4), T.int64(8)), "float32")):
        for i, j in T.grid(T.int64(4), T.int64(8)):
            with T.sblock("row_shift"):
                vi, vj = T.axis.remap("SS", [i, j])
                B[vi, vj] = A[vi, vj + T.int64(1)]

    @T.prim_func(private=True, s_tir=True)
    def head(A: T.Buffer((T.int64(16),), "float32"), B: T.Buffer((T.int64(8),), "float32")):
        for i in T.serial(T.int64(8)):
            with T.sblock("head"):
                vi = T.axis.spatial(T.int64(8), i)
                B[vi] = A[vi]

    @T.prim_func(private=True, s_tir=True)
    def outer(A: T.Buffer((T.int64(8),), "float32"),
              B: T.Buffer((T.int64(8), T.int64(8)), "float32")):
        for i, j in T.grid(T.int64(8), T.int64(8)):
            with T.sblock("outer"):
                vi, vj = T.axis.remap("SS", [i, j])
                B[vi, vj] = A[vi] * A[vj]

    @T.prim_func(private=True, s_tir=True)
    def norm(A: T.Buffer((T.int64(4), T.int64(8)), "float32"),
             B: T.Buffer((T.int64(4),), "float32")):
        acc = T.sblock_alloc_buffer((T.int64(4),))
        for i, k in T.grid(T.int64(4), T.int64(8)):
            with T.sblock("acc"):
                vi, vk = T.axis.remap("SR", [i, k])
                with T.init():
                    acc[vi] = T.float32(0.0)
                acc[vi] = acc[vi] + A[vi, vk] * A[vi, vk]
        for i in T.serial(T.int64(4)):
            with T.sblock("root_of"):
                vi = T.axis.spatial(T.int64(4), i)
                B[vi] = T.sqrt(acc[vi])

    @T.prim_func(private=True, s_tir=True)
    def iota(B: T.Buffer((T.int64(8),), "float32")):
        for i in T.serial(T.int64(8)):
            with T.sblock("iota"):
                vi = T.axis.spatial(T.int64(8), i)
                B[vi] = T.Cast("float32", vi)

    @T.prim_func(private=True, s_tir=True)
    def pad(A: T.Buffer((T.int64(8),), "float32"), B: T.Buffer((T.int64(10),), "float32")):
        for i in T.serial(T.int64(10)):
            with T.sblock("pad"):
                vi = T.axis.spatial(T.int64(10), i)
                B[vi] = T.if_then_else(
                    T.int64(1) <= vi and vi < T.int64(9), A[vi - T.int64(1)], T.float32(0)
                )

    @T.prim_func(private=True, s_tir=True)
    def opaque(A: T.Buffer((T.int64(8),), "float32"), B: T.Buffer((T.int64(8),), "float32")):
        for i in T.serial(T.int64(8)):
            with T.sblock("copy"):
                vi = T.axis.spatial(T.int64(8), i)
                B[vi] = A[vi]
        with T.sblock("ext"):
            T.reads(A[0:8])
            T.writes()
            T.evaluate(T.call_extern("int32", "touch", A.data))

    @T.prim_func(private=True, s_tir=True)
    def upsample(A: T.Buffer((T.int64(4),), "float32"), B: T.Buffer((T.int64(8),), "float32")):
        for i in T.serial(T.int64(8)):
            with T.sblock("upsample"):
                vi = T.axis.spatial(T.int64(8), i)
                B[vi] = A[vi // T.int64(2)]

    @T.prim_func(private=True, s_tir=True)
    def tile(A: T.Buffer((T.int64(4),), "float32"), B: T.Buffer((T.int64(8),), "float32")):
        for i in T.serial(T.int64(8)):
            with T.sblock("tile"):
                vi = T.axis.spatial(T.int64(8), i)
                B[vi] = A[vi % T.int64(4)]

    @T.prim_func(private=True, s_tir=True)
    def strided(A: T.Buffer((T.int64(16),), "float32"), B: T.Buffer((T.int64(8),), "float32")):
        for i in T.serial(T.int64(8)):
            with T.sblock("strided"):
                vi = T.axis.spatial(T.int64(8), i)
                B[vi] = A[vi * T.int64(2)]

    @R.function
    def main(a: R.Tensor((9,), "float32"), m: R.Tensor((4, 9), "float32"),
             h: R.Tensor((16,), "float32"), v: R.Tensor((8,), "float32"),
             x: R.Tensor((4, 8), "float32"), q4: R.Tensor((4,), "float32")):
        cls = HandWritten
        with R.dataflow():
            s = R.call_tir(cls.shift, (a,), out_ty=R.Tensor((8,), "float32"))
            rs = R.call_tir(cls.row_shift, (m,), out_ty=R.Tensor((4, 8), "float32"))
            hd = R.call_tir(cls.head, (h,), out_ty=R.Tensor((8,), "float32"))
            op = R.call_tir(cls.outer, (v,), out_ty=R.Tensor((8, 8), "float32"))
            nr = R.call_tir(cls.norm, (x,), out_ty=R.Tensor((4,), "float32"))
            io = R.call_tir(cls.iota, (), out_ty=R.Tensor((8,), "float32"))
            pd = R.call_tir(cls.pad, (v,), out_ty=R.Tensor((10,), "float32"))
            ex = R.call_tir(cls.opaque, (v,), out_ty=R.Tensor((8,), "float32"))
            up = R.call_tir(cls.upsample, (q4,), out_ty=R.Tensor((8,), "float32"))
            tl = R.call_tir(cls.tile, (q4,), out_ty=R.Tensor((8,), "float32"))
            sd = R.call_tir(cls.strided, (h,), out_ty=R.Tensor((8,), "float32"))
            R.output(s, rs, hd, op, nr, io, pd, ex, up, tl, sd)
        return s


@I.ir_module
class SymbolicReshapes:
    @R.function
    def main(x: R.Tensor((4, "n", 8), "float32"), y: R.Tensor(("4 * n", 8), "float32"),
             z: R.Tensor(("n", 8), "float32")):
        n = T.int64()
        with R.dataflow():
            merged = R.reshape(x, R.shape([4 * n, 8]))
            experts = R.reshape(y, R.shape([4, n, 8]))
            rows = R.reshape(z, R.shape([n * 8]))
            tiled = R.tile(z, [4, 1])
            R.output(merged, experts, rows, tiled)
        return merged


SYMBOLIC = relax.transform.LegalizeOps()(SymbolicReshapes)


# --------------------------------------------------------------------------- call_tir
def test_call_tir_matmul():
    sig = sig_of(LEGALIZED, "mm")
    expect(sig, ((0, 1), (1, 2)), ((0, 2),), reduction={1})
    assert operand_names(sig) == ["x", "w"]


def test_call_tir_batched_matmul():
    expect(sig_of(LEGALIZED, "bmm"), ((0, 1, 2), (2, 3)), ((0, 1, 3),), reduction={2})


def test_call_tir_add_with_broadcast():
    # bias (1, 16) is read at constant index 0 in its first dim
    expect(sig_of(LEGALIZED, "add"), ((0, 1), (2, 1)), ((0, 1),),
           unshardable={2}, reduction={2})


def test_call_tir_sum_over_axis_one():
    expect(sig_of(LEGALIZED, "red"), ((0, 1),), ((0,),), reduction={1})


def test_call_tir_mean_is_a_scaled_sum():
    # sum into an intermediate, then divide by a constant: still a partial sum
    expect(sig_of(LEGALIZED, "mean"), ((0, 1),), ((0,),), reduction={1})


def test_call_tir_max_and_variance_are_not_partial_sums():
    expect(sig_of(LEGALIZED, "mx"), ((0, 1),), ((0,),), unshardable={1}, reduction={1})
    expect(sig_of(LEGALIZED, "var"), ((0, 1),), ((0,),), unshardable={1}, reduction={1})


def test_call_tir_relu():
    expect(sig_of(LEGALIZED, "relu"), ((0, 1),), ((0, 1),))


def test_call_tir_softmax_axis_is_not_shardable():
    sig = sig_of(LEGALIZED, "sm")
    expect(sig, ((0, 1),), ((0, 1),), unshardable={1})
    assert sig.output[0][1] in sig.unshardable
    assert sig.output[0][0] not in sig.unshardable


def test_call_tir_transpose():
    expect(sig_of(LEGALIZED, "tr"), ((0, 1),), ((1, 0),))


def test_call_tir_shifted_index_is_unshardable():
    expect(sig_of(HandWritten, "s"), ((0,),), ((1,),), unshardable={0, 1}, reduction={0})
    # only the shifted dim (and the loop it uses) is pinned; rows stay shardable
    expect(sig_of(HandWritten, "rs"), ((0, 1),), ((0, 2),), unshardable={1, 2}, reduction={1})


def test_call_tir_partial_read_is_unshardable():
    # B[i] = A[i] with A longer than the loop: extents differ
    expect(sig_of(HandWritten, "hd"), ((0,),), ((0,),), unshardable={0})


def test_call_tir_one_buffer_dim_joined_to_two_output_dims():
    expect(sig_of(HandWritten, "op"), ((0,),), ((0, 1),), unshardable={0, 1})


def test_call_tir_non_linear_use_of_a_reduction():
    # sqrt(sum(x * x)): a partial sum cannot go through sqrt
    expect(sig_of(HandWritten, "nr"), ((0, 1),), ((0,),), unshardable={1}, reduction={1})


def test_call_tir_iteration_variable_used_as_a_value():
    expect(sig_of(HandWritten, "io"), (), ((0,),), unshardable={0})


def test_call_tir_signature_is_cached_per_prim_func():
    func = LEGALIZED[bindings(LEGALIZED)["mm"].args[0]]
    assert tir_access.prim_func_signature(func, 2) is tir_access.prim_func_signature(func, 2)


def test_call_tir_of_a_missing_or_non_dps_function():
    call = bindings(LEGALIZED)["mm"]
    bad = relax.Call(call.op, [call.args[0], call.args[1]], call.attrs,
                     [R.Tensor((4, 16, 1), "float32")])
    assert op_signature(bad, LEGALIZED) is None  # output rank differs from the buffer


def test_call_tir_index_under_a_condition_is_unshardable():
    expect(sig_of(HandWritten, "pd"), ((0,),), ((1,),), unshardable={0, 1}, reduction={0})


def test_call_tir_buffer_passed_to_an_extern_call_is_unshardable():
    expect(sig_of(HandWritten, "ex"), ((0,),), ((0,),), unshardable={0})


def test_call_tir_legalized_reshape_split_and_merge():
    # (4, 16) -> (4, 4, 4): index x[i, h * 4 + d]; the 16 shares with the heads
    expect(sig_of(LEGALIZED, "heads"), ((0, 1),), ((0, 1, 2),), unshardable={2})
    # (2, 4, 8) -> (8, 8): index bx[v // 4, v % 4, w]; the 2 shares with the 8
    expect(sig_of(LEGALIZED, "merged"), ((0, 1, 2),), ((0, 2),), unshardable={1}, reduction={1})


def test_call_tir_split_index_and_its_period():
    # B[v] = A[v // 2]: contiguous shards of v read contiguous shards of A
    expect(sig_of(HandWritten, "up"), ((0,),), ((0,),))
    # B[v] = A[v % 4]: a shard of v (size 8 / p) need not be a multiple of 4
    expect(sig_of(HandWritten, "tl"), ((0,),), ((1,),), unshardable={0, 1}, reduction={0})
    # B[v] = A[2 * v]: strided
    expect(sig_of(HandWritten, "sd"), ((0,),), ((1,),), unshardable={0, 1}, reduction={0})


def test_call_tir_reshape_over_a_run_time_extent():
    """A run-time extent ``n`` merged with a static one keeps the split a static reshape keeps.

    Llama 4's experts: ``(4, n, 8) -> (4 * n, 8)`` and back; the index ``v // n`` over
    ``4 * n`` is read with ``n``'s stand-in, as ``v // 8`` over 32 is.
    """
    # x[v // n, v % n, w]: the 4 shares with the 4 * n, as (2, 4, 8) -> (8, 8) above
    expect(sig_of(SYMBOLIC, "merged"), ((0, 1, 2),), ((0, 2),), unshardable={1}, reduction={1})
    # y[h * n + i, w]: the 4 * n shares with the 4
    expect(sig_of(SYMBOLIC, "experts"), ((0, 1),), ((0, 2, 1),), unshardable={2})
    # z[v // 8, v % 8]: the n shares with the n * 8
    expect(sig_of(SYMBOLIC, "rows"), ((0, 1),), ((0,),), unshardable={1}, reduction={1})
    # z[v % n, w]: a shard of v need not be a multiple of n
    expect(sig_of(SYMBOLIC, "tiled"), ((0, 1),), ((2, 1),), unshardable={0, 2}, reduction={0})
