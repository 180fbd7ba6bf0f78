"""Our passes mixed with TVM's distributed passes, in the orders the pipeline allows.

The stages are PropagateSharding, LowerGlobalViewToLocalView,
LegalizeRedistribute and LowerDistIR. Each order below replaces some of ours
by TVM's (``tvm.relax.distributed.transform``) and checks that every
intermediate module is well formed:

(a) ours up to LegalizeRedistribute, then TVM's LowerDistIR. TVM's lowered
    program feeds the ranks from worker 0 with ``R.ccl`` broadcasts and
    scatters, which only TVM's disco runtime runs; it is checked structurally.
(b) TVM's PropagateSharding, then ours: numbers on 2 MPI ranks vs numpy.
(c) ours PropagateSharding, TVM's LowerGlobalViewToLocalView, then ours, on
    the decoder with KV caches and a dynamic length: numbers on 2 MPI ranks
    vs numpy.
(d) TVM's LegalizeRedistribute emits ``redistribute_replica_to_shard`` for a
    local slice; our LowerDistIR accepts it: numbers on 2 MPI ranks.
"""

from __future__ import annotations

import numpy as np
import pytest
from tvm import relax
from tvm.relax.distributed import DTensorType
from tvm.relax.distributed import transform as tvm_dist
from tvm.script import ir as I
from tvm.script import relax as R

import dropin_decoders as dec
import tvm_distx as td
from tvm_distx import legalize, pipeline
from tvm_distx.passes import PropagateSharding


def _well_formed_through(mod, passes):
    for stage in passes:
        mod = stage(mod)
        relax.analysis.well_formed(mod)
    return mod


@pytest.fixture
def mixed(monkeypatch):
    """``compile`` with some of our stages replaced, by stage name."""

    def compile_with(mod, **replaced):
        stages = [(name, replaced.get(name, stage)) for name, stage in pipeline._stages()]
        monkeypatch.setattr(pipeline, "_stages", lambda: stages)
        return td.compile(mod)

    return compile_with


def _run_decoder(executable, mod, tir):
    inputs = dec.random_inputs(8, seed=11)
    got = executable.run(*dec.arguments(mod, inputs), backend="mpi")
    np.testing.assert_allclose(got, dec.reference(inputs, tir=tir), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("local_view", ["ours", "tvm"])
def test_a_ours_to_legalize_then_tvm_lower_distir(local_view):
    view = legalize.LowerGlobalViewToLocalView() if local_view == "ours" \
        else tvm_dist.LowerGlobalViewToLocalView()
    mod = pipeline.legalize_ops(dec.plain_decoder(8))
    lowered = _well_formed_through(mod, [PropagateSharding(require_legalized=True), view,
                                         legalize.LegalizeRedistribute(),
                                         tvm_dist.LowerDistIR()])
    main = lowered["main"]
    assert not any(isinstance(p.ty, DTensorType) for p in main.params)
    text = main.script()
    # TVM's lowering: inputs come from worker 0, split weights by a scatter
    assert "R.ccl.broadcast_from_worker0" in text and "R.ccl.scatter_from_worker0" in text
    # the completion of the row-split output projection, as our all-reduce or TVM's
    assert "allreduce" in text


def test_b_tvm_propagate_then_ours_equals_numpy_on_two_mpi_ranks(mixed):
    mod = dec.tir_decoder(8, cache=False)
    _well_formed_through(mod, [tvm_dist.PropagateSharding(), legalize.LowerGlobalViewToLocalView(),
                               legalize.LegalizeRedistribute(), legalize.LowerDistIR()])
    _run_decoder(mixed(mod, propagate_sharding=tvm_dist.PropagateSharding()), mod, tir=True)


def test_c_ours_propagate_then_tvm_local_view_equals_numpy_on_two_mpi_ranks(mixed):
    # the decoder with KV caches (created from past keys and values) and a dynamic length
    mod = dec.prefix_decoder("n", past=4)
    _well_formed_through(pipeline.legalize_ops(mod), [
        PropagateSharding(require_legalized=True), tvm_dist.LowerGlobalViewToLocalView(),
        legalize.LegalizeRedistribute(), legalize.LowerDistIR()])
    inputs = dec.random_inputs(6, seed=12, past=4)
    got = mixed(mod, local_view=tvm_dist.LowerGlobalViewToLocalView()).run(
        *dec.arguments(mod, inputs), backend="mpi")
    np.testing.assert_allclose(got, dec.reference(inputs, tir=False), rtol=1e-4, atol=1e-4)


@I.ir_module
class ReplicaToShard:
    I.module_attrs({"device_num": 2})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.dist.DTensor((8, 16), "float32", "mesh[0]", "R")
             ) -> R.dist.DTensor((8, 16), "float32", "mesh[0]", "S[1]"):
        y = R.dist.redistribute(x, device_mesh="mesh[0]", placement="S[1]")
        return y


def test_d_tvm_legalize_redistribute_then_our_lower_distir(mixed):
    legalized = tvm_dist.LegalizeRedistribute()(ReplicaToShard)
    assert "redistribute_replica_to_shard" in legalized["main"].script()
    lowered = _well_formed_through(legalized, [legalize.LowerDistIR()])
    assert "tvm_distx.ccl.local_slice" in lowered["main"].script()
    x = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
    got = mixed(ReplicaToShard, legalize_redistribute=tvm_dist.LegalizeRedistribute()).run(
        x, backend="mpi")
    np.testing.assert_array_equal(got, x)
