"""GGUF files made in the tests: tiny transformers models written as llama.cpp's converter does.

:func:`write_gguf` writes a ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` or
``Qwen3ForCausalLM`` with the ``gguf`` package's writer: the ``<arch>.*``
metadata that ``convert_hf_to_gguf.py`` writes, a byte-level BPE vocabulary
(:func:`train_tokenizer`), the tensors under their GGUF names with the 2-D
weights in the requested type (1-D ones stay F32), the ``llama`` query and key
rows permuted for llama.cpp's rotary layout, and Llama 3's rope factors.
"""

from __future__ import annotations

import json

import numpy as np

#: Hugging Face parameter names (without .weight/.bias) -> GGUF names
GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
FILE_TYPES = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16",
              "Q8_0": "MOSTLY_Q8_0", "Q4_0": "MOSTLY_Q4_0"}
TEXT = ("The quick brown fox jumps over the lazy dog. A distributed model runs on two boards, "
        "and each board holds half of its weights: 1234 tokens per second!\n"
        "Quantized weights are read as they are stored, group by group, never widened.")
SPECIALS = ["<|bos|>", "<|eos|>"]


def gguf_name(hf_name: str) -> str:
    """The GGUF name of a Hugging Face parameter."""
    stem, suffix = hf_name.rsplit(".", 1)
    if stem.startswith("model.layers."):
        layer, rest = stem[len("model.layers."):].split(".", 1)
        return f"blk.{layer}.{LAYER[rest]}.{suffix}"
    return f"{GLOBAL[stem]}.{suffix}"


def rotary_permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's layout of a query/key projection: each head's two halves interleaved."""
    size = rows.shape[0] // heads
    return (rows.reshape(heads, 2, size // 2, *rows.shape[1:]).swapaxes(1, 2)
            .reshape(rows.shape))


def train_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer trained on :data:`TEXT`, its specials first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  show_progress=False)
    tokenizer.train_from_iterator([TEXT] * 4, trainer)
    return tokenizer


def tokenizer_metadata(tokenizer, vocab_size: int) -> dict:
    """The token list, types and merges as the converter writes them (padded to the vocabulary)."""
    import gguf

    by_id = {i: t for t, i in tokenizer.get_vocab(with_added_tokens=True).items()}
    tokens, types = [], []
    for i in range(vocab_size):
        if i in by_id:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if by_id[i] in SPECIALS else gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    return {"tokens": tokens, "types": types, "merges": merges,
            "bos": tokens.index(SPECIALS[0]), "eos": tokens.index(SPECIALS[1])}


def encoded(values: np.ndarray, tensor_type: str) -> tuple[np.ndarray, "object"]:
    """``values`` in a GGUF type, as the writer takes them (bytes for the block types)."""
    import gguf

    kind = gguf.GGMLQuantizationType[tensor_type]
    if values.ndim == 1 or tensor_type == "F32":
        return values.astype(np.float32), gguf.GGMLQuantizationType.F32
    return gguf.quants.quantize(values.astype(np.float32), kind), kind


def write_gguf(model, path, tensor_type: str = "F16", tokenizer=None, pre: str = "gpt-2",
               extra=None, drop=()) -> "object":
    """Write ``model`` to ``path`` in llama.cpp's layout; the 2-D weights in ``tensor_type``.

    ``extra`` maps GGUF names to ``(bytes, GGMLQuantizationType)`` written as
    they are, instead of (or besides) the model's tensors; the parameters named
    in ``drop`` are left out.
    """
    import gguf
    import torch

    config = model.config
    arch = config.model_type
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name("tiny test model")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    head_dim = getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_file_type(getattr(gguf.LlamaFileType, FILE_TYPES[tensor_type]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if arch == "llama":
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(head_dim)
    if tokenizer is not None:
        vocab = tokenizer_metadata(tokenizer, config.vocab_size)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(vocab["tokens"])
        writer.add_token_types(vocab["types"])
        writer.add_token_merges(vocab["merges"])
        writer.add_bos_token_id(vocab["bos"])
        writer.add_eos_token_id(vocab["eos"])
        writer.add_add_bos_token(False)
        writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    extra = dict(extra or {})
    for name, tensor in model.state_dict().items():
        if name in drop or (name == "lm_head.weight" and config.tie_word_embeddings):
            continue
        values = tensor.detach().to(torch.float32).numpy()
        if arch == "llama" and ".q_proj." in name:
            values = rotary_permute(values, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            values = rotary_permute(values, config.num_key_value_heads)
        target = gguf_name(name)
        data, kind = extra.pop(target) if target in extra else encoded(values, tensor_type)
        writer.add_tensor(target, data, raw_dtype=kind)
    if config.rope_parameters.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(config))
    for target, (data, kind) in extra.items():
        writer.add_tensor(target, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama3_rope_factors(config) -> np.ndarray:
    """The per-frequency divisors of Llama 3's rope scaling, computed by transformers."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    dim = config.head_dim
    base = 1.0 / (config.rope_parameters["rope_theta"] ** (np.arange(0, dim, 2) / dim))
    return (base / scaled.double().numpy()).astype(np.float32)
