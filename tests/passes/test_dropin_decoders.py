"""Decoder layers as TVM's distributed passes handle them: ours give TVM's result, and run.

TVM's ``PropagateSharding`` is the oracle for the plans. The layers
(``tests/dropin_decoders.py``) are written with Relax operators and TVM's
KV-cache builtins, and with ``call_tir`` to hand-written TIR kernels, each with
a static and a symbolic sequence length. Our pass must give exactly TVM's
module (the builtins renamed to ``vm.builtin.distributed.*``, the cache views
typed as DTensors split by heads), well formed, and our ``LowerDistIR`` must
give each rank the plain builtins asking for its local view. Our runtime takes
tensors, not cache objects: the numbers on 2 MPI ranks are checked on the layer
whose caches are created in the function from past keys and values (static
and dynamic length), and on the ``call_tir`` layer without the cache, against numpy.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax.distributed import DTensorType
from tvm.relax.distributed.transform import PropagateSharding as TVMPropagateSharding
from tvm.script import ir as I
from tvm.script import relax as R

import dropin_decoders as dec
import tvm_distx as td
from tvm_distx.ir import helpers as _ir
from tvm_distx.layout import TensorSharding
from tvm_distx.passes import PropagateSharding
from tvm_distx.legalize import LowerGlobalViewToLocalView
from tvm_distx.compiler.pipeline import legalize_ops, run_stages

LENGTHS = [8, "n"]


@I.ir_module
class SequenceSplit:
    I.module_attrs({"device_num": 2})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function(pure=False)
    def main(x: R.Tensor((8, 4, 4), "float32"), cache: R.Object):
        keys = R.nn.relu(x)
        held: R.Object = R.call_packed("vm.builtin.attention_kv_cache_append", cache, keys,
                                       ty_args=(R.Object(),))
        seen: R.Tensor((8, 4, 4), "float32") = R.call_packed(
            "vm.builtin.attention_kv_cache_view", held, R.shape([8, 4, 4]),
            ty_args=(R.Tensor((8, 4, 4), "float32"),))
        rows = R.dist.annotate_sharding(seen, "mesh[0]", "S[0]")
        out = R.nn.relu(rows)
        return out


def _calls(func, predicate):
    found = []
    relax.analysis.post_order_visit(func, lambda e: found.append(e) if predicate(e) else None)
    return found


def _kv_calls(mod):
    return _calls(mod["main"], lambda e: _ir.kv_builtin(e) is not None)


def _check_propagated_like_tvm(mod):
    ours = PropagateSharding(warn_unlegalized=False)(mod)
    relax.analysis.well_formed(ours)
    tvm.ir.assert_structural_equal(ours, TVMPropagateSharding()(mod))
    calls = _kv_calls(ours)
    assert sorted(str(c.op.global_symbol) for c in calls) == [
        "vm.builtin.distributed.attention_kv_cache_append"] * 2 + [
        "vm.builtin.distributed.attention_kv_cache_view"] * 2
    for view in (c for c in calls if _ir.kv_builtin(c)[0] == "view"):
        assert isinstance(view.ty, DTensorType)
        assert str(TensorSharding.from_type(view.ty).placement) == "S[1]"  # split by heads
    return ours


@pytest.mark.parametrize("n", LENGTHS, ids=["static", "dynamic"])
def test_kv_decoder_in_relax_ops_is_propagated_as_tvm_does(n):
    _check_propagated_like_tvm(dec.kv_decoder(n))


@pytest.mark.parametrize("n", LENGTHS, ids=["static", "dynamic"])
def test_kv_decoder_with_call_tir_is_propagated_as_tvm_does(n):
    ours = _check_propagated_like_tvm(dec.tir_decoder(n))
    dist_calls = _calls(ours["main"], lambda e: _ir.is_call_to(e, "relax.call_tir"))
    assert len(dist_calls) > 10
    for call in dist_calls:  # R.dist.call_tir: DTensors in, DTensors out
        assert all(isinstance(a.ty, DTensorType) for a in call.args[1].fields
                   if not isinstance(a.ty, tvm.ir.PrimType))
        assert isinstance(call.ty_args[0], DTensorType)


@pytest.mark.parametrize("n", LENGTHS, ids=["static", "dynamic"])
@pytest.mark.parametrize("form", ["relax", "tir"])
def test_kv_decoder_lowers_to_the_plain_builtins_on_local_views(form, n):
    n = dec.symbolic(n)
    mod = dec.kv_decoder(n) if form == "relax" else dec.tir_decoder(n)
    lowered = run_stages(mod)["lower_distir"]
    relax.analysis.well_formed(lowered)
    calls = _kv_calls(lowered)
    assert {str(c.op.global_symbol) for c in calls} == {
        "vm.builtin.attention_kv_cache_append", "vm.builtin.attention_kv_cache_view"}
    for view in (c for c in calls if _ir.kv_builtin(c)[0] == "view"):
        seq, heads, dim = view.args[1].values
        assert (int(heads), int(dim)) == (2, 4)  # 2 of the 4 heads on each rank
        assert seq.same_as(n) if isinstance(n, tvm.ir.Var) else int(seq) == n
        assert isinstance(view.ty, relax.TensorType)


@pytest.mark.parametrize("n", [5, "n"], ids=["static", "dynamic"])
def test_kv_decoder_equals_numpy_on_two_mpi_ranks(n):
    # the caches are created in the function from the past keys and values (our
    # runtime passes tensors, not cache objects); each rank's cache holds its heads
    mod = dec.prefix_decoder(n, past=4)
    inputs = dec.random_inputs(5 if n == 5 else 6, seed=3, past=4)
    got = td.compile(mod).run(*dec.arguments(mod, inputs), backend="mpi")
    np.testing.assert_allclose(got, dec.reference(inputs, tir=False), rtol=1e-4, atol=1e-4)


def test_call_tir_decoder_equals_numpy_on_two_mpi_ranks():
    mod = dec.tir_decoder(8, cache=False)
    inputs = dec.random_inputs(8, seed=4)
    got = td.compile(mod).run(*dec.arguments(mod, inputs), backend="mpi")
    np.testing.assert_allclose(got, dec.reference(inputs, tir=True), rtol=1e-4, atol=1e-4)


def test_a_cache_holds_whole_rows_when_a_use_splits_the_sequence():
    # each rank's cache grows by rows (dimension 0): a split there is gathered before
    # the append, and the view, which holds whole rows, is sliced for the use
    scores = PropagateSharding(warn_unlegalized=False)(SequenceSplit)
    relax.analysis.well_formed(scores)
    calls = {_ir.kv_builtin(c)[0]: c for c in _kv_calls(scores)}
    assert str(TensorSharding.from_type(calls["append"].args[1].ty).placement) == "R"
    assert str(TensorSharding.from_type(calls["view"].ty).placement) == "R"
    out = scores["main"].body.body
    assert str(TensorSharding.from_type(out.ty).placement) == "S[0]"


@pytest.mark.parametrize("form", ["relax", "tir"])
def test_our_plan_moves_and_holds_no_more_than_tvms(form):
    mod = dec.kv_decoder(8) if form == "relax" else dec.tir_decoder(8)
    ours = run_stages(mod)["local_view"]
    theirs = LowerGlobalViewToLocalView()(TVMPropagateSharding()(legalize_ops(mod)))
    assert td.comm_report(ours).total_bytes_per_rank <= td.comm_report(theirs).total_bytes_per_rank

    def held(m):  # bytes of the parameters each rank holds
        return sum(int(np.prod(TensorSharding.from_type(p.ty).local_shape(
            [int(d) for d in p.ty.tensor_ty.shape.values]))) * 4
            for p in m["main"].params if isinstance(p.ty, DTensorType))

    assert held(ours) <= held(theirs)
