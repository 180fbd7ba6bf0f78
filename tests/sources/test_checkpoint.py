"""Hugging Face checkpoints served as they are saved: lazy safetensors reads, one shard at a time."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

from tvm_distx.errors import ArgumentError  # noqa: E402
from tvm_distx.sources import checkpoint  # noqa: E402
from tvm_distx.sources.checkpoint import LazyTensor, open_checkpoint  # noqa: E402


def test_a_lazy_tensor_reads_the_block_its_slices_name(tmp_path):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((6, 8, 4)).astype("float32")
    safetensors_numpy.save_file({"a": a}, tmp_path / "one.safetensors")
    lazy = open_checkpoint(tmp_path)["a"]
    assert lazy.shape == (6, 8, 4) and lazy.dtype == np.float32
    block = lazy[2:5][:, 3:7, ...][1:]  # slices compose without reading
    assert isinstance(block, LazyTensor) and block.shape == (2, 4, 4)
    np.testing.assert_array_equal(np.asarray(block), a[3:5, 3:7])
    np.testing.assert_array_equal(np.asarray(lazy[..., 1:3]), a[..., 1:3])
    with pytest.raises(IndexError, match="step 1"):
        lazy[::2]


def test_bfloat16_checkpoints_are_read_as_float32(tmp_path):
    from safetensors.torch import save_file

    value = torch.arange(12, dtype=torch.float32).reshape(3, 4).to(torch.bfloat16)
    save_file({"w": value}, tmp_path / "bf16.safetensors")
    lazy = open_checkpoint(tmp_path, dtype="float32")["w"]
    assert lazy.stored_dtype == "BF16" and lazy.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(lazy[1:3, 2:]), value.float().numpy()[1:3, 2:])


def test_a_directory_without_safetensors_or_with_a_file_missing(tmp_path):
    with pytest.raises(ArgumentError, match="holds no .safetensors file"):
        open_checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(ArgumentError, match="names model-00001-of-00002.safetensors, which is "
                       "missing"):
        open_checkpoint(tmp_path)


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    """A tiny Llama with tied embeddings, saved by transformers in several safetensors files."""
    torch.manual_seed(3)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(config).eval()
    directory = tmp_path_factory.mktemp("llama")
    model.save_pretrained(directory, max_shard_size="60KB")
    assert len(list(directory.glob("*.safetensors"))) >= 2
    return model, directory


def test_from_pretrained_generates_transformers_tokens_each_rank_reading_its_own_blocks(
        saved_llama, monkeypatch):
    from tvm_distx.llm.causal_lm import CausalLM

    model, directory = saved_llama
    reads = []
    original = checkpoint.LazyTensor.read

    def recording(self):
        reads.append((self.key, self.bounds))
        return original(self)

    monkeypatch.setattr(checkpoint.LazyTensor, "read", recording)
    prompt = np.array([[5, 17, 99, 4]])
    want = model.generate(torch.from_numpy(prompt), max_new_tokens=16, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0].tolist()
    with CausalLM.from_pretrained(directory, num_ranks=2, max_length=24) as lm:
        manifest = lm.session.manifest
        out = lm.generate(prompt, max_new_tokens=16)
    assert out[0].tolist() == want
    # this process read no weight: each rank reads its own blocks from the checkpoint
    assert reads == []
    # the bundle stores only what no checkpoint holds: each rank's vocabulary offset
    assert manifest.weight_files and all(
        w.name.endswith("_vocab_offsets") for w in manifest.weight_files)
    shapes = {k: v.shape for k, v in open_checkpoint(directory).items()}
    links = {(link.rank, link.tensor): link for link in manifest.weight_links}
    q = "model.layers.0.self_attn.q_proj.weight"  # (out, in), its rows split over 2 ranks
    rows = shapes[q][0]
    assert [(links[r, q].start, links[r, q].stop) for r in (0, 1)] == [
        ((0, 0), (rows // 2, shapes[q][1])), ((rows // 2, 0), (rows, shapes[q][1]))]
    for link in manifest.weight_links:
        assert link.checkpoint.startswith(str(directory.resolve())) and link.tensor in shapes
    # an exported bundle is self-contained: the shards are copied, one read per rank's block
    with CausalLM.from_pretrained(directory, num_ranks=2, max_length=24) as lm:
        bundle = lm.export(directory.parent / "bundle")
    for key, bounds in reads:
        assert bounds != tuple((0, d) for d in shapes[key]) or key not in {
            q, "model.layers.1.mlp.down_proj.weight", "model.layers.0.mlp.gate_proj.weight"}
    assert {key for key, _ in reads} <= set(shapes)
    assert sorted(p.name for p in (bundle / "weights").iterdir()) == [
        "rank0.safetensors", "rank1.safetensors"]
    with CausalLM.from_bundle(bundle) as lm:
        assert lm.generate(prompt, max_new_tokens=16)[0].tolist() == want


def test_from_pretrained_refuses_a_checkpoint_that_lacks_a_weight(saved_llama, tmp_path):
    from tvm_distx.llm.causal_lm import CausalLM

    model, directory = saved_llama
    tensors = {k: np.asarray(v) for k, v in open_checkpoint(directory).items()
               if k != "model.norm.weight"}
    safetensors_numpy.save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    with pytest.raises(ArgumentError, match="has no tensor model.norm.weight"):
        CausalLM.from_pretrained(tmp_path, num_ranks=2, max_length=16)
    with pytest.raises(ArgumentError, match="no config.json"):
        CausalLM.from_pretrained(tmp_path / "nowhere", num_ranks=2)
