"""The board executor equals the VM on the test models: the same final module, the same inputs,
2 ranks as threads (collectives: the emulated backend's, for both).

The test transformer (PyTorch frontend), and a tiny Hugging Face Llama with grouped-query
attention (hidden 128, 2 layers) for ``prefill`` (symbolic sequence length) and ``decode``
(the key-value caches in and out).
"""

from __future__ import annotations

import json
import sys
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import tvm_distx as td  # noqa: E402
from tvm_distx.runtime.board.executor import Executor, Kernels, aligned  # noqa: E402
from tvm_distx.sources.formats import BFLOAT16_BITS, is_bfloat16  # noqa: E402
from tvm_distx.compiler.board_plan import build_board_runtime  # noqa: E402
from tvm_distx.plans import presets  # noqa: E402
from tvm_distx.runtime.collectives import abi_functions  # noqa: E402
from tvm_distx.runtime.emulated import EmulatedCollectives, _Exchange, emulate  # noqa: E402

from locations import TESTS_DIR  # noqa: E402

sys.path.insert(0, str(TESTS_DIR / "models"))
from transformer import Transformer  # noqa: E402

RANKS = (0, 1)


class Compiled:
    """One model compiled for 2 ranks: its VM, and its plan with the same library."""

    def __init__(self, annotated, weights, folder) -> None:
        self.exe = td.compile(annotated)  # the VM's executable and its plan, of one module
        self.weights = weights
        self.vm = self.exe.vm_exec
        self.vm.export_library(str(folder / "lib.so"))
        self.plan = json.loads(json.dumps(self.exe.plan))  # as bundles hold it
        self.kernels = Kernels(str(folder / "lib.so"), str(build_board_runtime(folder)))
        self.bits = False

    def inputs(self, function: str, *inputs) -> list[list[np.ndarray]]:
        """Per rank, every argument of ``function`` (weights included), from global inputs."""
        signature = self.exe.signatures[function]
        values, concrete = signature.bind_sizes(
            list(inputs), self.exe._derived(function, self.weights))
        return [[concrete.rank_input(s, v, d) for s, v in zip(concrete.params, values)]
                for d in RANKS]

    def executor(self, function: str, per_rank: list) -> list:
        exchange = _Exchange(RANKS, 60.0)
        out, errors = [None] * len(RANKS), []

        def rank(device):
            try:
                exchange.local.device, exchange.local.counts = device, {}
                functions = abi_functions(EmulatedCollectives(exchange))
                executor = Executor(self.plan, self.kernels,
                                    lambda name, args: functions[name](*args))
                out[device] = executor.run(function, *per_rank[device])
            except Exception as err:  # noqa: BLE001 - reported below
                errors.append(err)
                exchange.abort(err, device)

        threads = [threading.Thread(target=rank, args=(d,)) for d in RANKS]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return out

    def check(self, function: str, per_rank: list) -> list:
        """Run ``function`` on the VM and on the executor; assert equal; the VM's results.

        With ``bits``, the executor takes bfloat16 arrays as their 16-bit patterns
        (:data:`BFLOAT16_BITS`), as a board's numpy, which has no bfloat16, holds them.
        """
        want = emulate(self.vm, per_rank, RANKS, entry=function)
        if self.bits:
            assert any(is_bfloat16(a.dtype) for a in per_rank[0])
            per_rank = [[a.view(BFLOAT16_BITS) if is_bfloat16(a.dtype) else a for a in args]
                        for args in per_rank]
            assert not any(a.dtype.name == "bfloat16" for a in per_rank[0])
        got = self.executor(function, per_rank)
        for device in RANKS:
            expected = want[device] if isinstance(want[device], tuple) else (want[device],)
            found = got[device] if isinstance(got[device], tuple) else (got[device],)
            assert len(found) == len(expected)
            for a, b in zip(found, expected):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
        return want


