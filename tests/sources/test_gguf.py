"""GGUF files read: the config, the tensors in their stored formats, a rank's block at a time."""

from __future__ import annotations

import pickle
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from gguf_files import rotary_permute, train_tokenizer, write_gguf  # noqa: E402
from tvm_distx.sources.formats import decode, encode  # noqa: E402
from tvm_distx.sources.gguf import GGUFBlock, open_gguf  # noqa: E402
from tvm_distx.errors import ArgumentError, ArgumentIndexError  # noqa: E402

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0"]
FORMAT = {"F32": "f32", "F16": "f16", "BF16": "bf16", "Q8_0": "q8", "Q4_0": "q4"}
VOCAB = 192
#: keys of a config that tell nothing about the model
INCIDENTAL = {"architectures", "transformers_version", "_name_or_path", "dtype"}


def _randomize(model, seed: int):
    """Every parameter random, norms and biases too (so a wrong row order shows)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return model.eval()


def _model(arch: str, **overrides):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  bos_token_id=0, eos_token_id=1)
    if arch == "llama":  # GQA, untied, its q/k rows permuted in the file
        config = transformers.LlamaConfig(**{**common, "rms_norm_eps": 1e-5,
                                             "rope_theta": 500000.0,
                                             "tie_word_embeddings": False, **overrides})
        return _randomize(transformers.LlamaForCausalLM(config), 1)
    if arch == "qwen2":  # q/k/v biases, tied embedding
        config = transformers.Qwen2Config(**{**common, "rms_norm_eps": 1e-6,
                                             "rope_theta": 1000000.0,
                                             "tie_word_embeddings": True, **overrides})
        return _randomize(transformers.Qwen2ForCausalLM(config), 2)
    config = transformers.Qwen3Config(**{**common, "head_dim": 32, "rms_norm_eps": 1e-6,
                                         "tie_word_embeddings": True, **overrides})
    return _randomize(transformers.Qwen3ForCausalLM(config), 3)


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(160)


@pytest.fixture(scope="module")
def files(tmp_path_factory, tokenizer):
    """(arch, type) -> (model, path of its GGUF file), written on first use."""
    made = {}
    folder = tmp_path_factory.mktemp("gguf")

    def get(arch: str, kind: str):
        if (arch, kind) not in made:
            model = _model(arch)
            made[arch, kind] = model, write_gguf(model, folder / f"{arch}-{kind}.gguf", kind,
                                                 tokenizer)
        return made[arch, kind]

    return get


def _expected(values: np.ndarray, kind: str) -> np.ndarray:
    """What a tensor of ``values`` written as ``kind`` holds: gguf's own decode of its encoding."""
    if kind == "F32" or values.ndim == 1:
        return values
    if kind == "F16":
        return values.astype(np.float16).astype(np.float32)
    code = gguf.GGMLQuantizationType[kind]
    return gguf.quants.dequantize(gguf.quants.quantize(values, code), code)


