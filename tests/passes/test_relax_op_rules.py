"""Tests of :mod:`tvm_distx.passes.relax_op_rules`: the signatures of Relax operator calls.

Signatures are compared label-agnostically (:func:`signature_tools.canon`).
"""

from __future__ import annotations

import pytest
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from signature_tools import expect, operand_names, sig_of
from tvm_distx.passes import relax_op_rules


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
    assert relax_op_rules._reshape_groups([4, 8, 16], [32, 16]) == [([0, 1], [0]), ([2], [1])]
    assert relax_op_rules._reshape_groups([4, 8], [4, 8, 1]) == [([0], [0]), ([1], [1]), ([], [2])]
