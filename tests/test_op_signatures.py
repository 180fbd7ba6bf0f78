"""Tests of :mod:`tvm_distx.passes.op_signatures` (einsum-style operator signatures).

Signatures are compared label-agnostically: :func:`canon` renumbers labels in
order of first appearance (operands first, then outputs), so ``(4,8)x(8,16)``
matmul reads ``operands ((0, 1), (1, 2))``, ``output ((0, 2),)``.
"""

from __future__ import annotations

import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tvm_distx.passes import op_signatures as ops
from tvm_distx.passes.op_signatures import OpSignature, op_signature, register_signature


# --------------------------------------------------------------------------- helpers
def canon(sig: OpSignature) -> dict:
    """The signature with labels renumbered 0, 1, ... by first appearance."""
    assert sig is not None
    numbers: dict[str, int] = {}
    for labels in sig.labels + sig.output:
        for label in labels:
            numbers.setdefault(label, len(numbers))

    def renumber(groups):
        return tuple(tuple(numbers[label] for label in labels) for labels in groups)

    return {
        "operands": renumber(sig.labels),
        "output": renumber(sig.output),
        "unshardable": frozenset(numbers[label] for label in sig.unshardable),
        "reduction": frozenset(numbers[label] for label in sig.reduction_labels()),
    }


def expect(sig, operands, output, unshardable=(), reduction=()):
    assert canon(sig) == {
        "operands": operands,
        "output": output,
        "unshardable": frozenset(unshardable),
        "reduction": frozenset(reduction),
    }


def bindings(mod: tvm.IRModule, func: str = "main") -> dict[str, relax.Expr]:
    """Name of each bound variable of ``func`` -> its value."""
    out = {}
    for block in mod[func].body.blocks:
        for binding in block.bindings:
            out[binding.var.name] = binding.value
    return out


def sig_of(mod: tvm.IRModule, name: str) -> OpSignature | None:
    call = bindings(mod)[name]
    return op_signature(call, mod)


def operand_names(sig: OpSignature) -> list[str]:
    return [o.name for o in sig.operands]


# --------------------------------------------------------------------------- modules
@I.ir_module
class Elementwise:
    @R.function
    def main(
        x: R.Tensor((4, 8), "float32"),
        row: R.Tensor((1, 8), "float32"),
        col: R.Tensor((4, 1), "float32"),
        vec: R.Tensor((8,), "float32"),
        big: R.Tensor((3, 1, 8), "float32"),
    ):
        with R.dataflow():
            u = R.nn.relu(x)
            g = R.nn.gelu(x)
            c = R.clip(x, 0, 6)
            h = R.astype(x, "float16")
            fin = R.isfinite(x)
            s = R.add(x, x)
            b_row = R.multiply(x, row)
            b_col = R.subtract(col, x)
            b_vec = R.divide(x, vec)
            b_big = R.add(big, x)
            b_both = R.maximum(col, row)
            cmp = R.greater(x, vec)
            R.output(u, g, c, h, fin, s, b_row, b_col, b_vec, b_big, b_both, cmp)
        return u


@I.ir_module
class Symbolic:
    @R.function
    def main(x: R.Tensor(("n", 8), "float32"), y: R.Tensor(("n", 8), "float32"),
             z: R.Tensor(("m", 8), "float32")):
        n = T.int64()
        with R.dataflow():
            a = R.add(x, y)
            bad = R.add(x, z)
            same = R.reshape(x, R.shape([n, 8]))
            flat = R.reshape(x, R.shape([n * 8]))
            R.output(a, bad, same, flat)
        return a


