"""Our passes mixed with TVM's distributed passes, in the orders the pipeline allows.

The stages are PropagateSharding, LowerGlobalViewToLocalView,
LegalizeRedistribute and LowerDistIR. Each order below replaces some of ours
by TVM's (``tvm.relax.distributed.transform``) and checks that every
intermediate module is well formed:

(a) ours up to LegalizeRedistribute, then TVM's LowerDistIR. TVM's lowered
    program takes the global inputs on worker 0 and broadcasts and scatters
    them at entry (``runtime.disco.*``): our MPI ranks provide those functions,
    and the launcher, the bundle and the session give rank 0 the global
    inputs (the ``"worker0"`` feed). The decoder layer, a two-layer MLP and a
    local slice (which our LegalizeRedistribute writes in TVM's form with
    ``tvm_forms=True``): numbers on 2 MPI ranks vs numpy, launched once as a
    session; the decoder with TVM's local view too, from an exported bundle
    through the launcher, on MPI and on disco.
(b) TVM's PropagateSharding, then ours: numbers on 2 MPI ranks vs numpy.
(c) ours PropagateSharding, TVM's LowerGlobalViewToLocalView, then ours, on
    the decoder with KV caches and a dynamic length: numbers on 2 MPI ranks
    vs numpy.
(d) TVM's LegalizeRedistribute emits ``redistribute_replica_to_shard`` for a
    local slice; our LowerDistIR accepts it: numbers on 2 MPI ranks.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax.distributed import DTensorType
from tvm.relax.distributed import transform as tvm_dist
from tvm.script import ir as I
from tvm.script import relax as R

import dropin_decoders as dec
import tvm_distx as td
from reference import mlp_twice
from tvm_distx import legalize
from tvm_distx.compiler import pipeline
from tvm_distx.bundle.manifest import read_manifest
from tvm_distx.errors import ArgumentError, BundleError, UnsupportedProgramError
from tvm_distx.passes import PropagateSharding
from tvm_distx.runtime.backends import launch


def _well_formed_through(mod, passes):
    for stage in passes:
        mod = stage(mod)
        relax.analysis.well_formed(mod)
    return mod


def _compile_with(mod, **replaced):
    """``compile`` with some of our stages replaced, by stage name."""
    stages = [(name, replaced.get(name, stage)) for name, stage in pipeline._stages()]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipeline, "_stages", lambda: stages)
        return td.compile(mod)


@pytest.fixture
def mixed():
    return _compile_with


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


@I.ir_module
class OrderAExtras:
    """The MLP for order (a), a public function beside the decoder's ``main``."""

    I.module_attrs({"device_num": 2})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def mlp(x: R.Tensor((16, 32), "float32"), A: R.Tensor((32, 32), "float32"),
            B: R.Tensor((32, 32), "float32")) -> R.Tensor((16, 32), "float32"):
        # columns of A, rows of B: the second matmul of each layer is a partial sum
        a = R.dist.annotate_sharding(A, device_mesh="mesh[0]", placement="S[1]")
        b = R.dist.annotate_sharding(B, device_mesh="mesh[0]", placement="S[0]")
        h = R.matmul(R.nn.relu(R.matmul(x, a)), b)
        y = R.matmul(R.nn.relu(R.matmul(h, a)), b)
        return y

    @R.function
    def replica_to_shard(x: R.dist.DTensor((8, 16), "float32", "mesh[0]", "R")
                         ) -> R.dist.DTensor((8, 16), "float32", "mesh[0]", "S[1]"):
        y = R.dist.redistribute(x, device_mesh="mesh[0]", placement="S[1]")
        return y


def _order_a_module():
    mod = dec.plain_decoder(8)
    for name in ("mlp", "replica_to_shard"):
        mod[name] = OrderAExtras[name]
    return mod


@pytest.fixture(scope="module")
def order_a():
    """The decoder, the MLP and a local slice: ours to LegalizeRedistribute, TVM's LowerDistIR.

    Our LegalizeRedistribute writes the local slice in TVM's form (``tvm_forms``).
    """
    return _compile_with(_order_a_module(),
                         legalize_redistribute=legalize.LegalizeRedistribute(tvm_forms=True),
                         lower_distir=tvm_dist.LowerDistIR())