def _read(weight) -> np.ndarray:
    return decode({name: np.asarray(part) for name, part in weight.parts.items()},
                  weight.format)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_the_config_is_the_models(files, arch):
    model, path = files(arch, "F16")
    read = open_gguf(path)
    assert read.architecture == arch and read.config["model_type"] == arch
    got = {k: v for k, v in read.hf_config().to_dict().items() if k not in INCIDENTAL}
    want = {k: v for k, v in model.config.to_dict().items() if k not in INCIDENTAL}
    assert got == want
    assert read.config["tie_word_embeddings"] == (arch != "llama")


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_every_tensor_holds_the_written_values_in_its_stored_format(files, arch, kind):
    model, path = files(arch, kind)
    read = open_gguf(path)
    state = {k: v.float().numpy() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        del state["lm_head.weight"]  # the LM head is the embedding
    assert set(read.tensors) == set(state)
    for name, weight in read.tensors.items():
        want = _expected(state[name], kind)
        assert weight.shape == state[name].shape, name
        if state[name].ndim == 1:  # norms and biases: float32, as the converter keeps them
            assert weight.ggml_type == "F32" and weight.format.name == "f32"
        else:
            assert weight.ggml_type == kind and weight.format.name == FORMAT[kind]
            assert weight.format.parts == tuple(weight.parts)
        for part_name, part in weight.parts.items():  # nothing read, our layout's shapes
            assert isinstance(part, GGUFBlock)
            assert part.shape == weight.format.part_shape(part_name, weight.shape)
            array = np.asarray(part)
            assert array.shape == part.shape and array.dtype == part.dtype
        np.testing.assert_array_equal(_read(weight), want, err_msg=name)
        np.testing.assert_array_equal(np.asarray(weight.values), want, err_msg=name)


@pytest.mark.parametrize("kind", ["F32", "Q8_0"])
def test_llama_queries_and_keys_are_unpermuted(files, kind):
    model, path = files("llama", kind)
    stored = {t.name: t for t in gguf.GGUFReader(path).tensors}
    read = open_gguf(path)
    config = model.config
    for layer in range(config.num_hidden_layers):
        for proj, heads in (("q", config.num_attention_heads), ("k", config.num_key_value_heads)):
            hf = model.state_dict()[f"model.layers.{layer}.self_attn.{proj}_proj.weight"].numpy()
            raw = stored[f"blk.{layer}.attn_{proj}.weight"]
            in_file = gguf.quants.dequantize(np.asarray(raw.data), raw.tensor_type)
            # the file holds llama.cpp's order, not Hugging Face's...
            assert not np.array_equal(in_file, _expected(hf, kind))
            np.testing.assert_array_equal(in_file, _expected(rotary_permute(hf, heads), kind))
            # ...and the reader serves Hugging Face's, a block of rows reading its rows
            weight = read.tensors[f"model.layers.{layer}.self_attn.{proj}_proj.weight"]
            np.testing.assert_array_equal(_read(weight), _expected(hf, kind))
            block = {n: np.asarray(p[5:27]) for n, p in weight.parts.items()}
            np.testing.assert_array_equal(decode(block, weight.format), _expected(hf, kind)[5:27])


@pytest.mark.parametrize("kind", ["F16", "BF16", "Q8_0", "Q4_0"])
def test_blocks_read_alone_equal_the_blocks_of_the_whole(files, kind):
    model, path = files("qwen2", kind)
    for name, weight in open_gguf(path).tensors.items():
        for part in weight.parts.values():
            whole = np.asarray(part)
            if part.ndim == 1:
                np.testing.assert_array_equal(np.asarray(part[3:50]), whole[3:50])
                continue
            rows, cols = part.shape
            step = 1 if kind in ("F16", "BF16") else {"data": 32 if kind == "Q8_0" else 16,
                                                      "scale": 1}[part.part]
            for r0, r1 in ((0, rows // 2), (rows // 2, rows), (3, rows - 5)):
                for c0, c1 in ((0, cols // 2 // step * step), (step, cols)):
                    block = part[r0:r1][:, c0:c1]  # slices compose, read nothing
                    assert isinstance(block, GGUFBlock) and block.shape == (r1 - r0, c1 - c0)
                    np.testing.assert_array_equal(np.asarray(block), whole[r0:r1, c0:c1],
                                                  err_msg=f"{name} {part.part}")
        values = np.asarray(weight.values)
        np.testing.assert_array_equal(np.asarray(weight.values[1:3]), values[1:3])
        if values.ndim == 2:
            np.testing.assert_array_equal(np.asarray(weight.values[:, 5:37]), values[:, 5:37])


def _poison_all_but(path, out, tensor, keep: list[tuple[int, int]]):
    """A copy of ``path`` whose tensor's bytes are 0xFF (NaN scales) outside the ``keep`` ranges."""
    shutil.copyfile(path, out)
    info = next(t for t in gguf.GGUFReader(path).tensors if t.name == tensor)
    start, size = int(info.data_offset), int(info.n_bytes)
    mask = np.ones(size, dtype=bool)
    for a, b in keep:
        mask[a:b] = False
    data = np.memmap(out, dtype=np.uint8, mode="r+", offset=start, shape=(size,))
    data[mask] = 0xFF
    data.flush()
    del data


@pytest.mark.parametrize("kind", ["F16", "Q8_0", "Q4_0"])
@pytest.mark.parametrize("hf_name", ["model.layers.1.self_attn.q_proj.weight",
                                     "model.layers.0.mlp.down_proj.weight"])
def test_a_block_reads_only_its_rows_and_groups_of_the_file(files, tmp_path, kind, hf_name):
    model, path = files("llama", kind)
    clean = open_gguf(path).tensors[hf_name]
    rows, cols = clean.shape
    r0, r1, g0, g1 = rows // 4, rows // 2, 1, cols // 32 - 1  # a rank's rows and groups
    values, nbytes = clean.parts["data"].block
    row_bytes = cols // values * nbytes
    file_rows = np.arange(rows)  # the file row of each Hugging Face row
    if ".q_proj." in hf_name:
        file_rows = np.argsort(rotary_permute(file_rows, model.config.num_attention_heads))
    per_group = 32 // values * nbytes  # bytes of a group of 32 values
    keep = [(int(r) * row_bytes + g0 * per_group, int(r) * row_bytes + g1 * per_group)
            for r in file_rows[r0:r1]]
    poisoned = tmp_path / "poisoned.gguf"
    _poison_all_but(path, poisoned, clean.name, keep)
    dirty = open_gguf(poisoned).tensors[hf_name]
    for name, part in dirty.parts.items():
        per = {"data": 32 // clean.format.per_byte, "scale": 1}[name]
        block = (slice(r0, r1), slice(g0 * per, g1 * per))
        np.testing.assert_array_equal(np.asarray(part[block]), np.asarray(clean.parts[name][block]))
    # the poison is there: a block beyond the rank's is not the clean one
    whole = decode({n: np.asarray(p) for n, p in dirty.parts.items()}, dirty.format)
    assert not np.isfinite(whole).all()


def test_a_quantized_block_must_hold_whole_groups(files):
    _, path = files("llama", "Q4_0")
    weight = open_gguf(path).tensors["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(ArgumentIndexError, match="cuts one of its groups of 32 values"):
        weight.parts["data"][:, 8:24]
    with pytest.raises(ArgumentIndexError, match="step 1"):
        weight.parts["scale"][::2]
    weight.parts["scale"][:, 1:2]  # a scale block is any run of groups


def test_opening_and_slicing_read_no_weight(files, monkeypatch):
    _, path = files("qwen2", "Q4_0")

    def refuse(self):
        raise AssertionError(f"{self} read")

    monkeypatch.setattr(GGUFBlock, "read", refuse)
    weight = open_gguf(path).tensors["model.layers.1.mlp.down_proj.weight"]
    block = weight.parts["data"][10:20][:, 16:48][2:]
    assert block.shape == (8, 32) and block.bounds == ((12, 20), (16, 48))
    with pytest.raises(AssertionError, match="read"):
        np.asarray(block)


def test_a_block_survives_pickling_and_json(files):
    _, path = files("llama", "Q8_0")
    part = open_gguf(path).tensors["model.layers.0.self_attn.k_proj.weight"].parts["data"]
    block = part[4:12][:, 32:64]
    for again in (pickle.loads(pickle.dumps(block)), GGUFBlock.from_json(block.to_json())):
        assert again == block
        np.testing.assert_array_equal(np.asarray(again), np.asarray(block))


def test_llama3_rope_scaling_comes_back_from_the_rope_factors(tmp_path, tokenizer):
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    model = _model("llama", rope_parameters=rope)
    read = open_gguf(write_gguf(model, tmp_path / "llama3.gguf", "F16", tokenizer))
    assert read.config["rope_parameters"] == rope
    assert "rope_freqs.weight" not in {w.name for w in read.tensors.values()}


def test_the_tokenizer_is_the_metadatas_and_rebuilds_the_same_ids(files, tokenizer):
    _, path = files("qwen2", "F16")
    read = open_gguf(path).tokenizer
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    assert read.model == "gpt2" and read.pre == "gpt-2" and len(read.tokens) == VOCAB
    assert [read.tokens[i] for i in range(len(vocab))] == sorted(vocab, key=vocab.get)
    assert read.tokens[-1] == f"[PAD{VOCAB - 1}]" and read.token_types[-1] == 5
    assert (read.bos_id, read.eos_id) == (vocab["<|bos|>"], vocab["<|eos|>"])
    assert read.merges and read.chat_template.startswith("{% for")
    rebuilt = read.hf_tokenizer()
    for text in ["The lazy dog runs on two boards.", "quick brown 1234 weights!\n",
                 "<|bos|>A model<|eos|>", "never widened, group by group"]:
        ids = tokenizer.encode(text).ids
        assert rebuilt.encode(text).ids == ids, text
        assert rebuilt.decode(ids, skip_special_tokens=False) == tokenizer.decode(
            ids, skip_special_tokens=False)


def test_tokenizers_of_other_kinds_or_splits_are_refused_clearly():
    from tvm_distx.sources.gguf_tokenizer import GGUFTokenizer

    with pytest.raises(ArgumentError, match="kind 'llama'.*only byte-level BPE"):
        GGUFTokenizer(model="llama", tokens=("a",)).hf_tokenizer()
    with pytest.raises(ArgumentError, match="pre-tokenizer 'mystery'"):
        GGUFTokenizer(model="gpt2", pre="mystery", tokens=("a",)).hf_tokenizer()
    # the Llama 3 and Qwen2 splits: digits in runs of 3, or one at a time
    tokens = ("1", "2", "3", "4", "12", "123")
    for pre, want in (("llama-bpe", [5, 3]), ("qwen2", [0, 1, 2, 3])):
        rebuilt = GGUFTokenizer(model="gpt2", pre=pre, tokens=tokens,
                                merges=("1 2", "12 3")).hf_tokenizer()
        assert rebuilt.encode("1234").ids == want, pre


def _q6_k_bytes(rows: int, cols: int) -> np.ndarray:
    """Random Q6_K blocks of 256 values (210 bytes, a float16 scale last)."""
    rng = np.random.default_rng(7)
    blocks = rng.integers(0, 256, size=(rows, cols // 256, 210), dtype=np.uint8)
    blocks[..., 208:] = np.full(blocks.shape[:-1], 0.01, np.float16)[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def test_other_tensor_types_are_refused_or_requantized_at_load(tmp_path, tokenizer):
    model = _model("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    q6 = _q6_k_bytes(VOCAB, 256)
    path = write_gguf(model, tmp_path / "q6k.gguf", "Q8_0", tokenizer,
                      extra={"output.weight": (q6, gguf.GGMLQuantizationType.Q6_K)})
    with pytest.raises(ArgumentError, match=r"tensor output\.weight is of GGUF type Q6_K.*"
                       r"F32, F16, BF16, Q8_0, Q4_0") as err:
        open_gguf(path)
    assert "llama-quantize" in str(err.value) and "requantize='q8'" in str(err.value)
    read = open_gguf(path, requantize="q8")
    head = read.tensors["lm_head.weight"]
    assert head.ggml_type == "Q6_K" and head.format.name == "q8"
    values = gguf.quants.dequantize(q6, gguf.GGMLQuantizationType.Q6_K)
    np.testing.assert_array_equal(np.asarray(head.values), values)
    np.testing.assert_array_equal(np.asarray(head.values[10:20, 40:300]), values[10:20, 40:300])
    want = encode(values, "q8")
    for name, part in head.parts.items():  # each rank encodes its block of the decoded rows
        np.testing.assert_array_equal(np.asarray(part[8:40]), want[name][8:40])
    assert read.tensors["model.layers.0.mlp.up_proj.weight"].format.name == "q8"  # as stored


def test_files_that_are_missing_not_gguf_or_of_another_architecture(tmp_path):
    with pytest.raises(ArgumentError, match="no GGUF file .*nowhere.gguf"):
        open_gguf(tmp_path / "nowhere.gguf")
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00{}      ")
    with pytest.raises(ArgumentError, match="is not a GGUF file"):
        open_gguf(tmp_path / "model.safetensors")
    (tmp_path / "cut.gguf").write_bytes(b"GGUF\x03\x00\x00\x00\x05")
    with pytest.raises(ArgumentError, match="not a GGUF file tvm-distx can read: it ends inside "
                       "its header"):
        open_gguf(tmp_path / "cut.gguf")
    (tmp_path / "old.gguf").write_bytes(b"GGUF\x01\x00\x00\x00" + bytes(16))
    with pytest.raises(ArgumentError, match="GGUF file of version 1, which tvm-distx does not "
                       "read"):
        open_gguf(tmp_path / "old.gguf")
    (tmp_path / "big.gguf").write_bytes(b"GGUF\x00\x00\x00\x03" + bytes(16))
    with pytest.raises(ArgumentError, match="GGUF file of the other byte order"):
        open_gguf(tmp_path / "big.gguf")
    writer = gguf.GGUFWriter(tmp_path / "gemma.gguf", "gemma2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ArgumentError, match="architecture 'gemma2'.*reads llama, qwen2, qwen3"):
        open_gguf(tmp_path / "gemma.gguf")


def test_a_file_cut_short_is_refused(files, tmp_path):
    _, path = files("qwen2", "Q8_0")
    whole = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(whole[:-100])
    with pytest.raises(ArgumentError, match=r"not a GGUF file tvm-distx can read: tensor "
                       r"\S+ ends past the end of the file\nhint: the file may be cut short"):
        open_gguf(tmp_path / "cut.gguf")


def test_a_file_missing_a_tensor_or_with_an_unknown_one(tmp_path, tokenizer):
    model = _model("qwen2")
    path = write_gguf(model, tmp_path / "fewer.gguf", "F16", tokenizer,
                      drop={"model.layers.1.self_attn.v_proj.bias"})
    with pytest.raises(ArgumentError, match=r"no tensor blk\.1\.attn_v\.bias "
                       r"\(model\.layers\.1\.self_attn\.v_proj\.bias\)"):
        open_gguf(path)
    extra = {"blk.0.attn_qkv.weight": (np.zeros((192, 64), np.float32),
                                        gguf.GGMLQuantizationType.F32)}
    path = write_gguf(model, tmp_path / "more.gguf", "F16", tokenizer, extra=extra)
    with pytest.raises(ArgumentError, match=r"tensor blk\.0\.attn_qkv\.weight .*no Hugging "
                       "Face counterpart"):
        open_gguf(path)


def test_the_header_reader_agrees_with_the_gguf_packages(files):
    from tvm_distx.sources.gguf_header import read_header

    _, path = files("llama", "Q4_0")
    header, reference = read_header(path), gguf.GGUFReader(path)
    fields = {k: f for k, f in reference.fields.items() if not k.startswith("GGUF.")}
    assert list(header.fields) == list(fields)
    for key, f in fields.items():
        got, want = header.fields[key], f.contents()
        if f.types[-1] == gguf.GGUFValueType.FLOAT32:  # ours: the decimal it was written from
            np.testing.assert_array_equal(np.float32(got), np.float32(want))
        else:
            assert np.asarray(got).tolist() == want, key
    assert header.data_offset == reference.data_offset
    assert list(header.tensors) == [t.name for t in reference.tensors]
    for t in reference.tensors:
        info = header.tensors[t.name]
        assert info.shape == tuple(reversed(t.shape.tolist())) and info.ggml_type == t.tensor_type.name
        assert (info.offset, info.nbytes) == (t.data_offset, t.n_bytes)