@I.ir_module
class Matmuls:
    @R.function
    def main(
        a: R.Tensor((4, 8), "float32"),
        b: R.Tensor((8, 16), "float32"),
        ba: R.Tensor((2, 3, 4, 8), "float32"),
        bb: R.Tensor((3, 8, 16), "float32"),
        one: R.Tensor((1, 8, 16), "float32"),
        v: R.Tensor((8,), "float32"),
    ):
        with R.dataflow():
            mm = R.matmul(a, b)
            bmm = R.matmul(ba, bb)
            bcast = R.matmul(ba, one)
            mv = R.matmul(a, v)
            vm = R.matmul(v, b)
            dot = R.matmul(v, v)
            vb = R.matmul(v, bb)
            R.output(mm, bmm, bcast, mv, vm, dot, vb)
        return mm


@I.ir_module
class Reductions:
    @R.function
    def main(x: R.Tensor((4, 8, 16), "float32")):
        with R.dataflow():
            s1 = R.sum(x, axis=[1])
            s_keep = R.sum(x, axis=[1], keepdims=True)
            s_all = R.sum(x)
            s_all_keep = R.sum(x, keepdims=True)
            m_neg = R.mean(x, axis=[-1, 0])
            mx = R.max(x, axis=[1])
            var = R.variance(x, axis=[2])
            R.output(s1, s_keep, s_all, s_all_keep, m_neg, mx, var)
        return s1


@I.ir_module
class Norms:
    @R.function
    def main(
        x: R.Tensor((4, 8, 16), "float32"),
        g: R.Tensor((16,), "float32"),
        b: R.Tensor((16,), "float32"),
        g2: R.Tensor((8, 16), "float32"),
    ):
        with R.dataflow():
            sm = R.nn.softmax(x, axis=1)
            lsm = R.nn.log_softmax(x)
            ln = R.nn.layer_norm(x, g, b, axes=[-1])
            ln2 = R.nn.layer_norm(x, g2, g2, axes=[1, 2])
            rms = R.nn.rms_norm(x, g, axes=[-1])
            R.output(sm, lsm, ln, ln2, rms)
        return sm


@I.ir_module
class Layout:
    @R.function
    def main(x: R.Tensor((4, 8, 16), "float32"), y: R.Tensor((4, 2, 16), "float32"),
             p: R.Tensor((8, 6), "float32"), q: R.Tensor((2, 3), "float32"),
             u: R.Tensor((4, 1, 8), "float32")):
        with R.dataflow():
            t = R.permute_dims(x, axes=[2, 0, 1])
            t_rev = R.permute_dims(x)
            e = R.expand_dims(x, axis=[0, -1])
            sq = R.squeeze(u, axis=[1])
            sq_all = R.squeeze(u)
            cat = R.concat((x, y), axis=1)
            sp = R.split(x, 2, axis=2)
            merge = R.reshape(x, R.shape([32, 16]))
            split_dim = R.reshape(p, R.shape([8, 2, 3]))
            swap = R.reshape(q, R.shape([3, 2]))
            ident = R.reshape(x, R.shape([4, 8, 16]))
            drop_one = R.reshape(u, R.shape([4, 8]))
            R.output(t, t_rev, e, sq, sq_all, cat, sp, merge, split_dim, swap, ident, drop_one)
        return t


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
class Distributed:
    I.module_attrs({"device_num": 2})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(
        x: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[0]"),
        w: R.dist.DTensor((8, 16), "float32", "mesh[0]", "R"),
    ) -> R.dist.DTensor((4, 16), "float32", "mesh[0]", "S[0]"):
        y = R.matmul(x, w)
        z = R.nn.relu(y)
        return z


@I.ir_module
class Unknown:
    @R.function
    def main(x: R.Tensor((1, 3, 8, 8), "float32"), w: R.Tensor((4, 3, 3, 3), "float32")):
        with R.dataflow():
            c = R.nn.conv2d(x, w)
            R.output(c)
        return c


# --------------------------------------------------------------------------- the dataclass
def test_reduction_labels_are_operand_labels_missing_from_outputs():
    sig = OpSignature(operands=(), labels=(("a", "b"), ("b", "c")), output=(("a", "c"),))
    assert sig.reduction_labels() == frozenset({"b"})
    assert sig.unshardable == frozenset()
    with pytest.raises(Exception):
        sig.labels = ()  # frozen