def _tensor_parallel(mod, functions=("main",)):
    annotated = presets.set_device_meshes(mod, [(len(RANKS),)])
    for function in functions:
        annotated = presets.tensor_parallel().apply(annotated, function)
    return annotated


@pytest.fixture(scope="module")
def transformer(tmp_path_factory):
    torch.manual_seed(0)
    net = Transformer(layers=1).eval()
    x = torch.randn(2, 16, 256)
    mod, weights = td.from_torch(net, (x,))
    return Compiled(_tensor_parallel(mod), weights, tmp_path_factory.mktemp("transformer")), x


def test_the_test_transformer_equals_the_vm(transformer):
    compiled, x = transformer
    compiled.check("main", compiled.inputs("main", x.numpy()))


def _decoder(model, folder, max_length=32, fmt=None):
    program = td.export_decoder(model, max_length=max_length)
    annotated, weights = _tensor_parallel(program.mod, ("prefill", "decode")), program.weights
    if fmt is not None:  # stored quantized: the kernels decode the weights as they read them
        annotated, weights = td.quantize(annotated, weights, fmt)
    return Compiled(annotated, weights, folder), program.cache


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False, initializer_range=0.2)
    return _decoder(transformers.LlamaForCausalLM(config).eval(), tmp_path_factory.mktemp("l"))


def _prefill_then_decode(compiled, cache, length: int, steps: int) -> None:
    ids = np.random.default_rng(length).integers(0, 128, (1, length), dtype=np.int64)
    empty = [np.zeros(shape, cache.dtype) for shape in cache.shapes]
    results = compiled.check("prefill", compiled.inputs("prefill", ids, np.arange(length),
                                                        *empty))
    for step in range(steps):
        per_rank = compiled.inputs("decode", np.array([[3 + step]]),
                                   np.array([length + step]), *empty)
        for device in RANKS:  # each rank's own caches, as the VM returned them
            caches = [np.asarray(c) for c in results[device][1:]]
            per_rank[device][2:2 + len(caches)] = caches
        results = compiled.check("decode", per_rank)


@pytest.mark.parametrize("length", [1, 7])
def test_a_tiny_llama_prefill_and_decode_equal_the_vm(llama, length):
    compiled, cache = llama
    _prefill_then_decode(compiled, cache, length, steps=2)


@pytest.mark.parametrize("fmt", ["q4", "f16", "bf16", "bf16-bits"])
def test_a_tiny_llama_with_stored_weights_equals_the_vm(tmp_path, fmt):
    """uint8 data and float16 scales or 16-bit weights, as a board holds them (bfloat16 also
    as bit patterns: a board's numpy has no bfloat16)."""
    torch.manual_seed(1)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False, initializer_range=0.2)
    compiled, cache = _decoder(transformers.LlamaForCausalLM(config).eval(), tmp_path,
                               max_length=16, fmt=fmt.removesuffix("-bits"))
    compiled.bits = fmt.endswith("-bits")
    _prefill_then_decode(compiled, cache, 5, steps=1)


def test_a_prompt_longer_than_the_cache_is_the_executors_error_not_a_memory_overrun(llama):
    """Storage is planned for the upper bound of the sequence length; beyond it, an error."""
    from tvm_distx.runtime.board.executor import PlanError

    compiled, cache = llama
    empty = [np.zeros(s, cache.dtype) for s in cache.shapes]
    arguments = [aligned(a) for a in compiled.inputs("prefill", np.zeros((1, 40), np.int64),
                                                      np.arange(40), *empty)[0]]
    executor = Executor(compiled.plan, compiled.kernels, lambda name, args: None)
    with pytest.raises(PlanError, match=r"function 'prefill'.*needs \d+ bytes of a storage"):
        executor.run("prefill", *arguments)
    wrong = list(arguments)
    wrong[1] = wrong[1][:39].copy()  # cache_position shorter than input_ids
    with pytest.raises(PlanError, match=r"function 'prefill'.*match_shape.*cache_position.*"
                       r"expected 40 \(as bound before\)"):
        executor.run("prefill", *wrong)
