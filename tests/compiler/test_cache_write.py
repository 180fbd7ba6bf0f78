"""The key-value cache write: rows copied in place, found in an exported decoder.

The implementation (in place and copying) is built alone and compared with
numpy; FuseCacheWrites must find every write of a tiny Llama's ``prefill`` and
``decode`` (the one-hot form the torch frontend gives ``index_copy``); compiled,
each write is a ``call_tir_inplace`` of the row copy, the buffer a call is given
holds the new rows afterwards, and the numbers equal transformers'.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from tvm_distx.compiler.fuse_cache_writes import FuseCacheWrites, cache_writes
from tvm_distx.compiler.schedule import x86_target
from tvm_distx.compiler.schedule.cache_write import (CACHE_WRITE_ATTR, CacheWrite, cache_write,
                                                  cache_write_definition)

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import tvm_distx as td  # noqa: E402
from tvm_distx.plans import presets  # noqa: E402

from hf_tiny import build, tokens as random_ids  # noqa: E402

TARGET = x86_target(1)


def expected(x, index, source):
    out = x.copy()
    for i, j in enumerate(index):
        if 0 <= j < x.shape[2]:
            out[:, :, j] = source[:, :, i]
    return out


@pytest.mark.parametrize("in_place", [True, False])
def test_the_rows_are_written_and_out_of_range_positions_write_nothing(in_place):
    rng = np.random.default_rng(0)
    kernel = CacheWrite(8, "float32", "int64")
    mod = tvm.IRModule({"main": cache_write(kernel, in_place).with_attr("global_symbol",
                                                                         "main")})
    lib = tvm.compile(mod, target=TARGET)
    x = rng.standard_normal((2, 3, 20, 8), dtype=np.float32)
    index = np.array([5, 0, 19, 25, -1], np.int64)
    source = rng.standard_normal((2, 3, 5, 8), dtype=np.float32)
    tensors = [tvm.runtime.tensor(a) for a in (x, index, source)]
    if not in_place:
        tensors.append(tvm.runtime.tensor(np.zeros_like(x)))
    lib["main"](*tensors)
    np.testing.assert_array_equal((tensors[0] if in_place else tensors[3]).numpy(),
                                  expected(x, index, source))
    if not in_place:
        np.testing.assert_array_equal(tensors[0].numpy(), x)  # the input is untouched


def test_the_definition_is_marked_for_the_rank_local_replacement():
    func = cache_write_definition(CacheWrite(16), 1, 2, 64, None)
    assert str(func.attrs[CACHE_WRITE_ATTR]) == "definition"
    assert [tuple(int(d) for d in p.ty.shape) for p in func.params if
            all(isinstance(d, tvm.tirx.IntImm) for d in p.ty.shape)] == [(1, 2, 64, 16)] * 2


@pytest.fixture(scope="module")
def decoder():
    model = build("llama")
    program = td.export_decoder(model, max_length=24)
    annotated = presets.set_device_meshes(program.mod, [(2,)])
    for function in ("prefill", "decode"):
        annotated = presets.tensor_parallel().apply(annotated, function)
    return model, program, annotated


def test_every_write_of_prefill_and_decode_is_found(decoder):
    _, program, _ = decoder
    layers = len(program.cache.names) // 2
    for function in ("prefill", "decode"):
        assert len(cache_writes(program.mod[function])) == 2 * layers
    fused = FuseCacheWrites()(program.mod)
    for function in ("prefill", "decode"):
        text = fused[function].script()
        assert text.count("R.call_tir(cache_write") == 2 * layers
        assert "R.equal" not in text  # the one-hot selections are gone


def test_the_compiled_writes_are_in_place_and_the_tokens_equal_transformers(decoder):
    model, program, annotated = decoder
    exe = td.compile(annotated)
    built = exe.built.script()
    layers = len(program.cache.names) // 2
    assert built.count("R.call_tir_inplace") == 2 * 2 * layers  # prefill and decode
    ids = random_ids(7, seed=4)
    caches = program.cache.zeros()
    logits, *caches = exe.run(ids, np.arange(7), *caches, params=program.weights,
                              function="prefill", backend="emulate")
    with torch.no_grad():
        out = model(torch.from_numpy(ids), use_cache=True)
    np.testing.assert_allclose(logits[:, -1], out.logits.numpy()[:, -1], atol=1e-4, rtol=0)
    keys = out.past_key_values.layers[0].keys.numpy()
    np.testing.assert_allclose(caches[0][:, :, :7], keys, atol=1e-5, rtol=0)
    assert not caches[0][:, :, 7:].any()  # the rest of the cache is as it was