def test_register_signature_decorator_and_lookup():
    @register_signature("relax.nn.conv2d")
    def conv(call, mod):
        return None

    try:
        assert "relax.nn.conv2d" in ops.registered_ops()
        assert ops._RULES["relax.nn.conv2d"] is conv
        assert sig_of(Unknown, "c") is None
    finally:
        del ops._RULES["relax.nn.conv2d"]
    assert "relax.nn.conv2d" not in ops.registered_ops()
    with pytest.raises(ValueError):
        register_signature()


def test_unknown_op_and_non_calls_give_none():
    assert sig_of(Unknown, "c") is None
    assert op_signature(relax.Var("x", R.Tensor((2,), "float32")), Unknown) is None


def test_registry_covers_the_listed_ops():
    names = ops.registered_ops()
    for short in ("nn.relu", "nn.gelu_tanh", "isinf", "logical_or", "matmul", "std", "nn.rms_norm",
                  "permute_dims", "expand_dims", "squeeze", "concat", "split", "reshape",
                  "call_tir"):
        assert "relax." + short in names
    assert "relax.dist.annotate_sharding" not in names
    for name in names:  # every registered name is a real operator
        assert ops._op(name).name == name


def test_a_failing_rule_gives_none(caplog):
    @register_signature("relax.nn.conv2d")
    def broken(call, mod):
        raise RuntimeError("boom")

    try:
        with caplog.at_level("WARNING", logger=ops.__name__):
            assert sig_of(Unknown, "c") is None
    finally:
        del ops._RULES["relax.nn.conv2d"]
    assert any("relax.nn.conv2d" in r.getMessage() for r in caplog.records)


def test_an_inconsistent_rule_gives_none():
    @register_signature("relax.nn.conv2d")
    def wrong_rank(call, mod):
        return OpSignature(tuple(call.args), (("a",), ("b",)), (("a",),))

    try:
        assert sig_of(Unknown, "c") is None
    finally:
        del ops._RULES["relax.nn.conv2d"]


# --------------------------------------------------------------------------- elementwise
@pytest.mark.parametrize("name", ["u", "g", "c", "h", "fin"])
def test_unary(name):
    sig = sig_of(Elementwise, name)
    expect(sig, ((0, 1),), ((0, 1),))
    assert operand_names(sig) == ["x"]  # clip's bounds are not operands


def test_binary_same_shape():
    expect(sig_of(Elementwise, "s"), ((0, 1), (0, 1)), ((0, 1),))


def test_binary_broadcast_size_one_row_gets_a_fresh_unshardable_label():
    # (4, 8) * (1, 8): the 1 does not join the 4
    expect(sig_of(Elementwise, "b_row"), ((0, 1), (2, 1)), ((0, 1),),
           unshardable={2}, reduction={2})


def test_binary_broadcast_size_one_column_first_operand():
    # (4, 1) - (4, 8)
    expect(sig_of(Elementwise, "b_col"), ((0, 1), (0, 2)), ((0, 2),),
           unshardable={1}, reduction={1})


def test_binary_broadcast_missing_leading_dims():
    # (4, 8) / (8,): the vector has only the last axis
    expect(sig_of(Elementwise, "b_vec"), ((0, 1), (1,)), ((0, 1),))
    # (3, 1, 8) + (4, 8) -> (3, 4, 8)
    expect(sig_of(Elementwise, "b_big"), ((0, 1, 2), (3, 2)), ((0, 3, 2),),
           unshardable={1}, reduction={1})
    expect(sig_of(Elementwise, "cmp"), ((0, 1), (1,)), ((0, 1),))


def test_binary_broadcast_both_sides():
    # (4, 1) max (1, 8) -> (4, 8)
    expect(sig_of(Elementwise, "b_both"), ((0, 1), (2, 3)), ((0, 3),),
           unshardable={1, 2}, reduction={1, 2})


