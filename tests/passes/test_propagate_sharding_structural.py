"""PropagateSharding in TVM's test form: a ``Before`` module, an ``Expected`` one written by hand.

One small module per main case of the pass: a column-parallel matmul followed by a
row-parallel one (the partial sum completed where it is consumed), elementwise operators
with a broadcast operand, a call of a private function, two annotations that disagree
(a redistribute between them), and a module that no annotation reaches (left as it is).
Every ``Expected`` states the binding types the pass must write, so that a change of
placement anywhere fails the comparison, not only a change of the parameters.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from tvm_distx.passes import PropagateSharding


def propagate(mod: tvm.IRModule) -> tvm.IRModule:
    # high-level operators on DTensors are what these cases are about: no warning
    out = PropagateSharding(warn_unlegalized=False)(mod)
    relax.analysis.well_formed(out)
    return out


# --------------------------------------------------------------------------- column -> row
@I.ir_module
class ColumnThenRow:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.Tensor((4, 8), "float32"), w1: R.Tensor((8, 16), "float32"),
             w2: R.Tensor((16, 8), "float32")) -> R.Tensor((4, 8), "float32"):
        w1_ann = R.dist.annotate_sharding(w1, device_mesh="mesh[0]", placement="S[1]")
        w2_ann = R.dist.annotate_sharding(w2, device_mesh="mesh[0]", placement="S[0]")
        h = R.matmul(x, w1_ann)
        a = R.nn.relu(h)
        y = R.matmul(a, w2_ann)
        return y


@I.ir_module
class ColumnThenRowExpected:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"),
             w1: R.dist.DTensor((8, 16), "float32", "mesh[0]", "S[1]"),
             w2: R.dist.DTensor((16, 8), "float32", "mesh[0]", "S[0]"),
             ) -> R.dist.DTensor((4, 8), "float32", "mesh[0]", "R"):
        h: R.dist.DTensor((4, 16), "float32", "mesh[0]", "S[1]") = R.matmul(x, w1)
        a: R.dist.DTensor((4, 16), "float32", "mesh[0]", "S[1]") = R.nn.relu(h)
        # the contraction is split: a partial sum, typed as what it is once completed (R)
        y: R.dist.DTensor((4, 8), "float32", "mesh[0]", "R") = R.matmul(a, w2)
        return y


def test_column_then_row_matmul_partial_sum_completed_replicated_by_the_return():
    """Column-parallel w1 (S[1]) then row-parallel w2 (S[0]): the activation between them is
    split on its features, the input stays replicated, the annotations vanish into the
    parameter types, and the second matmul's partial sum is typed R (completed by the
    all-reduce the local-view lowering adds), with no redistribute anywhere."""
    tvm.ir.assert_structural_equal(propagate(ColumnThenRow), ColumnThenRowExpected)


@I.ir_module
class RowSumIntoSplitTokens:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(a: R.Tensor((4, 16), "float32"), w2: R.Tensor((16, 8), "float32"),
             b: R.Tensor((8,), "float32")) -> R.Tensor((4, 8), "float32"):
        a_ann = R.dist.annotate_sharding(a, device_mesh="mesh[0]", placement="S[1]")
        w2_ann = R.dist.annotate_sharding(w2, device_mesh="mesh[0]", placement="S[0]")
        y = R.matmul(a_ann, w2_ann)
        z = R.add(y, b)
        z_ann = R.dist.annotate_sharding(z, device_mesh="mesh[0]", placement="S[0]")
        return z_ann


@I.ir_module
class RowSumIntoSplitTokensExpected:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(a: R.dist.DTensor((4, 16), "float32", "mesh[0]", "S[1]"),
             w2: R.dist.DTensor((16, 8), "float32", "mesh[0]", "S[0]"),
             b: R.dist.DTensor((8,), "float32", "mesh[0]", "R"),
             ) -> R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[0]"):
        y: R.dist.DTensor((4, 8), "float32", "mesh[0]", "R") = R.matmul(a, w2)
        # the consumer wants the tokens split: the partial sum is moved there directly
        # (a reduce-scatter once legalized), and the bias add runs on each rank's rows
        y_redist = R.dist.redistribute(y, device_mesh="mesh[0]", placement="S[0]")
        z: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[0]") = R.add(y_redist, b)
        return z


def test_row_parallel_partial_sum_completed_by_a_consumer_that_splits_the_tokens():
    """A row-parallel matmul's partial sum, plus a bias, consumed split on the tokens (S[0]):
    the add is decided by its consumer, so the partial sum is redistributed to S[0] before
    it (not all-reduced to R and sliced), the bias stays replicated, and the result
    annotation vanishes into the return type."""
    tvm.ir.assert_structural_equal(propagate(RowSumIntoSplitTokens),
                                   RowSumIntoSplitTokensExpected)


# --------------------------------------------------------------------------- elementwise
@I.ir_module
class Elementwise:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.Tensor((4, 8), "float32"), r: R.Tensor((4, 8), "float32"),
             b: R.Tensor((8,), "float32")) -> R.Tensor((4, 8), "float32"):
        x_ann = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="S[1]")
        s = R.add(x_ann, r)
        t = R.multiply(s, b)
        u = R.exp(t)
        return u


@I.ir_module
class ElementwiseExpected:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[1]"),
             r: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[1]"),
             b: R.dist.DTensor((8,), "float32", "mesh[0]", "S[0]"),
             ) -> R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[1]"):
        s: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[1]") = R.add(x, r)
        t: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[1]") = R.multiply(s, b)
        u: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[1]") = R.exp(t)
        return u


def test_elementwise_split_reaches_the_other_operands_and_the_broadcast_one_on_its_own_axis():
    """Elementwise chain from x split on its features (S[1]): the same-shaped operand r gets
    S[1], the broadcast (8,) operand b gets its only axis split (S[0], the features it is
    added to), every result stays S[1], and nothing is redistributed."""
    tvm.ir.assert_structural_equal(propagate(Elementwise), ElementwiseExpected)


# --------------------------------------------------------------------------- private callee
@I.ir_module
class PrivateCallee:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function(private=True)
    def scale(x: R.Tensor((4, 8), "float32"), w: R.Tensor((4, 8), "float32")
              ) -> R.Tensor((4, 8), "float32"):
        y = R.multiply(x, w)
        return y

    @R.function
    def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((4, 8), "float32")
             ) -> R.Tensor((4, 8), "float32"):
        cls = PrivateCallee
        x_ann = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="S[0]")
        y = cls.scale(x_ann, w)
        z = R.nn.relu(y)
        return z


@I.ir_module
class PrivateCalleeExpected:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function(private=True)
    def scale(x: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[0]"),
              w: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[0]"),
              ) -> R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[0]"):
        y: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[0]") = R.multiply(x, w)
        return y

    @R.function
    def main(x: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[0]"),
             w: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[0]"),
             ) -> R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[0]"):
        cls = PrivateCalleeExpected
        y: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[0]") = cls.scale(x, w)
        z: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[0]") = R.nn.relu(y)
        return z


def test_call_of_a_private_function_is_typed_with_the_callers_sharding_both_ways():
    """A private function called with x split on its rows (S[0]): the callee gets DTensor
    parameters S[0] (keeping its name, one signature), its split flows back out to the
    caller's other argument w, and to the result used by relu."""
    tvm.ir.assert_structural_equal(propagate(PrivateCallee), PrivateCalleeExpected)


