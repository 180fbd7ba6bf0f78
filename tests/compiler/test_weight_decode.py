"""Weights stored in another format are decoded inside the kernels that read them.

:func:`tvm_distx.quantize` writes each decode as Relax operators before the read;
``legalize_ops`` folds the transpose of a linear's decoded ``(out, in)`` weight into
its matmul, :func:`~tvm_distx.compiler.schedule.fuse_kernels` fuses the decode into the
kernel that reads it, and the schedules decode in registers (matvec), into packed
panels (matmul) or only the rows a lookup reads. Every kernel equals numpy on the
decoded weight (:func:`tvm_distx.sources.formats.decode`).
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

import tvm_distx as td
from tvm_distx.compiler.pipeline import legalize_ops
from tvm_distx.compiler.schedule import (RULE_ATTR, CPUTraits, FuseWeightDecodes, schedule_module,
                                      x86_target)
from tvm_distx.sources import formats
from tvm_distx.ir.weight_decode import DECODE_ATTR

TARGET = x86_target()
FORMATS = ["bf16", "f16", "q8", "q4"]
AVX512 = CPUTraits.of(TARGET).vector_bits == 512


def matvec_rule(fmt: str, rows: int) -> str:
    """The rule that schedules a decoded matvec on this host (q4's table on AVX-512)."""
    return "matvec-nibbles" if AVX512 and fmt == "q4" and rows == 1 else "matvec"


def linear(rows, out: int, depth: int, fmt: str, *, bias: bool = False, silu: bool = False):
    """``silu?(x @ W.T (+ b))`` with ``W`` stored in ``fmt``; the module, its weights, ``W``."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((rows, depth), "float32"))
    w = relax.Var("w", relax.TensorType((out, depth), "float32"))
    b = relax.Var("b", relax.TensorType((out,), "float32"))
    with bb.function("main", [x, w, b] if bias else [x, w]):
        with bb.dataflow():
            y = relax.op.matmul(x, relax.op.permute_dims(w))
            y = relax.op.add(y, b) if bias else y
            result = bb.emit_output(relax.op.nn.silu(y) if silu else y)
        bb.emit_func_output(result)
    rng = np.random.default_rng(out + depth)
    weights = {"w": rng.standard_normal((out, depth), dtype="float32"),
               "b": rng.standard_normal((out,), dtype="float32")}
    mod, stored = td.quantize(bb.get(), {"w": weights["w"]}, fmt)
    stored = {name: np.asarray(value) for name, value in stored.items()}
    parts = {"data": stored["w"], "scale": stored.get("w_scale")}
    stored["b"] = weights["b"]
    return mod, stored, formats.decode(parts, fmt)


def kernels(mod: tvm.IRModule) -> dict[str, tvm.tirx.PrimFunc]:
    return {gv.name_hint: f for gv, f in mod.functions.items()
            if isinstance(f, tvm.tirx.PrimFunc)}


def run(mod: tvm.IRModule, stored: dict, x: np.ndarray) -> np.ndarray:
    vm = relax.VirtualMachine(tvm.compile(mod, target=TARGET), tvm.cpu())
    names = [p.name for p in mod["main"].params]
    args = [x if name == "x" else stored[name] for name in names]
    return vm["main"](*[tvm.runtime.tensor(a) for a in args]).numpy()


def silu(t: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return t / (1 + np.exp(-t))


# --------------------------------------------------------------------------- matvec
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows, out, depth", [(1, 96, 256), (3, 30, 96)])
def test_a_matvec_decodes_its_weight_in_registers_in_one_kernel(fmt, rows, out, depth):
    mod, stored, weight = linear(rows, out, depth, fmt)
    built = schedule_module(legalize_ops(mod), TARGET)
    (kernel,) = kernels(built).values()  # the decode is no kernel of its own
    assert kernel.attrs[RULE_ATTR] == matvec_rule(fmt, rows)
    # the kernel reads the stored parts; no buffer of it holds the float weight
    assert {str(p.dtype) for p in kernel.params} == {"float32", formats.FORMATS[fmt].data_dtype}\
        | ({"float16"} if formats.FORMATS[fmt].quantized else set())
    assert f"T.int64({out}), T.int64({depth})), scope" not in kernel.script()
    x = np.random.default_rng(rows).standard_normal((rows, depth), dtype="float32")
    np.testing.assert_allclose(run(built, stored, x), x @ weight.T, rtol=1e-5,
                               atol=1e-5 * np.abs(x @ weight.T).max())


def test_a_decoded_matvec_keeps_its_epilogue_in_the_kernel():
    mod, stored, weight = linear(1, 64, 128, "q4", bias=True, silu=True)
    built = schedule_module(legalize_ops(mod), TARGET)
    (kernel,) = kernels(built).values()
    assert kernel.attrs[RULE_ATTR] == matvec_rule("q4", 1)
    x = np.random.default_rng(0).standard_normal((1, 128), dtype="float32")
    np.testing.assert_allclose(run(built, stored, x), silu(x @ weight.T + stored["b"]),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt, mnemonics", [
    ("q8", ("vpmovsxbd", "vcvtdq2ps", "vfmadd")), ("q4", ("vpmovzxbd", "vcvtdq2ps", "vfmadd")),
    ("f16", ("vcvtph2ps", "vfmadd")), ("bf16", ("vpmovzxwd", "vpslld", "vfmadd"))])
def test_the_x86_matvec_widens_each_format_in_vector_registers(fmt, mnemonics):
    if fmt == "q4" and AVX512:
        mnemonics = ("vpmovzxbd", "vperm", "vfmadd")  # a table per group, not a conversion
    mod, _, _ = linear(1, 64, 512, fmt)
    (kernel,) = kernels(schedule_module(legalize_ops(mod), TARGET)).values()
    asm = tvm.tirx.build(tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")}),
                         target=TARGET).inspect_source("asm")
    words = asm.split()
    for mnemonic in mnemonics:
        assert any(w.startswith(mnemonic) for w in words), (fmt, mnemonic)
    if CPUTraits.of(TARGET).vector_bits == 512:  # the product runs on whole registers
        assert "%zmm" in asm


def nibble_decode(out: int, depth: int, *, high_first: bool = False) -> tvm.IRModule:
    """``x @ W.T`` with ``W`` decoded from q4's parts by hand (nibble order chosen)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, depth), "float32"))
    data = relax.Var("w", relax.TensorType((out, depth // 2), "uint8"))
    scale = relax.Var("w_scale", relax.TensorType((out, depth // 32), "float16"))
    op = relax.op
    with bb.function("main", [x, data, scale]):
        with bb.dataflow():
            packed = bb.emit(op.reshape(data, (out, depth // 32, 1, 16)))
            low = op.bitwise_and(packed, relax.const(15, "uint8"))
            high = op.right_shift(packed, relax.const(4, "uint8"))
            nibbles = op.concat([high, low] if high_first else [low, high], axis=2)
            s = bb.emit(op.reshape(op.astype(scale, "float32"), (out, depth // 32, 1, 1)))
            weight = bb.emit(op.reshape(op.multiply(op.subtract(
                op.astype(nibbles, "float32"), relax.const(8, "float32")), s), (out, depth)))
            result = bb.emit_output(op.matmul(x, op.permute_dims(weight)))
        bb.emit_func_output(result)
    return bb.get()


def nibble_weight(data: np.ndarray, scale: np.ndarray, high_first: bool) -> np.ndarray:
    low, high = data & 15, data >> 4
    out, groups = scale.shape
    halves = [high, low] if high_first else [low, high]
    nibbles = np.concatenate([h.reshape(out, groups, 16) for h in halves], axis=2)
    return (nibbles.astype(np.float32) - 8) * scale.astype(np.float32)[:, :, None]


@pytest.mark.parametrize("out, depth, cores", [(30, 32, 1), (17, 96, 2), (64, 544, 1),
                                               (8, 1024, 2)])
def test_q4_nibbles_decode_through_a_table_at_any_group_count(out, depth, cores):
    """One group, odd counts, scales past a whole vector, two cores: all equal numpy.

    The kernel is built for an AVX-512 CPU on any host; it runs where the host has AVX-512.
    """
    target = x86_target(cores) if AVX512 else tvm.target.Target(
        {"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": cores})
    mod = nibble_decode(out, depth)
    (kernel,) = kernels(schedule_module(legalize_ops(mod), target)).values()
    assert kernel.attrs[RULE_ATTR] == "matvec-nibbles"
    script = kernel.script()
    assert "llvm.x86.avx512.permvar.sf.512" in script
    assert ("T.parallel" in script) == (cores > 1)
    assert f"T.int64({out}), T.int64({depth})), scope" not in script  # no float weight
    lib = tvm.compile(schedule_module(legalize_ops(mod), target), target=target)
    if not AVX512:
        return  # built for AVX-512; this host cannot run it
    rng = np.random.default_rng(depth)
    x = rng.standard_normal((1, depth), dtype="float32")
    data = rng.integers(0, 256, (out, depth // 2), dtype=np.uint8)
    scale = rng.uniform(-2, 2, (out, depth // 32)).astype(np.float16)
    vm = relax.VirtualMachine(lib, tvm.cpu())
    got = vm["main"](*[tvm.runtime.tensor(a) for a in (x, data, scale)]).numpy()
    want = x @ nibble_weight(data, scale, False).reshape(out, depth).T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_a_decode_of_q4s_shapes_that_means_something_else_keeps_the_generic_recipe():
    """The rule evaluates the decode: high nibbles first is not q4, and is not taken for it."""
    mod = nibble_decode(16, 64, high_first=True)
    (kernel,) = kernels(schedule_module(legalize_ops(mod), TARGET)).values()
    assert kernel.attrs[RULE_ATTR] == "matvec"
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 64), dtype="float32")
    data = rng.integers(0, 256, (16, 32), dtype=np.uint8)
    scale = rng.uniform(-2, 2, (16, 2)).astype(np.float16)
    vm = relax.VirtualMachine(tvm.compile(schedule_module(legalize_ops(mod), TARGET),
                                          target=TARGET), tvm.cpu())
    got = vm["main"](*[tvm.runtime.tensor(a) for a in (x, data, scale)]).numpy()
    want = x @ nibble_weight(data, scale, True).reshape(16, 64).T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_float16_widened_by_integer_operations_is_exact_for_every_value():
    """What a target without half-float vectors (RVV without Zvfhmin) runs instead of a call."""
    from tvm import te

    from tvm_distx.compiler.schedule import WidenHalves
    from tvm_distx.compiler.targets import resolve_target

    half = te.placeholder((65536,), "float16", "h")
    out = te.compute((65536,), lambda i: half[i].astype("float32"), name="widen")
    mod = tvm.IRModule({"main": te.create_prim_func([half, out])})
    assert WidenHalves(TARGET)(mod).same_as(mod)  # x86 converts in vector registers
    widened = WidenHalves(resolve_target("rvv").target)(mod)
    assert "T.reinterpret" in widened["main"].script()
    lib = tvm.compile(widened, target=TARGET).mod
    values = np.arange(65536, dtype=np.uint16).view(np.float16)
    got = tvm.runtime.tensor(np.zeros(65536, "float32"))
    lib["main"](tvm.runtime.tensor(values), got)
    want = values.astype(np.float32)
    numbers = ~np.isnan(want)
    np.testing.assert_array_equal(got.numpy()[numbers].view(np.uint32),
                                  want[numbers].view(np.uint32))
    assert np.isnan(got.numpy()[~numbers]).all()


# --------------------------------------------------------------------------- matmul
@pytest.mark.parametrize("fmt", ["q8", "q4", "bf16"])
@pytest.mark.parametrize("rows", [8, None])  # a prompt: static, or symbolic
def test_a_matmul_decodes_its_weight_into_packed_panels(fmt, rows):
    mod, stored, weight = linear(rows or tvm.tirx.Var("n", "int64"), 96, 128, fmt)
    built = schedule_module(legalize_ops(mod), TARGET)
    (kernel,) = kernels(built).values()
    assert kernel.attrs[RULE_ATTR] == "matmul"
    assert "_global" in kernel.script()  # the packed panels, decoded once each
    x = np.random.default_rng(1).standard_normal((rows or 5, 128), dtype="float32")
    np.testing.assert_allclose(run(built, stored, x), x @ weight.T, rtol=1e-5,
                               atol=1e-5 * np.abs(x @ weight.T).max())


# --------------------------------------------------------------------------- lookup
@pytest.mark.parametrize("fmt", ["q8", "q4", "bf16"])
def test_a_lookup_decodes_only_the_rows_it_reads(fmt):
    bb = relax.BlockBuilder()
    ids = relax.Var("ids", relax.TensorType((3,), "int64"))
    table = relax.Var("t", relax.TensorType((128, 64), "float32"))
    with bb.function("main", [ids, table]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.take(table, ids, axis=0))
        bb.emit_func_output(out)
    before = bb.get()
    values = np.random.default_rng(5).standard_normal((128, 64), dtype="float32")
    mod, stored = td.quantize(before, {"t": values}, fmt)
    assert [p.name for p in before["main"].params] == ["ids", "t"]  # the caller's module
    built = schedule_module(legalize_ops(mod), TARGET)
    (kernel,) = kernels(built).values()  # TVM's FuseOps leaves a lookup (opaque) alone
    assert kernel.attrs[RULE_ATTR] == "injective"
    assert "sblock_alloc_buffer" not in kernel.script()  # no decoded table, whole or not
    parts = {"data": np.asarray(stored["t"])}
    if "t_scale" in stored:
        parts["scale"] = np.asarray(stored["t_scale"])
    rows = np.array([5, 77, 127])
    vm = relax.VirtualMachine(tvm.compile(built, target=TARGET), tvm.cpu())
    got = vm["main"](*[tvm.runtime.tensor(a) for a in [rows, *parts.values()]]).numpy()
    np.testing.assert_array_equal(got, formats.decode(parts, fmt)[rows])


def test_a_lookup_of_rows_whose_count_its_operands_do_not_define_takes_the_extent_in():
    """A batch's ``(3, n)`` token ids flattened to ``3 * n`` rows: the fused kernel's
    operands use ``n`` without defining it, so it is passed in as a shape operand."""
    n = tvm.tirx.Var("n", "int64")
    bb = relax.BlockBuilder()
    ids = relax.Var("ids", relax.TensorType((3, n), "int64"))
    table = relax.Var("t", relax.TensorType((128, 64), "float32"))
    with bb.function("main", [ids, table]):
        with bb.dataflow():
            flat = bb.emit(relax.op.reshape(ids, (3 * n,)))
            out = bb.emit_output(relax.op.take(table, flat, axis=0))
        bb.emit_func_output(out)
    values = np.random.default_rng(6).standard_normal((128, 64), dtype="float32")
    mod, stored = td.quantize(bb.get(), {"t": values}, "f16")
    built = schedule_module(legalize_ops(mod), TARGET)
    assert any(name.startswith("fused_decode_") for name in kernels(built))
    rows = np.random.default_rng(7).integers(0, 128, size=(3, 5))
    vm = relax.VirtualMachine(tvm.compile(built, target=TARGET), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(rows), tvm.runtime.tensor(np.asarray(stored["t"])))
    np.testing.assert_array_equal(got.numpy(),
                                  np.asarray(stored["t"]).astype("float32")[rows.reshape(-1)])


# --------------------------------------------------------------------------- fusion
def test_fuse_weight_decodes_groups_a_decode_with_its_one_reader_and_marks_its_blocks():
    mod, _, _ = linear(1, 32, 64, "q8")
    fused = relax.transform.FuseTIR()(relax.transform.FuseOps()(
        relax.transform.AnnotateTIROpPattern()(legalize_ops(mod))))
    assert len(kernels(fused)) == 2  # TVM's fusion keeps the decode apart
    grouped = relax.transform.FuseTIR()(FuseWeightDecodes()(fused))
    grouped = relax.transform.DeadCodeElimination()(grouped)
    (name,) = kernels(grouped)
    assert name == "fused_decode_matmul_weight_transposed"
    script = grouped[name].script()
    assert DECODE_ATTR in script and "sblock(\"matmul\")" in script
    (call,) = [b.value for block in grouped["main"].body.blocks for b in block.bindings]
    assert [a.name for a in call.args[1].fields] == ["w", "w_scale", "x"]


def test_a_decode_read_twice_or_by_a_non_kernel_stays_apart():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 64), "float32"))
    w = relax.Var("w", relax.TensorType((64, 64), "float16"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            decoded = relax.op.astype(w, "float32")
            out = bb.emit_output(relax.op.add(relax.op.matmul(x, decoded),
                                              relax.op.sum(decoded, axis=[0])))
        bb.emit_func_output(out)
    fused = relax.transform.FuseTIR()(relax.transform.FuseOps()(
        relax.transform.AnnotateTIROpPattern()(relax.transform.LegalizeOps()(bb.get()))))
    assert FuseWeightDecodes()(fused).same_as(fused)


# --------------------------------------------------------------------------- a model
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_llama():
    """One layer, tied embedding; its FFN (128) splits into whole groups on 2 ranks."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(config).eval()


def decoded_model(model, stored: dict):
    """``model`` with each stored weight replaced by its decoded values (the reference)."""
    with torch.no_grad():
        for name, param in model.named_parameters(remove_duplicate=False):
            key = "p_model_" + name.replace(".", "_")
            part = stored.get(key)
            if isinstance(part, formats.EncodedPart):
                parts = {"data": np.asarray(part)}
                if part.fmt.quantized:
                    parts["scale"] = np.asarray(stored[key + "_scale"])
                param.copy_(torch.from_numpy(formats.decode(parts, part.fmt)))
    return model


def test_a_q4_tiny_llama_on_two_ranks_decodes_in_its_kernels_and_equals_transformers(
        tiny_llama):
    from tvm_distx import export_decoder
    from tvm_distx.ir.weight_decode import is_decode_kernel, weight_params
    from tvm_distx.plans import presets

    program = export_decoder(tiny_llama, max_length=16)
    annotated = presets.set_device_meshes(program.mod, [(2,)])
    for function in ("prefill", "decode"):
        annotated = presets.tensor_parallel().apply(annotated, function)
    mod, stored = td.quantize(annotated, program.weights, "q4")
    exe = td.compile(mod)
    # every kernel is scheduled by a rule, and no kernel decodes a weight on its own
    unscheduled = [name for name, f in kernels(exe.built).items()
                   if f.attrs is None or RULE_ATTR not in f.attrs]
    assert not unscheduled
    for gv, func in exe.built.functions.items():
        if isinstance(func, relax.Function):
            params = weight_params(func)
            for block in func.body.blocks:
                for b in block.bindings:
                    assert not is_decode_kernel(b.value, exe.built, params), (gv, b.var)
    rules = {f.attrs[RULE_ATTR] for name, f in kernels(exe.built).items() if "decode" in name}
    # decode, prefill, the table's lookup
    assert {matvec_rule("q4", 1), "matmul", "reduction"} <= rules

    model = decoded_model(tiny_llama, stored)
    ids = np.array([[3, 14, 15, 9]])
    cache = [np.zeros(s, "float32") for s in program.cache.shapes]
    prefill = exe.run(ids, np.arange(4), *cache, params=stored, function="prefill",
                      backend="emulate")
    token = int(prefill[0][0, -1].argmax())
    step = exe.run(np.array([[token]]), np.array([4]), *prefill[1:], params=stored,
                   function="decode", backend="emulate")
    with torch.no_grad():
        want = model(torch.from_numpy(np.concatenate([ids, [[token]]], axis=1))).logits.numpy()
    scale = np.abs(want).max()
    np.testing.assert_allclose(prefill[0], want[:, 3:4], atol=1e-4 * scale, rtol=0)
    np.testing.assert_allclose(step[0], want[:, 4:], atol=1e-4 * scale, rtol=0)
