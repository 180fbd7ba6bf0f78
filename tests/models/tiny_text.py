"""A tiny byte-level BPE tokenizer trained here (no download), with a chat template, and a
tiny random Llama whose vocabulary is that tokenizer's.

Byte-level: any text encodes, and a character outside the training text takes one
token per UTF-8 byte, so its bytes span several tokens (what streamed text must not
split).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

#: The training text: enough English for merges; "é", "€" and emoji are left as bytes.
CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello there",
          "a sharded model runs on two ranks", "tokens stream out one by one",
          "the cat sat on the mat and the dog sat on the log"] * 20
SPECIALS = ["<s>", "</s>", "<pad>"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
            "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
VOCAB = 320


def write_tokenizer(directory: Path) -> Path:
    """Train the tokenizer and write ``tokenizer.json`` and ``tokenizer_config.json``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
              "chat_template": TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def hf_tokenizer(directory: Path):
    """transformers' tokenizer of the files :func:`write_tokenizer` wrote (the oracle)."""
    return transformers.PreTrainedTokenizerFast.from_pretrained(str(directory))


def llama(vocab: int, layers: int = 2):
    """A tiny random Llama of ``vocab`` tokens whose end token is ``</s>`` (id 1)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=160, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=2,
        initializer_range=0.2)
    return transformers.LlamaForCausalLM(config).eval()