# --------------------------------------------------------------------------- conflicts
@I.ir_module
class Conflict:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.Tensor((4, 8), "float32")) -> R.Tensor((4, 8), "float32"):
        x_ann = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="S[0]")
        y = R.nn.relu(x_ann)
        y_ann = R.dist.annotate_sharding(y, device_mesh="mesh[0]", placement="S[1]")
        z = R.exp(y_ann)
        return z


@I.ir_module
class ConflictExpected:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[0]")
             ) -> R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[1]"):
        y: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[0]") = R.nn.relu(x)
        y_ann: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[1]") = R.dist.redistribute(
            y, device_mesh="mesh[0]", placement="S[1]")
        z: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[1]") = R.exp(y_ann)
        return z


def test_conflicting_annotations_meet_at_one_redistribute():
    """x annotated S[0], relu(x) annotated S[1]: both annotations hold, relu runs on rows,
    and the second annotation becomes the one redistribute S[0] -> S[1] before exp."""
    tvm.ir.assert_structural_equal(propagate(Conflict), ConflictExpected)


# --------------------------------------------------------------------------- unchanged
@I.ir_module
class NoAnnotation:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 8), "float32")
             ) -> R.Tensor((4, 8), "float32"):
        y = R.matmul(x, w)
        z = R.nn.relu(y)
        return z


def test_module_without_annotations_is_left_as_it_is():
    """No annotation reaches main: it keeps its plain Tensor types, nothing is inserted."""
    tvm.ir.assert_structural_equal(propagate(NoAnnotation), NoAnnotation)


def test_propagated_module_is_a_fixed_point():
    """Propagating the Expected of the column/row case again changes nothing."""
    tvm.ir.assert_structural_equal(propagate(ColumnThenRowExpected), ColumnThenRowExpected)
