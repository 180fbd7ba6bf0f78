"""The tokenizer a GGUF file's metadata holds, and a ``tokenizers.Tokenizer`` built from it.

llama.cpp keeps the vocabulary in the ``tokenizer.ggml.*`` keys: the tokenizer
kind (``model``: ``"gpt2"`` for byte-level BPE, ``"llama"`` for SentencePiece),
the pre-tokenizer's name (``pre``: ``"llama-bpe"`` for Llama 3, ``"qwen2"``...),
the tokens by id, their scores and types (1 normal, 3 control, 4 user-defined,
6 byte), the BPE merges (``"a b"``: merge ``a`` and ``b``), the special ids and
the chat template. :class:`GGUFTokenizer` holds them as they are;
:meth:`GGUFTokenizer.hf_tokenizer` rebuilds a byte-level BPE tokenizer (the
``gpt2`` kind) with the ``tokenizers`` package, imported there only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tvm_distx.errors import ArgumentError

__all__ = ["GGUFTokenizer", "PRE_TOKENIZERS", "read_tokenizer"]

#: token types (llama.cpp's ``llama_token_type``)
CONTROL, USER_DEFINED = 3, 4

#: The split pattern of each pre-tokenizer read (``tokenizer.ggml.pre``); ``None``: GPT-2's
#: own pattern (byte-level with its regex). Other names, and a file without one (llama.cpp
#: then splits with its "default" patterns), are refused: their text splits differ.
PRE_TOKENIZERS: dict[str, str | None] = {
    "gpt-2": None,
    # Llama 3: case-insensitive contractions, digits in runs of at most 3
    "llama-bpe": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    # Qwen2 (and the DeepSeek-R1 distills of Qwen): the same, one digit at a time
    "qwen2": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
}
PRE_TOKENIZERS["deepseek-r1-qwen"] = PRE_TOKENIZERS["qwen2"]
PRE_TOKENIZERS["llama3"] = PRE_TOKENIZERS["llama-v3"] = PRE_TOKENIZERS["llama-bpe"]
#: pre-tokenizers whose text is NFC-normalized first
_NFC = {"qwen2", "deepseek-r1-qwen"}
#: pre-tokenizers whose BPE takes a whole word in the vocabulary as it is
_IGNORE_MERGES = {"llama-bpe", "llama3", "llama-v3"}


@dataclass(frozen=True)
class GGUFTokenizer:
    """The ``tokenizer.*`` metadata of a GGUF file (see the module doc).

    Attributes
    ----------
    model : str
        ``tokenizer.ggml.model`` (``"gpt2"``, ``"llama"``...; ``""`` when absent).
    pre : str or None
        ``tokenizer.ggml.pre``.
    tokens, scores, token_types, merges : tuple
        By token id (the merges in priority order); empty when absent.
    bos_id, eos_id, pad_id, unk_id : int or None
        The special tokens' ids.
    add_bos, add_eos : bool or None
        Whether a BOS (EOS) token is put before (after) the text.
    chat_template : str or None
        ``tokenizer.chat_template`` (Jinja).
    """

    model: str = ""
    pre: str | None = None
    tokens: tuple[str, ...] = field(default=(), repr=False)
    scores: tuple[float, ...] = field(default=(), repr=False)
    token_types: tuple[int, ...] = field(default=(), repr=False)
    merges: tuple[str, ...] = field(default=(), repr=False)
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    unk_id: int | None = None
    add_bos: bool | None = None
    add_eos: bool | None = None
    chat_template: str | None = field(default=None, repr=False)

    def hf_tokenizer(self):
        """A ``tokenizers.Tokenizer`` of this byte-level BPE vocabulary (the ``gpt2`` kind).

        Raises
        ------
        ArgumentError
            For another kind of tokenizer, or a pre-tokenizer not in
            :data:`PRE_TOKENIZERS`.
        """
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
        from tokenizers import pre_tokenizers, processors

        if self.model != "gpt2" or not self.tokens:
            raise ArgumentError(f"the GGUF tokenizer is of kind {self.model!r}; tvm-distx "
                                "rebuilds only byte-level BPE ('gpt2') tokenizers",
                                hint="give token ids, or load the model's tokenizer.json "
                                "with the tokenizers package")
        pre = self.pre or "default"
        if pre not in PRE_TOKENIZERS:  # a file without one: llama.cpp's "default" splits
            raise ArgumentError(f"the GGUF tokenizer's pre-tokenizer {pre!r} is not one "
                                "tvm-distx knows how to split text for",
                                hint=f"it knows {', '.join(PRE_TOKENIZERS)}; give token ids, "
                                "or load the model's tokenizer.json")
        vocab = {token: i for i, token in enumerate(self.tokens)}
        merges = [tuple(m.split(" ", 1)) for m in self.merges]
        try:
            model = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _IGNORE_MERGES)
        except Exception as err:  # the tokenizers package raises a bare Exception
            raise ArgumentError(f"the GGUF tokenizer's merges do not fit its tokens: {err}",
                                hint="give token ids, or load the model's tokenizer.json "
                                "with the tokenizers package") from None
        tokenizer = Tokenizer(model)
        pattern = PRE_TOKENIZERS[pre]
        if pattern is None:
            tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                               use_regex=True)
        else:
            tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        if pre in _NFC:
            tokenizer.normalizer = normalizers.NFC()
        tokenizer.decoder = decoders.ByteLevel()
        types = self.token_types or (0,) * len(self.tokens)
        tokenizer.add_tokens([AddedToken(self.tokens[i], special=kind == CONTROL,
                                         normalized=False)
                              for i, kind in enumerate(types) if kind in (CONTROL, USER_DEFINED)])
        if self.add_bos and self.bos_id is not None:
            bos = self.tokens[self.bos_id]
            tokenizer.post_processor = processors.TemplateProcessing(
                single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                special_tokens=[(bos, self.bos_id)])
        return tokenizer


def read_tokenizer(fields: dict) -> GGUFTokenizer:
    """The tokenizer of a GGUF file's metadata (:attr:`GGUFHeader.fields`)."""

    def strings(key) -> tuple:
        return tuple(str(v) for v in fields.get(key, ()))

    def numbers(key, kind) -> tuple:
        return tuple(kind(v) for v in np.asarray(fields.get(key, ())).tolist())

    def optional(key, kind):
        return None if fields.get(key) is None else kind(fields[key])

    return GGUFTokenizer(
        model=str(fields.get("tokenizer.ggml.model", "")),
        pre=optional("tokenizer.ggml.pre", str),
        tokens=strings("tokenizer.ggml.tokens"),
        scores=numbers("tokenizer.ggml.scores", float),
        token_types=numbers("tokenizer.ggml.token_type", int),
        merges=strings("tokenizer.ggml.merges"),
        bos_id=optional("tokenizer.ggml.bos_token_id", int),
        eos_id=optional("tokenizer.ggml.eos_token_id", int),
        pad_id=optional("tokenizer.ggml.padding_token_id", int),
        unk_id=optional("tokenizer.ggml.unknown_token_id", int),
        add_bos=optional("tokenizer.ggml.add_bos_token", bool),
        add_eos=optional("tokenizer.ggml.add_eos_token", bool),
        chat_template=optional("tokenizer.chat_template", str),
    )
