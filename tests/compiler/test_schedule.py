"""ScheduleCPU: every rule keeps the numbers, and really parallelizes and vectorizes."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.s_tir import Schedule
from tvm.script import tirx as T

import tvm_distx as td
from tvm_distx import ShardingRule
from tvm_distx.compiler.pipeline import legalize_ops
from tvm_distx.passes import AnnotateSharding
from tvm_distx.runtime import emulate, shard_array
from tvm_distx.compiler.schedule import (
    AS_WRITTEN, RULE_ATTR, SCHEDULED_ATTR, CPUTraits, MatmulRule, Rule, ScheduleCPU,
    schedule_module, schedule_primfunc, x86_target)
from tvm_distx.layout import TensorSharding
from locations import TESTS_DIR

DATA = TESTS_DIR / "data"
TARGET = x86_target()


def legalized(op, *shapes: tuple[int, ...]) -> tvm.IRModule:
    """A Relax ``main`` computing ``op`` on float32 inputs, after LegalizeOps."""
    bb = relax.BlockBuilder()
    params = [relax.Var(f"x{n}", relax.TensorType(shape, "float32"))
              for n, shape in enumerate(shapes)]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(op(*params))
        bb.emit_func_output(out)
    return relax.transform.LegalizeOps()(bb.get())


def kernels(mod: tvm.IRModule) -> dict[str, tvm.tirx.PrimFunc]:
    return {gv.name_hint: f for gv, f in mod.functions.items()
            if isinstance(f, tvm.tirx.PrimFunc)}


def run(mod: tvm.IRModule, *inputs: np.ndarray) -> np.ndarray:
    vm = relax.VirtualMachine(tvm.compile(mod, target=TARGET), tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(x) for x in inputs]).numpy()


def scheduled_run(op, ref, *shapes, rule: str, seed: int = 0):
    """Schedule ``op``, check every kernel got ``rule`` and the output equals ``ref``."""
    rng = np.random.default_rng(seed)
    inputs = [rng.standard_normal(shape, dtype="float32") for shape in shapes]
    mod = schedule_module(legalized(op, *shapes), TARGET)
    for name, func in kernels(mod).items():
        assert func.attrs.get(SCHEDULED_ATTR, False), f"{name} was not scheduled"
        assert func.attrs[RULE_ATTR] == rule, name
    np.testing.assert_allclose(run(mod, *inputs), ref(*inputs), rtol=1e-4, atol=1e-4)
    return mod


def script(mod: tvm.IRModule) -> str:
    return "\n".join(f.script() for f in kernels(mod).values())


def softmax(x: np.ndarray, axis: int) -> np.ndarray:
    e = np.exp(x - x.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


# --------------------------------------------------------------------------- rules


def test_matmul_with_relu_epilogue_is_one_register_tiled_parallel_vectorized_kernel():
    mod = scheduled_run(lambda x, w: relax.op.nn.relu(relax.op.matmul(x, w)),
                        lambda x, w: np.maximum(x @ w, 0), (128, 96), (96, 256), rule="matmul")
    (name,) = kernels(mod)
    assert name == "fused_matmul_relu"
    text = script(mod)
    assert "T.parallel" in text and "T.vectorized" in text and "T.unroll" in text
    assert 'scope="local"' in text  # the accumulator tile
    assert "x1_global" in text  # the packed panels of the weight
    # the relu reads the tile, not a full intermediate in memory
    assert "T.max(matmul_intermediate_local" in text


def test_matmul_with_bias_and_relu_epilogue():
    scheduled_run(lambda x, w, b: relax.op.nn.relu(relax.op.add(relax.op.matmul(x, w), b)),
                  lambda x, w, b: np.maximum(x @ w + b, 0), (64, 48), (48, 96), (96,),
                  rule="matmul")


def test_batch_matmul_with_a_per_batch_bias_and_scale_epilogue():
    # a mixture-of-experts layer: each expert (the batch) adds its own bias, then the
    # routing weights scale every (expert, token) row. The expand_dims blocks read only
    # the bias and the weights; computed at the tile loop they covered every batch and
    # the epilogue raced ahead of other tiles (wrong numbers, about 87 here).
    def op(x, w, b, s):
        biased = relax.op.add(relax.op.matmul(x, w), relax.op.expand_dims(b, [1]))
        return relax.op.multiply(biased, relax.op.expand_dims(s, [-1]))

    def ref(x, w, b, s):
        return (x @ w + b[:, None, :]) * s[:, :, None]

    mod = scheduled_run(op, ref, (4, 8, 96), (4, 96, 64), (4, 64), (4, 8), rule="matmul")
    assert "expand_dims" not in script(mod)  # both inlined into the epilogue


def test_matmul_with_an_epilogue_that_reads_a_value_twice():
    # silu(x @ w + b) = t * sigmoid(t): t is read by two epilogue blocks, so it stays in
    # memory (inlining it into the tile store would leave a read of an unwritten buffer)
    def silu(t):
        return t / (1 + np.exp(-t))

    scheduled_run(lambda x, w, b: relax.op.nn.silu(relax.op.add(relax.op.matmul(x, w), b)),
                  lambda x, w, b: silu(x @ w + b), (10, 16), (16, 32), (32,), rule="matmul")


@pytest.mark.parametrize("shapes", [((3, 32, 16), (3, 16, 64)),   # batch matmul
                                    ((3, 32, 16), (16, 64)),      # broadcast weight
                                    ((30, 20), (20, 24)),         # sizes that tile unevenly
                                    ((7, 5), (5, 3))])
def test_batch_and_odd_matmuls(shapes):
    mod = scheduled_run(relax.op.matmul, np.matmul, *shapes, rule="matmul")
    assert "T.parallel" in script(mod)


def run_time_rows(weight_shape: tuple[int, int], product) -> tvm.IRModule:
    """A Relax ``main(x, w)`` of ``product(x, w)``, ``x`` of (n, 64) with n known at run time."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((tvm.tirx.Var("n", "int64"), 64), "float32"))
    w = relax.Var("w", relax.TensorType(weight_shape, "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(product(x, w))
        bb.emit_func_output(out)
    return bb.get()


def test_matmul_with_a_symbolic_row_count():
    mod = run_time_rows((64, 96), lambda x, w: relax.op.nn.relu(relax.op.matmul(x, w)))
    mod = schedule_module(relax.transform.LegalizeOps()(mod), TARGET)
    (func,) = kernels(mod).values()
    assert func.attrs[RULE_ATTR] == "matmul"
    rng = np.random.default_rng(1)
    for n in (1, 10):
        xs = rng.standard_normal((n, 64), dtype="float32")
        ws = rng.standard_normal((64, 96), dtype="float32")
        np.testing.assert_allclose(run(mod, xs, ws), np.maximum(xs @ ws, 0), rtol=1e-4, atol=1e-4)


def update_block(text: str) -> str:
    """The micro-kernel's block (``matmul_update``) of a kernel's script."""
    start = text.index('T.sblock("matmul_update")')
    return text[start:text.index("T.sblock", start + 1)]


@pytest.mark.parametrize("epilogue", ["none", "silu_times"])
def test_a_linear_of_run_time_rows_runs_row_panels(epilogue):
    """A prompt times an (out, in) weight: the tokens are the vectors, the weight stays put.

    The rows are packed into panels of two vectors (padded to whole panels), the weight
    is read in place (never copied), the tile's weight rows are unrolled, the
    micro-kernel carries no predicate, and odd row counts equal numpy, the epilogue too.
    With AVX-512 a second micro-kernel of one-vector panels takes the row counts that
    two-vector panels would pad most (1 and 7 rows here; 129 takes the long panels).
    """
    def product(x, w):
        y = relax.op.matmul(x, relax.op.permute_dims(w))
        return relax.op.multiply(relax.op.nn.silu(y), y) if epilogue == "silu_times" else y

    mod = schedule_module(legalize_ops(run_time_rows((128, 64), product)), TARGET)
    (func,) = kernels(mod).values()
    assert func.attrs[RULE_ATTR] == "matmul"
    text = func.script()
    cpu = CPUTraits.of(TARGET)
    lanes = cpu.lanes("float32")
    tile = 8 if cpu.vector_bits >= 512 else 6
    widths = (lanes, 2 * lanes) if cpu.vector_bits >= 512 else (2 * lanes,)
    for panel in widths:
        assert re.search(rf"x_pad(_1)? = T.sblock_alloc_buffer\(\(\(n \+ T.int64\({panel - 1}\)\) "
                         rf"// T.int64\({panel}\), T.int64\(64\), T.int64\(", text), panel
        assert f"T.vectorized(T.int64({panel}))" in text
    if len(widths) == 2:  # the kernel chooses by the rows each would pad
        assert f"if (n + T.int64({2 * lanes - 1})) // T.int64({2 * lanes}) * T.int64(" \
            f"{2 * lanes}) * T.int64(8) > (n + T.int64({lanes - 1}))" in text
    assert "w_global" not in text and "* w[" in text  # the weight, read where it is
    kernel = update_block(text)
    assert "T.where" not in kernel
    assert f"in T.unroll(T.int64({tile}))" in text
    rng = np.random.default_rng(2)
    ws = rng.standard_normal((128, 64), dtype="float32")
    for n in (1, 7, 129):
        xs = rng.standard_normal((n, 64), dtype="float32")
        want = xs @ ws.T
        if epilogue == "silu_times":
            want = want / (1 + np.exp(-want)) * want
        np.testing.assert_allclose(run(mod, xs, ws), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [3, 16, 40])
def test_row_panels_with_static_rows_batches_and_a_bias(rows):
    """Static row counts (within one vector, whole panels, padded), a batch axis, a bias."""
    shapes = [(2, rows, 48), (40, 48), (40,)]
    bb = relax.BlockBuilder()
    x, w, b = (relax.Var(name, relax.TensorType(shape, "float32"))
               for name, shape in zip("xwb", shapes))
    with bb.function("main", [x, w, b]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.add(
                relax.op.matmul(x, relax.op.permute_dims(w)), b))
        bb.emit_func_output(out)
    mod = schedule_module(legalize_ops(bb.get()), TARGET)
    (func,) = kernels(mod).values()
    assert func.attrs[RULE_ATTR] == "matmul"
    text = func.script()
    lanes = CPUTraits.of(TARGET).lanes("float32")
    panel = lanes if rows <= lanes else 2 * lanes
    assert f"T.vectorized(T.int64({panel}))" in update_block(text)
    assert "w_global" not in text
    inputs = [np.random.default_rng(rows).standard_normal(shape, dtype="float32")
              for shape in shapes]
    want = inputs[0] @ inputs[1].T + inputs[2]
    np.testing.assert_allclose(run(mod, *inputs), want, rtol=1e-4, atol=1e-4)


def test_row_panels_can_be_turned_off():
    rule = MatmulRule(row_panels=False)
    mod = legalize_ops(run_time_rows((128, 64), lambda x, w: relax.op.matmul(
        x, relax.op.permute_dims(w))))
    out = ScheduleCPU(TARGET, (rule,))(mod)
    assert "w_global" in script(out)  # the column panels pack the weight


def test_elementwise_kernel_is_parallel_and_vectorized():
    mod = scheduled_run(lambda x, y: relax.op.nn.relu(relax.op.add(x, y)),
                        lambda x, y: np.maximum(x + y, 0), (256, 128), (256, 128),
                        rule="injective")
    text = script(mod)
    assert "T.parallel" in text and "T.vectorized" in text


def test_an_elementwise_kernel_of_run_time_rows_vectorizes_each_row():
    """A prompt's rows: the static features are the vector, the run-time rows run around it."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 8, tvm.tirx.Var("n", "int64"), 64), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.relu(relax.op.permute_dims(x, [0, 2, 1, 3])))
        bb.emit_func_output(out)
    mod = schedule_module(legalize_ops(bb.get()), TARGET)
    (func,) = kernels(mod).values()
    assert func.attrs[RULE_ATTR] == "injective"
    text = func.script()
    assert "T.vectorized(T.int64(64))" in text
    if CPUTraits.of(TARGET).cores > 1:
        assert "T.parallel(" in text
    xs = np.random.default_rng(4).standard_normal((1, 8, 5, 64), dtype="float32")
    np.testing.assert_array_equal(run(mod, xs), np.maximum(xs.transpose(0, 2, 1, 3), 0))


def test_an_empty_slice_in_an_elementwise_kernel_is_scheduled():
    """A partial rotary embedding keeps a slice of nothing (phi3's, whole-head rotary)."""
    def op(x):
        empty = relax.op.strided_slice(x, axes=[1], begin=[16], end=[16])
        return relax.op.concat([relax.op.negative(x), empty], axis=1)

    scheduled_run(op, lambda x: -x, (4, 16), rule="injective")


@pytest.mark.parametrize("axis", [1, 0])
def test_sum_reduction(axis):
    mod = scheduled_run(lambda x: relax.op.sum(x, axis=[axis]), lambda x: x.sum(axis),
                        (64, 256), rule="reduction")
    text = script(mod)
    assert "T.parallel" in text and "T.vectorized" in text
    # along the rows: rfactor into vector lanes; down the columns: columns in lanes
    assert ("x0_red_rf" in text) == (axis == 1)


@pytest.mark.parametrize("axis", [-1, 0])
def test_softmax_after_legalize_ops(axis):
    mod = scheduled_run(lambda x: relax.op.nn.softmax(x, axis=axis),
                        lambda x: softmax(x, axis), (64, 128), rule="reduction")
    text = script(mod)
    assert "T.parallel" in text and "T.vectorized" in text


def test_layer_norm():
    def reference(x, g, b):
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) / np.sqrt(var + 1e-5) * g + b

    scheduled_run(lambda x, g, b: relax.op.nn.layer_norm(x, g, b, axes=[-1]), reference,
                  (64, 128), (128,), (128,), rule="reduction")


# --------------------------------------------------------------------------- fallbacks


@T.prim_func(private=True, s_tir=True)
def _prefix_sum(a: T.Buffer((64,), "float32"), b: T.Buffer((64,), "float32")):
    for i in range(64):
        with T.sblock("scan"):
            vi = T.axis.spatial(64, i)
            T.reads(a[vi], b[vi - 1])
            T.writes(b[vi])
            b[vi] = T.if_then_else(vi == 0, a[vi], b[vi - 1] + a[vi])


def test_an_unmatched_kernel_keeps_the_default_lowering_and_is_logged(caplog):
    mod = tvm.IRModule({"prefix_sum": _prefix_sum})
    with caplog.at_level(logging.INFO, logger="tvm_distx.compiler.schedule"):
        out = ScheduleCPU(TARGET)(mod)
    assert "no rule matches prefix_sum" in caplog.text
    tvm.ir.assert_structural_equal(out["prefix_sum"], _prefix_sum)
    a = np.arange(64, dtype="float32")
    b = tvm.runtime.tensor(np.zeros(64, "float32"))
    lib = tvm.compile(tvm.IRModule({"main": out["prefix_sum"].with_attr("global_symbol", "main")}),
                      target=TARGET)
    lib["main"](tvm.runtime.tensor(a), b)
    np.testing.assert_allclose(b.numpy(), np.cumsum(a))


def test_a_routers_top_k_is_built_as_written_and_its_scatter_scheduled():
    """A mixture of experts' routing: TVM writes top-k as a sort call (built as written); the
    scatter of its weights is element-wise (``tvm_distx.compiler.operator_rules``), fused."""
    bb = relax.BlockBuilder()
    logits = relax.Var("logits", relax.TensorType((tvm.tirx.Var("n", "int64"), 8), "float32"))
    with bb.function("main", [logits]):
        with bb.dataflow():
            top = bb.emit(relax.op.topk(logits, 2, axis=-1))
            values, index = bb.emit(relax.TupleGetItem(top, 0)), bb.emit(relax.TupleGetItem(top, 1))
            out = bb.emit_output(relax.op.scatter_elements(
                relax.op.zeros_like(logits), index, values, axis=1))
        bb.emit_func_output(out)
    mod = schedule_module(legalize_ops(bb.get()), TARGET)
    rules = {name: str(f.attrs[RULE_ATTR]) for name, f in kernels(mod).items()}
    assert rules == {"topk": AS_WRITTEN, "fused_zeros_scatter_elements": "injective"}, rules
    x = np.random.default_rng(3).standard_normal((5, 8), dtype="float32")
    want = np.zeros_like(x)
    top2 = np.argsort(-x, axis=1)[:, :2]
    np.put_along_axis(want, top2, np.take_along_axis(x, top2, axis=1), axis=1)
    np.testing.assert_array_equal(run(mod, x), want)


class _VectorizeTheReduction(Rule):
    """A broken recipe: vectorizing a reduction loop is illegal."""

    name = "broken"

    def match(self, blocks):
        return blocks

    def apply(self, sch, found, cpu):
        sch.vectorize(sch.get_loops(found[0].rv)[-1])
        return sch


def test_a_failing_recipe_falls_back_and_is_logged(caplog):
    (func,) = kernels(legalized(lambda x: relax.op.sum(x, axis=[1]), (8, 32))).values()
    with caplog.at_level(logging.INFO, logger="tvm_distx.compiler.schedule"):
        assert schedule_primfunc(func, TARGET, name="sum", rules=[_VectorizeTheReduction()]) is None
    assert "the broken recipe failed on sum" in caplog.text


class _FallsBackToAnother(Rule):
    """A recipe that hands the kernel to another rule's recipe and says so."""

    name = "first-choice"

    def match(self, blocks):
        return blocks

    def apply(self, sch, found, cpu):
        return Schedule(sch.mod["main"].with_attr(RULE_ATTR, "the-other"))


def test_a_recipe_that_falls_back_names_the_rule_that_scheduled_the_kernel():
    (func,) = kernels(legalized(lambda x: relax.op.sum(x, axis=[1]), (8, 32))).values()
    out = schedule_primfunc(func, TARGET, name="sum", rules=[_FallsBackToAnother()])
    assert str(out.attrs[RULE_ATTR]) == "the-other" and out.attrs[SCHEDULED_ATTR]


def test_scheduled_kernels_are_skipped_and_the_input_module_is_untouched():
    mod = legalized(relax.op.matmul, (16, 16), (16, 32))
    before = kernels(mod)["matmul"]
    once = ScheduleCPU(TARGET)(mod)
    tvm.ir.assert_structural_equal(kernels(mod)["matmul"], before)
    assert kernels(once)["matmul"].attrs[SCHEDULED_ATTR]
    tvm.ir.assert_structural_equal(ScheduleCPU(TARGET)(once), once)


def test_the_tile_divides_the_output():
    rule, cpu = MatmulRule(), CPUTraits.of(TARGET)
    for m, n in [(1024, 1024), (128, 64), (30, 24), (7, 5)]:
        mr, nr = rule.tile(m, n, cpu, "float32")
        assert m % mr == 0 and n % nr == 0


def test_x86_target_names_the_host_cpu():
    target = x86_target(2)
    assert target.kind.name == "llvm"
    assert target.attrs["mcpu"] == tvm.target.codegen.llvm_get_system_cpu()
    assert int(target.attrs["num-cores"]) == 2


# --------------------------------------------------------------------------- the TP MLP


def test_scheduled_tensor_parallel_mlp_equals_numpy_on_two_emulated_ranks(tmp_path):
    mod = td.load_module(DATA / "seed_tensor_parallel.py")
    rules = [ShardingRule(param="A", result="S[1]", function="mlp"),
             ShardingRule(param="B", result="S[0]", function="mlp"),
             ShardingRule(callee="mlp", result="S[0]", function="main")]
    ranks = td.lower_to_ranks(AnnotateSharding(rules)(mod), dump_dir=tmp_path)
    scheduled = schedule_module(ranks, TARGET)
    local = kernels(scheduled)
    assert local and all(f.attrs.get(SCHEDULED_ATTR, False) for f in local.values())
    assert any(name.startswith("fused_matmul") for name in local)  # relu fused as epilogue

    propagated = tvm.script.from_source((tmp_path / "02_propagate_sharding.py").read_text())
    params = propagated["main"].params
    rng = np.random.default_rng(11)
    x, A, B = (0.1 * rng.standard_normal((128, 128), dtype="float32") for _ in range(3))
    shards = [[shard_array(v, TensorSharding.from_type(p.ty), d) for v, p in zip((x, A, B), params)]
              for d in (0, 1)]
    outs = emulate(tvm.compile(scheduled, target=TARGET), shards, [0, 1])

    def mlp(v):
        return np.maximum(v @ A, 0) @ B

    want = mlp(mlp(x))
    out_sharding = TensorSharding.from_type(propagated["main"].ty.ret)
    for device, out in zip((0, 1), outs):
        np.testing.assert_allclose(out, shard_array(want, out_sharding, device), atol=1e-5)


# --------------------------------------------------------------------------- matvec
def _linear_module(rows, depth, width, bias: bool):
    """``silu(x @ w.T (+ b))`` with ``w`` stored (out, in), legalized as compile does."""
    from tvm_distx.compiler.pipeline import legalize_ops

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((rows, depth), "float32"))
    w = relax.Var("w", relax.TensorType((width, depth), "float32"))
    b = relax.Var("b", relax.TensorType((width,), "float32"))
    with bb.function("main", [x, w, b] if bias else [x, w]):
        with bb.dataflow():
            y = relax.op.matmul(x, relax.op.permute_dims(w))
            out = bb.emit_output(relax.op.nn.silu(relax.op.add(y, b) if bias else y))
        bb.emit_func_output(out)
    return legalize_ops(bb.get())


@pytest.mark.parametrize("rows, depth, width, bias", [(1, 256, 96, True), (3, 100, 64, False),
                                                      (4, 64, 30, True), (2, 4096, 12, True)])
def test_a_few_rows_times_an_out_in_weight_read_once_in_parallel(rows, depth, width, bias):
    mod = schedule_module(_linear_module(rows, depth, width, bias), TARGET)
    rules = {f.attrs[RULE_ATTR] for f in kernels(mod).values()}
    assert "matvec" in rules, rules
    text = script(mod)
    assert "T.parallel" in text and "T.vectorized" in text
    assert "w_global" not in text  # the weight is read in place, never packed
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, depth), dtype="float32")
    w = rng.standard_normal((width, depth), dtype="float32")
    b = rng.standard_normal((width,), dtype="float32")
    t = x @ w.T + (b if bias else 0)
    got = run(mod, *([x, w, b] if bias else [x, w]))
    with np.errstate(over="ignore"):  # silu of a large negative t is 0
        want = t / (1 + np.exp(-t))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def _attention_module(heads, length, dim):
    """One decoded query against a cache: ``softmax(q @ k^T * s, masked) @ v``, legalized."""
    from tvm_distx.compiler.pipeline import legalize_ops

    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType((1, heads, 1, dim), "float32"))
    k = relax.Var("k", relax.TensorType((1, heads, length, dim), "float32"))
    v = relax.Var("v", relax.TensorType((1, heads, length, dim), "float32"))
    m = relax.Var("m", relax.TensorType((1, 1, 1, length), "bool"))
    with bb.function("main", [q, k, v, m]):
        with bb.dataflow():
            keys = bb.emit(relax.op.permute_dims(k, [0, 1, 3, 2]))
            scores = bb.emit(relax.op.multiply(relax.op.matmul(q, keys),
                                               relax.const(0.125, "float32")))
            masked = bb.emit(relax.op.where(m, scores, relax.const(-1e30, "float32")))
            probs = bb.emit(relax.op.nn.softmax(masked, axis=-1))
            out = bb.emit_output(relax.op.matmul(probs, v))
        bb.emit_func_output(out)
    return legalize_ops(bb.get())


def test_attention_of_one_query_runs_as_the_attention_kernel():
    heads, length, dim = 4, 96, 32
    mod = schedule_module(_attention_module(heads, length, dim), TARGET)
    rules = [f.attrs[RULE_ATTR] for f in kernels(mod).values()]
    assert rules == ["attention"], rules
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s, dtype="float32")
               for s in ((1, heads, 1, dim), (1, heads, length, dim), (1, heads, length, dim)))
    m = (np.arange(length) < 40).reshape(1, 1, 1, length)
    s = np.where(m, q @ k.transpose(0, 1, 3, 2) * 0.125, -1e30)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ v
    np.testing.assert_allclose(run(mod, q, k, v, m), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rows", [8, None])  # more rows, or a symbolic count: a matrix product
def test_many_or_symbolic_rows_stay_a_matrix_product(rows):
    mod = _linear_module(rows if rows else tvm.tirx.Var("n", "int64"), 64, 32, False)
    rules = {f.attrs[RULE_ATTR] for f in kernels(schedule_module(mod, TARGET)).values()}
    assert "matmul" in rules and "matvec" not in rules, rules
