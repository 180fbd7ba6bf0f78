"""The compile cache: a second start of the same model skips the trace and the compile.

Each test has a cache directory of its own (the suite turns the default one off). The
key holds the weights' identity: files for a checkpoint (linked), bytes for ``from_hf``
(copied); another model's weights never come out of an entry, and a corrupt entry is
built again. A model started from the cache still exports, to any target.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tvm_distx.bundle.manifest import read_manifest  # noqa: E402
from tvm_distx.errors import ArgumentError  # noqa: E402
from tvm_distx.llm.causal_lm import CausalLM  # noqa: E402
from tvm_distx.llm.compile_cache import ENTRY_FILE  # noqa: E402

from hf_tiny import build, greedy, prompt_ids  # noqa: E402
from rvv_tools import require_tools  # noqa: E402

PROMPT = prompt_ids(5, seed=3)
NEW = 8


def _entries(cache) -> list:
    return sorted(p for p in cache.iterdir() if (p / ENTRY_FILE).is_file())


@pytest.fixture
def checkpoint(tmp_path):
    model = build("llama", layers=1)
    model.save_pretrained(tmp_path / "ckpt")
    return model, tmp_path / "ckpt"


def test_a_second_start_comes_from_the_cache_and_is_much_faster(checkpoint, tmp_path):
    model, directory = checkpoint
    cache = tmp_path / "cache"
    started = time.perf_counter()
    with CausalLM.from_pretrained(directory, 2, backend="emulate", max_length=16,
                                  compile_cache=cache) as lm:
        cold = time.perf_counter() - started
        assert lm.exe is not None
        first = lm.generate(PROMPT, NEW)
    assert len(_entries(cache)) == 1
    started = time.perf_counter()
    with CausalLM.from_pretrained(directory, 2, backend="emulate", max_length=16,
                                  compile_cache=cache) as lm:
        warm = time.perf_counter() - started
        assert lm.exe is None and lm.cached_bundle == _entries(cache)[0]  # no compile
        np.testing.assert_array_equal(lm.generate(PROMPT, NEW), first)
    np.testing.assert_array_equal(first[0], greedy(model, PROMPT, NEW))
    assert cold / warm > 3, (cold, warm)  # loosely; scripts/bench/compile_cache.py measures


def test_changed_weights_or_options_are_another_entry(checkpoint, tmp_path):
    model, directory = checkpoint
    cache = tmp_path / "cache"
    with CausalLM.from_pretrained(directory, 2, backend="emulate", max_length=16,
                                  compile_cache=cache):
        pass
    with CausalLM.from_pretrained(directory, 2, backend="emulate", max_length=24,
                                  compile_cache=cache):
        pass
    assert len(_entries(cache)) == 2  # another cache length: another program
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(-1.0)
    time.sleep(0.01)  # a modification time the file system tells apart
    model.save_pretrained(directory)
    with CausalLM.from_pretrained(directory, 2, backend="emulate", max_length=16,
                                  compile_cache=cache) as lm:
        assert lm.exe is not None  # built again: the weight files changed
        np.testing.assert_array_equal(lm.generate(PROMPT, NEW)[0], greedy(model, PROMPT, NEW))
    assert len(_entries(cache)) == 3


def test_from_hf_keys_the_weights_by_their_bytes_and_a_hit_exports(tmp_path):
    cache = tmp_path / "cache"
    model = build("llama", layers=1)
    with CausalLM.from_hf(model, 2, backend="emulate", max_length=16, compile_cache=cache):
        pass
    with CausalLM.from_hf(model, 2, backend="emulate", max_length=16,
                          compile_cache=cache) as lm:
        assert lm.exe is None
        bundle = lm.export(tmp_path / "copy")  # the entry holds its weights: a copy
    assert not (bundle / ENTRY_FILE).exists()
    with CausalLM.from_bundle(bundle, backend="emulate") as served:
        np.testing.assert_array_equal(served.generate(PROMPT, NEW)[0],
                                      greedy(model, PROMPT, NEW))
    other = build("llama", layers=1)
    with torch.no_grad():
        other.lm_head.weight.add_(0.5)
    with CausalLM.from_hf(other, 2, backend="emulate", max_length=16,
                          compile_cache=cache) as lm:
        assert lm.exe is not None  # other bytes, another entry: never the first model's
        np.testing.assert_array_equal(lm.generate(PROMPT, NEW)[0], greedy(other, PROMPT, NEW))


def test_a_corrupt_entry_is_detected_and_built_again(checkpoint, tmp_path, caplog):
    model, directory = checkpoint
    cache = tmp_path / "cache"
    with CausalLM.from_pretrained(directory, 2, backend="emulate", max_length=16,
                                  compile_cache=cache):
        pass
    (entry,) = _entries(cache)
    library = read_manifest(entry).library_path
    data = bytearray(library.read_bytes())
    data[len(data) // 2] ^= 0xFF
    library.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="tvm_distx.llm.causal_lm"):
        with CausalLM.from_pretrained(directory, 2, backend="emulate", max_length=16,
                                      compile_cache=cache) as lm:
            assert lm.exe is not None
            np.testing.assert_array_equal(lm.generate(PROMPT, NEW)[0],
                                          greedy(model, PROMPT, NEW))
    assert "is corrupt" in caplog.text
    (entry,) = _entries(cache)
    assert read_manifest(entry).library_path.read_bytes() != bytes(data)


def test_the_cache_directory_comes_from_the_environment_and_can_be_off(
        checkpoint, tmp_path, monkeypatch):
    _, directory = checkpoint
    monkeypatch.setenv("TVM_DISTX_CACHE", str(tmp_path / "env-cache"))
    with CausalLM.from_pretrained(directory, 2, backend="emulate", max_length=16):
        pass
    assert len(_entries(tmp_path / "env-cache")) == 1
    with CausalLM.from_pretrained(directory, 2, backend="emulate", max_length=16,
                                  compile_cache=False) as lm:
        assert lm.exe is not None and lm.cached_bundle is None
    monkeypatch.setenv("TVM_DISTX_CACHE", "off")
    with CausalLM.from_pretrained(directory, 2, backend="emulate", max_length=16) as lm:
        assert lm.exe is not None and lm.cached_bundle is None


def _rank_files(bundle) -> dict:
    """What a bundle's ranks run, by file: the manifest (its weights' and library's sha256
    included), the rank plan, the cache layouts and the kernels alone."""
    files = {"manifest": json.loads((bundle / "manifest.json").read_text()),
             "generation": json.loads((bundle / "generation.json").read_text())}
    for name in ("plan.json", "kernels/kernels.so"):
        files[name] = hashlib.sha256((bundle / name).read_bytes()).hexdigest()
    return files


def test_a_hit_exports_for_risc_v_the_bundle_the_cold_start_exported(tmp_path):
    """A start from the compile cache holds no program: export traces, shards and compiles
    the model again, for the target asked, and gets the cold start's bundle bit for bit.

    RISC-V bundles run only on (emulated) boards: they are compared file by file, and
    the same exports for this host run and give transformers' tokens.
    """
    require_tools()  # the kernels of an RVV bundle are cross-compiled
    cache = tmp_path / "cache"
    model = build("llama", layers=1)
    with CausalLM.from_hf(model, 2, backend="emulate", max_length=16,
                          compile_cache=cache) as lm:
        assert lm.exe is not None
        cold_rvv = lm.export(tmp_path / "cold-rvv", target="rvv")
        cold_x86 = lm.export(tmp_path / "cold-x86", target="x86")
    with CausalLM.from_hf(model, 2, backend="emulate", max_length=16,
                          compile_cache=cache) as lm:
        assert lm.exe is None and lm.cached_bundle is not None  # a hit
        hit_rvv = lm.export(tmp_path / "hit-rvv", target="rvv")
        hit_x86 = lm.export(tmp_path / "hit-x86", target="x86")  # compiled, not copied
    assert read_manifest(hit_rvv).target == read_manifest(cold_rvv).target
    assert "riscv64" in json.dumps(read_manifest(hit_rvv).target)
    assert _rank_files(hit_rvv) == _rank_files(cold_rvv)
    tokens = []
    for bundle in (cold_x86, hit_x86):
        with CausalLM.from_bundle(bundle, backend="emulate") as served:
            tokens.append(served.generate(PROMPT, NEW)[0])
    np.testing.assert_array_equal(tokens[0], greedy(model, PROMPT, NEW))
    np.testing.assert_array_equal(tokens[1], tokens[0])
    with CausalLM.from_bundle(hit_x86, backend="emulate") as opened:  # no model behind it
        with pytest.raises(ArgumentError, match="opened from a bundle, which holds its "
                           "program compiled for one target and no model to compile again "
                           "for target 'rvv'") as refused:
            opened.export(tmp_path / "refused", target="rvv")
    assert "CausalLM.from_pretrained(...) (or from_hf, from_gguf)" in refused.value.hint
    assert not (tmp_path / "refused").exists()


def test_a_hit_of_a_linked_checkpoint_exports_a_bundle_with_its_weights(checkpoint,
                                                                       tmp_path):
    """The cached bundle of from_pretrained links the checkpoint's files; an export holds
    a copy of the weights, compiled again from the recipe, and gives the same tokens."""
    model, directory = checkpoint
    cache = tmp_path / "cache"
    with CausalLM.from_pretrained(directory, 2, backend="emulate", max_length=16,
                                  compile_cache=cache):
        pass
    with CausalLM.from_pretrained(directory, 2, backend="emulate", max_length=16,
                                  compile_cache=cache) as lm:
        assert lm.exe is None and read_manifest(lm.cached_bundle).weight_links
        bundle = lm.export(tmp_path / "copy")
    assert not read_manifest(bundle).weight_links and read_manifest(bundle).weight_files
    with CausalLM.from_bundle(bundle, backend="emulate") as served:
        np.testing.assert_array_equal(served.generate(PROMPT, NEW)[0],
                                      greedy(model, PROMPT, NEW))