def test_binary_symbolic_extents():
    expect(sig_of(Symbolic, "a"), ((0, 1), (0, 1)), ((0, 1),))
    assert sig_of(Symbolic, "bad") is None  # n against m cannot be decided


# --------------------------------------------------------------------------- matmul
def test_matmul_2d():
    sig = sig_of(Matmuls, "mm")
    expect(sig, ((0, 1), (1, 2)), ((0, 2),), reduction={1})
    assert operand_names(sig) == ["a", "b"]


def test_matmul_batched_with_broadcast_batch():
    # (2, 3, 4, 8) x (3, 8, 16) -> (2, 3, 4, 16)
    expect(sig_of(Matmuls, "bmm"), ((0, 1, 2, 3), (1, 3, 4)), ((0, 1, 2, 4),), reduction={3})
    # (2, 3, 4, 8) x (1, 8, 16): the 1 broadcasts against 3
    expect(sig_of(Matmuls, "bcast"), ((0, 1, 2, 3), (4, 3, 5)), ((0, 1, 2, 5),),
           unshardable={4}, reduction={3, 4})


def test_matmul_one_dimensional_operands():
    expect(sig_of(Matmuls, "mv"), ((0, 1), (1,)), ((0,),), reduction={1})
    expect(sig_of(Matmuls, "vm"), ((0,), (0, 1)), ((1,),), reduction={0})
    expect(sig_of(Matmuls, "dot"), ((0,), (0,)), ((),), reduction={0})
    # (8,) x (3, 8, 16) -> (3, 16)
    expect(sig_of(Matmuls, "vb"), ((0,), (1, 0, 2)), ((1, 2),), reduction={0})


# --------------------------------------------------------------------------- reductions
def test_sum_over_one_axis():
    expect(sig_of(Reductions, "s1"), ((0, 1, 2),), ((0, 2),), reduction={1})


def test_sum_keepdims_gets_a_fresh_label():
    expect(sig_of(Reductions, "s_keep"), ((0, 1, 2),), ((0, 3, 2),),
           unshardable={3}, reduction={1})


def test_sum_over_all_axes():
    expect(sig_of(Reductions, "s_all"), ((0, 1, 2),), ((),), reduction={0, 1, 2})
    expect(sig_of(Reductions, "s_all_keep"), ((0, 1, 2),), ((3, 4, 5),),
           unshardable={3, 4, 5}, reduction={0, 1, 2})


def test_mean_with_negative_axes():
    expect(sig_of(Reductions, "m_neg"), ((0, 1, 2),), ((1,),), reduction={0, 2})


def test_non_sum_reductions_keep_the_reduced_axis_replicated():
    expect(sig_of(Reductions, "mx"), ((0, 1, 2),), ((0, 2),), unshardable={1}, reduction={1})
    expect(sig_of(Reductions, "var"), ((0, 1, 2),), ((0, 1),), unshardable={2}, reduction={2})


# --------------------------------------------------------------------------- normalisation
def test_softmax_axis_is_unshardable():
    expect(sig_of(Norms, "sm"), ((0, 1, 2),), ((0, 1, 2),), unshardable={1})
    expect(sig_of(Norms, "lsm"), ((0, 1, 2),), ((0, 1, 2),), unshardable={2})


def test_layer_norm():
    sig = sig_of(Norms, "ln")
    expect(sig, ((0, 1, 2), (2,), (2,)), ((0, 1, 2),), unshardable={2})
    assert operand_names(sig) == ["x", "g", "b"]
    expect(sig_of(Norms, "ln2"), ((0, 1, 2), (1, 2), (1, 2)), ((0, 1, 2),), unshardable={1, 2})


def test_rms_norm():
    expect(sig_of(Norms, "rms"), ((0, 1, 2), (2,)), ((0, 1, 2),), unshardable={2})


# --------------------------------------------------------------------------- layout
def test_permute_dims():
    expect(sig_of(Layout, "t"), ((0, 1, 2),), ((2, 0, 1),))
    expect(sig_of(Layout, "t_rev"), ((0, 1, 2),), ((2, 1, 0),))


