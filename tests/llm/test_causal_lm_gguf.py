"""CausalLM.from_gguf: llama.cpp's files served in their stored formats on MPI ranks.

Tiny random Llama (grouped-query attention, untied) and Qwen2 (q/k/v biases, tied
embedding) models are written to GGUF in F16, Q8_0 and Q4_0 with the ``gguf``
package (``tests/gguf_files.py``, laid out as llama.cpp's converter writes them).
Served on 2 ranks, each must generate the greedy tokens of transformers run on the
weights the file holds, decoded; this process reads no weight.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from tvm_distx.sources import gguf as gguf_reader  # noqa: E402
from tvm_distx.sources.formats import decode  # noqa: E402
from tvm_distx.llm.causal_lm import CausalLM  # noqa: E402
from tvm_distx.generation.text import Tokenizer  # noqa: E402

from gguf_files import train_tokenizer, write_gguf  # noqa: E402

PROMPT = np.array([[2, 40, 7, 99, 150]])
NEW_TOKENS = 8


def _model(arch: str):
    common = dict(vocab_size=192, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  bos_token_id=0, eos_token_id=1)
    if arch == "llama":
        config = transformers.LlamaConfig(**common, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Qwen2Config(**common, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(config)
    torch.manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return model.eval()


def _decoded_reference(model, path):
    """``model`` with every weight replaced by the file's, decoded to float32."""
    file = gguf_reader.open_gguf(path)
    with torch.no_grad():
        for name, param in model.named_parameters():
            weight = file.tensors[name]
            values = decode({k: np.asarray(v) for k, v in weight.parts.items()}, weight.format)
            param.copy_(torch.from_numpy(values.reshape(param.shape)))
    return model


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(160)


@pytest.mark.parametrize("arch, kind", [("llama", "F16"), ("llama", "Q4_0"), ("qwen2", "Q8_0"),
                                        ("qwen2", "Q4_0")])
def test_a_gguf_file_generates_the_tokens_of_its_decoded_weights(arch, kind, tokenizer, tmp_path,
                                                                 monkeypatch):
    model = _model(arch)
    path = write_gguf(model, tmp_path / f"{arch}.gguf", kind, tokenizer)
    reads = []
    original = gguf_reader.GGUFBlock.read

    def recording(self):
        reads.append(self.tensor)
        return original(self)

    monkeypatch.setattr(gguf_reader.GGUFBlock, "read", recording)
    with CausalLM.from_gguf(path, num_ranks=2, max_length=16) as lm:
        tokens = lm.generate(PROMPT, max_new_tokens=NEW_TOKENS)
        links = lm.session.manifest.weight_links
        held = lm.weight_bytes_per_rank
    assert reads == []  # each rank maps the file and reads its own blocks
    kinds = {link.stored_dtype for link in links}
    assert kind in kinds and "F32" in kinds  # the 2-D weights as stored; the norms F32
    table = [link for link in links if link.tensor == "token_embd.weight"]
    # the table is split on its vocabulary, in blocks of rows: 1/p on each rank
    assert sorted((link.rank, link.start[0], link.stop[0]) for link in table
                  if link.part == "data") == [(0, 0, 96), (1, 96, 192)]
    assert abs(held[0] - held[1]) <= 0.05 * held[0]

    reference = _decoded_reference(model, path)
    want = reference.generate(torch.from_numpy(PROMPT), max_new_tokens=NEW_TOKENS,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
    assert tokens[0].tolist() == want[0].tolist()


def test_a_gguf_file_brings_its_tokenizer_and_a_second_start_comes_from_the_cache(
        tokenizer, tmp_path):
    """The tokenizer in the file's metadata (converted by transformers) encodes as the one it
    was written from, so text goes in and out; the compile cache keys the file by identity."""
    model = _model("llama")
    path = write_gguf(model, tmp_path / "llama.gguf", "Q8_0", tokenizer)
    text = Tokenizer.from_gguf(path)
    sample = "the quick brown fox"
    assert text.encode(sample, add_special_tokens=False) == tokenizer.encode(sample).ids
    assert text.decode(tokenizer.encode(sample).ids) == sample
    cache = tmp_path / "cache"
    with CausalLM.from_gguf(path, num_ranks=2, max_length=24, backend="emulate",
                            compile_cache=cache) as lm:
        assert lm.tokenizer is not None and lm.exe is not None
        first = lm.generate(sample, max_new_tokens=6)
    with CausalLM.from_gguf(path, num_ranks=2, max_length=24, backend="emulate",
                            compile_cache=cache) as lm:
        assert lm.exe is None  # from the cache: no trace, no compile
        assert lm.generate(sample, max_new_tokens=6) == first
