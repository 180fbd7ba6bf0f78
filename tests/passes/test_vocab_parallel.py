"""Vocabulary-parallel embeddings: each rank holds V/p rows, one all-reduce completes a lookup.

The rewrite (:class:`tvm_distx.passes.VocabParallelEmbedding`) and its offsets
(:class:`tvm_distx.layout.derived.BlockOffsets`) are checked as IR and as data;
propagation must give the lookup a partial sum, completed by an all-reduce, or
by a reduce-scatter when its consumer wants the tokens split; the plan's
criterion is checked on small modules; and Llama and Qwen2 run on 2 MPI ranks
with their embedding at 1/p per rank, logits equal to transformers'.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax, tirx
from tvm.script import ir as I
from tvm.script import relax as R

import tvm_distx as td
from tvm_distx.plans import presets
from tvm_distx.bundle.manifest import read_manifest
from tvm_distx.ir import helpers as _ir
from tvm_distx.ir.helpers import dtensor_sharding
from tvm_distx.errors import RuleError
from tvm_distx.layout.derived import BlockOffsets, Derivations
from tvm_distx.passes import AnnotateSharding, VocabParallelEmbedding, derivations_of
from tvm_distx.passes.vocab_parallel import KERNEL_ATTR, vocab_lookups
from tvm_distx.compiler.pipeline import run_stages
from tvm_distx.layout.rules import ShardingRule
from tvm_distx.plans.vocab import embedding_roles


def _lookup_module(vocab: int = 16, tokens: int = 4, tied: bool = False,
                   positions: bool = False, residual: bool = False,
                   shared: bool = False, mesh: tuple[int, ...] = (2,)) -> tvm.IRModule:
    """``main(ids, table) = take(table, ids) * 2`` (plus a tied head, a position lookup or
    another use of the table); with ``residual``, ``main(ids, x, table) = take(table, ids) + x``."""
    bb = relax.BlockBuilder()
    ids = relax.Var("ids", relax.TensorType([tokens], "int32"))
    x = relax.Var("x", relax.TensorType([tokens, 8], "float32"))
    table = relax.Var("table", relax.TensorType([vocab, 8], "float32"))
    params = [ids, x, table] if residual else [ids, table]
    with bb.function("main", params, attrs={"num_input": len(params) - 1}):
        with bb.dataflow():
            index = bb.emit(relax.op.arange(0, tokens, 1, "int32")) if positions else ids
            looked = bb.emit(relax.op.take(table, index, axis=0))
            out = bb.emit(relax.op.add(looked, x) if residual else
                          relax.op.multiply(looked, relax.const(2.0, "float32")))
            if tied:
                head = bb.emit(relax.op.permute_dims(table))
                out = bb.emit(relax.op.matmul(out, head))
            if shared:
                out = bb.emit(relax.op.add(out, relax.op.sum(table, axis=[0])))
            out = bb.emit_output(out)
        bb.emit_func_output(out)
    return presets.set_device_meshes(bb.get(), [mesh])


def _annotated(mod: tvm.IRModule, extra=()) -> tvm.IRModule:
    mod = VocabParallelEmbedding({"table": 2})(mod)
    rules = [ShardingRule(param="table", result="S[0]", function="main"),
             ShardingRule(param="table_vocab_offsets", result="S[0]", function="main"),
             *extra]
    return AnnotateSharding(rules)(mod)


# ----------------------------------------------------------------------- the offsets
def test_each_ranks_offset_is_its_shard_of_the_block_starts():
    made = BlockOffsets("off", 128, 4, "int32")
    np.testing.assert_array_equal(made.value(), [0, 32, 64, 96])
    assert made.value().dtype == np.int32
    derivations = Derivations((), (made,))
    assert Derivations.from_json(json.loads(json.dumps(derivations.to_json()))) == derivations
    bound = derivations.bind({"w": np.zeros(2)})
    assert set(bound) == {"w", "off"}
    assert "off" not in derivations.bind({"w": np.zeros(2)}, stored={"off"})  # in a bundle
    with pytest.raises(td.errors.ArgumentError, match="does not split into 3"):
        BlockOffsets("off", 128, 3)


# ------------------------------------------------------------------------ the rewrite
def test_the_rewrite_reshapes_the_table_into_blocks_and_calls_the_masked_lookup():
    mod = VocabParallelEmbedding({"table": 2})(_lookup_module())
    main = mod["main"]
    assert [p.name for p in main.params] == ["ids", "table", "table_vocab_offsets"]
    assert main.params[2].ty.dtype == "int32" and _shape(main.params[2]) == [2]
    bindings = main.body.blocks[0].bindings
    reshape, lookup = bindings[0].value, bindings[1].value
    assert reshape.op.name == "relax.reshape" and _shape(bindings[0].var) == [2, 8, 8]
    assert lookup.op.name == "relax.call_tir" and _shape(bindings[1].var) == [4, 8]
    kernel = mod[lookup.args[0]]
    assert isinstance(kernel, tirx.PrimFunc) and KERNEL_ATTR in kernel.attrs
    assert [a.name for a in lookup.args[1].fields] == [bindings[0].var.name, "ids",
                                                       "table_vocab_offsets"]
    assert vocab_lookups(mod) == {"table": "table_vocab_offsets"}
    assert derivations_of(mod)["main"].made == (BlockOffsets("table_vocab_offsets", 16, 2,
                                                             "int32"),)
    tvm.ir.assert_structural_equal(VocabParallelEmbedding({"table": 2})(mod), mod)  # idempotent


def test_the_rewrite_computes_take_on_one_rank():
    mod = VocabParallelEmbedding({"table": 4})(_lookup_module())
    exe = tvm.compile(mod, target="llvm")
    vm = relax.VirtualMachine(exe, tvm.cpu())
    table = np.random.default_rng(0).standard_normal((16, 8)).astype("float32")
    ids = np.array([0, 15, 4, 9], "int32")
    got = vm["main"](tvm.runtime.tensor(ids), tvm.runtime.tensor(table),
                     tvm.runtime.tensor(np.arange(4, dtype="int32") * 4)).numpy()
    np.testing.assert_array_equal(got, table[ids] * 2)


def test_a_table_that_cannot_be_split_is_refused_with_what_to_do():
    with pytest.raises(RuleError, match="do not divide into 3 blocks") as err:
        VocabParallelEmbedding({"table": 3})(_lookup_module())
    assert "'R'" in str(err.value)
    with pytest.raises(RuleError, match="'ids' is not a 2-D parameter"):
        VocabParallelEmbedding({"ids": 2})(_lookup_module())


# ------------------------------------------------------------------------ propagation
def _shape(var) -> list[int]:
    return [int(d) for d in var.ty.shape]


def test_the_lookup_of_a_vocabulary_split_table_is_a_partial_sum_completed_by_one_all_reduce():
    stages = run_stages(_annotated(_lookup_module()))
    lookup = next(b for b in stages["propagate_sharding"]["main"].body.blocks[0].bindings
                  if b.value.op.name == "relax.call_tir" and
                  KERNEL_ATTR in (stages["propagate_sharding"][b.value.args[0]].attrs or {}))
    operands = [str(dtensor_sharding(a.ty)[1]) for a in lookup.value.args[1].fields]
    assert operands == ["S[0]", "R", "S[0]"]  # blocks, ids, offsets
    rows = td.comm_report(stages["local_view"]).rows
    assert [(r.collective, r.src, r.dst) for r in rows] == [("all_reduce", "P", "R")]


def test_on_one_rank_the_table_moves_nothing():
    # a (1,) mesh: the table's blocks may be typed S[1] by the reshape and read as S[0],
    # the same single block; the program must not copy the table through a collective
    mod = VocabParallelEmbedding({"table": 1})(_lookup_module(mesh=(1,)))
    mod = AnnotateSharding([ShardingRule(param="table", result="S[0]", function="main"),
                            ShardingRule(param="table_vocab_offsets", result="S[0]",
                                         function="main")])(mod)
    rows = td.comm_report(run_stages(mod)["local_view"]).rows
    assert all(r.collective == "all_reduce" for r in rows), rows


def test_a_consumer_that_wants_the_tokens_split_gets_a_reduce_scatter():
    """The lookup added to a residual stream split on its tokens (sequence parallelism)."""
    split_tokens = ShardingRule(param="x", result="S[0]", function="main")
    rows = td.comm_report(run_stages(_annotated(_lookup_module(residual=True), [split_tokens]))
                          ["local_view"]).rows
    assert [(r.collective, r.src, r.dst) for r in rows] == [("reduce_scatter", "P", "S[0]")]


# -------------------------------------------------------------------------- criterion
@pytest.mark.parametrize("case, role, reason", [
    (dict(), "vocab", "16 rows split >= 2 x 4 tokens"),
    (dict(tokens=12), "replicated", "less than the all-reduce of 12 tokens"),
    (dict(vocab=15), "replicated", "15 rows do not divide by 2 ranks"),
    (dict(tied=True), "vocab", "tied to the LM head split alike"),
    (dict(shared=True), "replicated", "another use than the LM head"),
    (dict(positions=True), "replicated", "a position table"),
])
def test_the_plan_splits_a_table_only_where_that_saves_memory(case, role, reason):
    got = embedding_roles(_lookup_module(**case), 2)["table"]
    assert got.role == role and reason in got.reason, got.reason
    assert (got.axis == 0) == (role == "vocab")


# ---------------------------------------------------------------------------- ranks
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from hf_tiny import VOCAB, build, logits, tokens  # noqa: E402


def test_a_vocabulary_parallel_llama_equals_transformers_with_its_table_at_one_pth(
        tmp_path, record_property):
    """Every other family with an untied embedding runs vocabulary parallel in
    tests/plans/test_hf_matrix.py (Qwen2, Mistral, Mixtral, ... on 2 and 4 MPI ranks and disco)."""
    model = build("llama", layers=1)
    mod, weights = td.from_torch(model, (torch.from_numpy(tokens(8)),))
    preset = presets.tensor_parallel()
    annotated = preset.apply(presets.set_device_meshes(mod, [(2,)]))
    table = "p_model_embed_tokens_weight"
    assert preset.plan(preset.prepare(presets.set_device_meshes(mod, [(2,)]))).role(table).role == \
        "vocab"
    exe = td.compile(annotated)
    # the table's reshape into blocks copies nothing at run time: it is fused into the
    # lookup kernel (a reshape of a weight is a weight decode), which reads the rank's rows
    # of the table parameter in place
    lookups = [b.value.args[1] for block in exe.built["main"].body.blocks
               for b in block.bindings if _ir.is_call_to(b.value, "relax.call_tir")
               and "vocab_parallel_lookup" in b.value.args[0].name_hint]
    assert len(lookups) == 1
    assert table in [arg.name for arg in lookups[0].fields if isinstance(arg, relax.Var)]
    ids = tokens(8, seed=5)
    got = exe.run(ids, params=weights, backend="mpi")
    record_property("max_abs_error_mpi", float(np.abs(got - logits(model, ids)).max()))
    np.testing.assert_allclose(got, logits(model, ids), atol=1e-4, rtol=0)
    # each rank's bundle holds half the table, and its own offset
    bundle = exe.export(tmp_path / "bundle", params=weights)
    hidden = weights[table].shape[1]
    manifest = read_manifest(bundle)
    for rank in range(2):
        held = np.asarray(manifest.read_weight(rank, table))
        assert held.nbytes * 2 == weights[table].nbytes
        np.testing.assert_array_equal(held, np.asarray(weights[table])[rank * VOCAB // 2:
                                                                    (rank + 1) * VOCAB // 2])
        offset = np.asarray(manifest.read_weight(rank, f"{table}_vocab_offsets"))
        assert offset.tolist() == [rank * VOCAB // 2]
    record_property("embedding_bytes_per_rank", VOCAB // 2 * hidden * 4)
