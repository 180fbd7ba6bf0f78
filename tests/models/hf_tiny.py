"""Tiny random Hugging Face causal LMs built from configs in code (no download).

Hidden 64, 4 query heads, 2 key/value heads (grouped-query attention), MLP 160,
vocabulary 128, untied LM heads where the family allows it.
"""

from __future__ import annotations

import numpy as np
import torch
import transformers

VOCAB = 128


#: More families, as ``(config class, model class, config)``: the common tiny shape where
#: the family takes it, small sliding windows so that they act on a short prompt, and a
#: larger ``initializer_range`` where the default greedy output repeats one token.
_IDS = dict(pad_token_id=0, bos_token_id=0, eos_token_id=0)
_SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
              **_IDS)
_FALCON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, bias=False, alibi=False,
               ffn_hidden_size=160, max_position_embeddings=64, tie_word_embeddings=False, **_IDS)
MORE = {
    "falcon_mqa": ("FalconConfig", "FalconForCausalLM", dict(   # one key/value head, q|k|v fused
        _FALCON, new_decoder_architecture=False, multi_query=True, parallel_attn=True)),
    "falcon_gqa": ("FalconConfig", "FalconForCausalLM", dict(   # q|k|v fused per key/value group
        _FALCON, new_decoder_architecture=True, num_kv_heads=2)),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", dict(_SHAPE)),       # norms without weights
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(_SHAPE)),    # post-norms, q/k norms
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        _SHAPE, head_dim=16, sliding_window=4, final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0, query_pre_attn_scalar=16)),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        _SHAPE, head_dim=16, sliding_window=4, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention"])),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, intermediate_size=160,
        max_position_embeddings=64, tie_word_embeddings=False, **_IDS)),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", dict(_SHAPE)),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(_SHAPE)),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(_SHAPE, sliding_window=4)),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(
        _SHAPE, embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.3,
        logits_scaling=1.5)),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(_SHAPE, logit_scale=0.5)),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(
        vocab_size=VOCAB, n_embd=64, n_head=4, rotary_dim=8, n_inner=160, n_positions=64,
        tie_word_embeddings=False, **_IDS)),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=64, n_head=4, initializer_range=0.5, **_IDS)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(    # attention sinks, MoE
        _SHAPE, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"])),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(_SHAPE)),
    "glm": ("GlmConfig", "GlmForCausalLM", dict(_SHAPE, head_dim=16)),
    "minicpm3": ("MiniCPM3Config", "MiniCPM3ForCausalLM", dict(
        _SHAPE, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=16, head_dim=16, scale_emb=2.0, scale_depth=1.4,
        dim_model_base=32)),
    "llama4_text": ("Llama4TextConfig", "Llama4ForCausalLM", dict(  # a shared expert beside
        _SHAPE, head_dim=16, intermediate_size_mlp=160, num_local_experts=4,  # routed ones,
        num_experts_per_tok=1, interleave_moe_layer_step=1, attention_chunk_size=4)),  # chunks
}
#: The name each family's config gives its layer count.
_LAYER_KEYS = {"gptj": "n_layer", "bloom": "n_layer"}