def test_expand_dims_and_squeeze():
    # (4, 8, 16) -> (1, 4, 8, 16, 1)
    expect(sig_of(Layout, "e"), ((0, 1, 2),), ((3, 0, 1, 2, 4),), unshardable={3, 4})
    expect(sig_of(Layout, "sq"), ((0, 1, 2),), ((0, 2),), unshardable={1}, reduction={1})
    expect(sig_of(Layout, "sq_all"), ((0, 1, 2),), ((0, 2),), unshardable={1}, reduction={1})


def test_concat_lists_each_tensor_and_pins_the_axis():
    sig = sig_of(Layout, "cat")
    expect(sig, ((0, 1, 2), (0, 1, 2)), ((0, 1, 2),), unshardable={1})
    assert operand_names(sig) == ["x", "y"]


def test_split_output_is_a_tuple():
    expect(sig_of(Layout, "sp"), ((0, 1, 2),), ((0, 1, 2), (0, 1, 2)), unshardable={2})


def test_reshape_merge_leading_dims():
    # (4, 8, 16) -> (32, 16): the 4 shares with the 32, the 8 is fresh
    expect(sig_of(Layout, "merge"), ((0, 1, 2),), ((0, 2),), unshardable={1}, reduction={1})


def test_reshape_split_trailing_dim():
    # (8, 6) -> (8, 2, 3): the 6 shares with the 2 (both major in their group)
    expect(sig_of(Layout, "split_dim"), ((0, 1),), ((0, 1, 2),), unshardable={2})


def test_reshape_coprime_extents_share_nothing():
    # (2, 3) -> (3, 2): no shard count divides both 2 and 3
    expect(sig_of(Layout, "swap"), ((0, 1),), ((2, 3),),
           unshardable={0, 1, 2, 3}, reduction={0, 1})


def test_reshape_identity_and_size_one():
    expect(sig_of(Layout, "ident"), ((0, 1, 2),), ((0, 1, 2),))
    # (4, 1, 8) -> (4, 8)
    expect(sig_of(Layout, "drop_one"), ((0, 1, 2),), ((0, 2),), unshardable={1}, reduction={1})


def test_reshape_symbolic():
    expect(sig_of(Symbolic, "same"), ((0, 1),), ((0, 1),))
    assert sig_of(Symbolic, "flat") is None


def test_reshape_groups_helper():
    assert ops._reshape_groups([4, 8, 16], [32, 16]) == [([0, 1], [0]), ([2], [1])]
    assert ops._reshape_groups([4, 8], [4, 8, 1]) == [([0], [0]), ([1], [1]), ([], [2])]


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
    assert ops.prim_func_signature(func, 2) is ops.prim_func_signature(func, 2)


def test_call_tir_of_a_missing_or_non_dps_function():
    call = bindings(LEGALIZED)["mm"]
    bad = relax.Call(call.op, [call.args[0], call.args[1]], call.attrs,
                     [R.Tensor((4, 16, 1), "float32")])
    assert op_signature(bad, LEGALIZED) is None  # output rank differs from the buffer


def test_call_tir_index_under_a_condition_is_unshardable():
    expect(sig_of(HandWritten, "pd"), ((0,),), ((1,),), unshardable={0, 1}, reduction={0})


def test_call_tir_buffer_passed_to_an_extern_call_is_unshardable():
    expect(sig_of(HandWritten, "ex"), ((0,),), ((0,),), unshardable={0})


# --------------------------------------------------------------------------- DTensor operands
def test_dtensor_operands_are_described_like_tensors():
    sig = sig_of(Distributed, "y")
    expect(sig, ((0, 1), (1, 2)), ((0, 2),), reduction={1})
    assert operand_names(sig) == ["x", "w"]
    expect(sig_of(Distributed, "z"), ((0, 1),), ((0, 1),))


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