def test_a_local_slice_in_tvm_form_lowers_as_ours():
    ours = [PropagateSharding(require_legalized=True), legalize.LowerGlobalViewToLocalView()]
    mod = _well_formed_through(pipeline.legalize_ops(ReplicaToShard), ours)
    tvm_form = legalize.LegalizeRedistribute(tvm_forms=True)(mod)
    assert "redistribute_replica_to_shard" in tvm_form["main"].script()
    tvm.ir.assert_structural_equal(legalize.LowerDistIR()(tvm_form),
                                   legalize.LowerDistIR()(legalize.LegalizeRedistribute()(mod)))


def _order_a_inputs():
    rng = np.random.default_rng(13)
    inputs = dec.random_inputs(8, seed=11)
    mlp = [(0.3 * rng.standard_normal(s)).astype("float32") for s in ((16, 32), (32, 32),
                                                                      (32, 32))]
    return inputs, mlp


def test_a_tvm_lowered_program_equals_numpy_on_two_mpi_ranks(order_a):
    relax.analysis.well_formed(order_a.module)
    assert {s.feed for s in order_a.signatures.values()} == {"worker0"}
    text = order_a.module.script()
    assert "R.ccl.scatter_from_worker0" in text and "tvm_distx.ccl" not in text
    assert "R.dist.redistribute_replica_to_shard" in text  # sliced with runtime.disco.worker_id
    inputs, mlp = _order_a_inputs()
    x = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
    weights = {w: inputs[w] for w in dec.WEIGHTS}
    with pytest.raises(ArgumentError, match="emulator"):
        order_a.run(*mlp, function="mlp", backend="emulate")
    # one launch: rank 0 holds the stored weights whole, the others nothing
    with order_a.session(params=weights, function="main") as session:
        np.testing.assert_allclose(session.run(inputs["x"]), dec.reference(inputs, tir=False),
                                   rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(session.run(*mlp, function="mlp"), mlp_twice(*mlp),
                                   rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(session.run(x, function="replica_to_shard"), x)
        with pytest.raises(ArgumentError, match="LowerDistIR"):
            session.run(*mlp[1:], function="mlp", state={"x": "h"})
        assert session.weights_loaded == {0: len(weights), 1: len(weights)}


def test_a_with_tvm_local_view_runs_from_a_bundle_on_two_mpi_ranks_and_disco(tmp_path):
    mod = dec.plain_decoder(8)
    exe = _compile_with(mod, local_view=tvm_dist.LowerGlobalViewToLocalView(),
                        lower_distir=tvm_dist.LowerDistIR())
    relax.analysis.well_formed(exe.module)
    inputs = dec.random_inputs(8, seed=14)
    bundle = exe.export(tmp_path / "bundle", params={w: inputs[w] for w in dec.WEIGHTS})
    files = read_manifest(bundle).weight_files
    assert {(f.rank, f.name, f.shape) for f in files} == {
        (0, w, inputs[w].shape) for w in dec.WEIGHTS}  # global, on rank 0 only
    with pytest.raises(ArgumentError, match="shape"):  # checked before any rank starts
        launch(bundle, [inputs["x"][:, :8]])
    want = dec.reference(inputs, tir=False)
    np.testing.assert_allclose(launch(bundle, [inputs["x"]]), want, rtol=1e-4, atol=1e-4)
    # disco workers: TVM's dispatchers reach the session's CCL, our shared memory
    np.testing.assert_allclose(launch(bundle, [inputs["x"]], backend="disco"), want,
                               rtol=1e-4, atol=1e-4)
    # the manifest says how the ranks are fed; a feed this version does not know is refused
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["functions"]["main"]["feed"] == "worker0"
    manifest["functions"]["main"]["feed"] = "broadcast"
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="feed 'broadcast'"):
        launch(bundle, [inputs["x"]])


@I.ir_module
class SecondStage:
    I.module_attrs({"device_num": 4})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(2, 4))]})

    @R.function
    def main(x: R.Tensor((8, 16), "float32")) -> R.Tensor((8, 16), "float32"):
        y = R.nn.relu(R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="S[0]"))
        return y


def test_a_refuses_tvm_lowering_off_the_whole_world():
    # TVM's builtins span every worker: a mesh of devices 2..3 cannot be fed from worker 0
    with pytest.raises(UnsupportedProgramError, match="worker 0") as err:
        _compile_with(SecondStage, lower_distir=tvm_dist.LowerDistIR())
    assert err.value.var == "x" and err.value.function == "main"


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