def build(family: str, layers: int = 2, init: float | None = None):
    """A tiny random ``family`` model.

    ``llama``, ``qwen2``, ``mistral``, ``gpt2``, ``mixtral``, ``qwen2_moe``, ``phi3``
    (fused q|k|v and gate|up), ``gemma`` (tied head), ``qwen3`` (q/k norms), ``opt``
    (tied head, learned positions) or ``deepseek_v3`` (multi-head latent attention and
    routed experts beside a shared one, from the first layer on), or one of :data:`MORE`. ``init``: GPT-2's
    ``initializer_range`` (0.5 gives varied greedy tokens; the default 0.02 repeats one).
    """
    torch.manual_seed(0)
    if family in MORE:
        config_name, model_name, config = MORE[family]
        config = {**config, _LAYER_KEYS.get(family, "num_hidden_layers"): layers}
        if "layer_types" in config:  # the pattern repeated over the layers asked for
            kinds = config["layer_types"]
            config["layer_types"] = [kinds[i % len(kinds)] for i in range(layers)]
        model_class = getattr(transformers, model_name)
        return model_class(getattr(transformers, config_name)(**config)).eval()
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=160,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, tie_word_embeddings=False)
    if family == "gpt2":  # GPT-2 ties its LM head to the token embedding
        config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=layers, n_head=4,
                                         n_positions=64, bos_token_id=0, eos_token_id=0,
                                         initializer_range=init or 0.02)
        return transformers.GPT2LMHeadModel(config).eval()
    if family == "mixtral":
        config = transformers.MixtralConfig(**common, num_local_experts=4,
                                            num_experts_per_tok=2)
        return transformers.MixtralForCausalLM(config).eval()
    if family == "qwen2_moe":  # a shared expert beside the routed ones
        config = transformers.Qwen2MoeConfig(**common, moe_intermediate_size=48,
                                             shared_expert_intermediate_size=80, num_experts=4,
                                             num_experts_per_tok=2)
        return transformers.Qwen2MoeForCausalLM(config).eval()
    if family == "phi3":
        config = transformers.Phi3Config(**common, pad_token_id=0, bos_token_id=0,
                                         eos_token_id=0)
        return transformers.Phi3ForCausalLM(config).eval()
    if family == "gemma":  # Gemma ties its LM head to the token embedding
        config = transformers.GemmaConfig(**{**common, "tie_word_embeddings": True},
                                          head_dim=16, pad_token_id=0, bos_token_id=0,
                                          eos_token_id=0)
        return transformers.GemmaForCausalLM(config).eval()
    if family == "opt":  # ties its LM head too
        config = transformers.OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=160,
                                        num_hidden_layers=layers, num_attention_heads=4,
                                        max_position_embeddings=64, word_embed_proj_dim=64,
                                        pad_token_id=0, bos_token_id=0, eos_token_id=0)
        return transformers.OPTForCausalLM(config).eval()
    if family == "deepseek_v3":
        config = transformers.DeepseekV3Config(
            **{**common, "num_key_value_heads": 4}, moe_intermediate_size=32,
            n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
            n_shared_experts=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=16, first_k_dense_replace=0, pad_token_id=0,
            bos_token_id=0, eos_token_id=0)
        return transformers.DeepseekV3ForCausalLM(config).eval()
    if family == "qwen3":  # its head_dim is not hidden / heads by default
        config = transformers.Qwen3Config(**common, head_dim=16)
        return transformers.Qwen3ForCausalLM(config).eval()
    classes = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
               "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
               "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}
    config_class, model_class = classes[family]
    return model_class(config_class(**common)).eval()


def logits(model, ids: np.ndarray) -> np.ndarray:
    """transformers' float32 logits for ``ids`` (batch, sequence)."""
    with torch.no_grad():
        return model(torch.from_numpy(ids), use_cache=False).logits.numpy()


def tokens(seq: int, seed: int = 0) -> np.ndarray:
    """Random token ids of shape (1, seq)."""
    return np.random.default_rng(seed).integers(0, VOCAB, (1, seq), dtype=np.int64)


def prompt_ids(length: int, seed: int) -> np.ndarray:
    """Random token ids of shape (length,): the one prompt of :func:`tokens`."""
    return tokens(length, seed)[0]


def greedy(model, ids: np.ndarray, new_tokens: int) -> np.ndarray:
    """transformers' greedy ``generate`` of one prompt (length,): prompt then new tokens."""
    with torch.no_grad():
        out = model.generate(torch.from_numpy(ids[None, :]), max_new_tokens=new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0].numpy()


def greedy_batch(model, prompts, new_tokens: int, eos_token_id=None,
                 pad_token_id: int = 0) -> list[np.ndarray]:
    """transformers' greedy ``generate`` of a left-padded batch: each row's new tokens.

    The prompts (1-D arrays of different lengths) are padded on the left with
    ``pad_token_id`` and given with their ``attention_mask``; a row's tokens
    end at its first ``eos_token_id`` (kept), as transformers pads after it.
    """
    longest = max(len(p) for p in prompts)
    ids = np.full((len(prompts), longest), pad_token_id, np.int64)
    mask = np.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt):] = prompt
        mask[row, longest - len(prompt):] = 1
    with torch.no_grad():
        out = model.generate(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                             max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    rows = []
    for row in out[:, longest:].numpy():
        ends = [i for i, t in enumerate(row) if eos_token_id is not None and t == eos_token_id]
        rows.append(row[:ends[0] + 1] if ends else row)
    return rows
