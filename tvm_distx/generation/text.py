"""Text in and text out: the checkpoint's tokenizer, its chat template, and streamed text.

:class:`Tokenizer` reads the tokenizer that sits with a checkpoint or a bundle: a
``tokenizer.json`` (Hugging Face ``tokenizers``), with the chat template and the special
tokens of ``tokenizer_config.json`` (or ``chat_template.jinja``). Other tokenizer files
(a SentencePiece ``tokenizer.model``, ``vocab.json`` with ``merges.txt``) and a GGUF
file's tokenizer are converted by transformers when it is installed. Chat templates are
rendered as transformers renders them: Jinja in a sandbox, with ``messages``,
``add_generation_prompt`` and the special tokens.

:class:`TextStream` turns token ids into text pieces as they come, and never splits a
character across pieces (a piece waits while the text decoded so far ends in an
incomplete UTF-8 sequence).

This module imports no TVM, and its libraries (tokenizers, jinja2) only when a tokenizer is
read or a template rendered: a board, whose Python has numpy alone, imports it with the
generation loop.
"""

from __future__ import annotations

from datetime import datetime
import json
import logging
import os
from pathlib import Path
import tempfile
from typing import Any, Iterable, Sequence

from tvm_distx.errors import ArgumentError

__all__ = ["TOKENIZER_FILES", "TextStream", "Tokenizer"]

logger = logging.getLogger(__name__)

#: The files of a tokenizer, copied into bundles when present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json")
#: Files that transformers can turn into a ``tokenizer.json``.
_CONVERTIBLE = ("tokenizer.model", "vocab.json", "merges.txt", "spiece.model")
_REPLACEMENT = "\ufffd"  # what a decoder gives for an incomplete UTF-8 sequence


class Tokenizer:
    """A checkpoint's tokenizer, its special tokens and its chat template.

    Parameters
    ----------
    backend : tokenizers.Tokenizer
        The tokenizer proper.
    config : dict
        ``tokenizer_config.json``'s content (special tokens, ``chat_template``).
    chat_template : str, optional
        The Jinja chat template (overrides the config's).
    files : dict of str to bytes
        The files it was read from, written again by :meth:`save`.
    """

    def __init__(self, backend, config: dict | None = None, *,
                 chat_template: str | None = None,
                 files: dict[str, bytes] | None = None) -> None:
        self.backend = backend
        self.config = dict(config or {})
        self.chat_template = chat_template if chat_template is not None else \
            _template_of(self.config)
        self.files = dict(files or {})

    # ------------------------------------------------------------------ reading
    @classmethod
    def from_directory(cls, directory: str | os.PathLike) -> "Tokenizer | None":
        """The tokenizer in ``directory``; None when it holds no tokenizer file.

        Raises
        ------
        ArgumentError
            If its files cannot be read, or only transformers could convert them and
            it is not installed.
        """
        directory = Path(directory)
        if not (directory / "tokenizer.json").is_file():
            if any((directory / name).is_file() for name in _CONVERTIBLE):
                return cls._converted(directory)
            return None
        from tokenizers import Tokenizer as Backend

        files = {name: (directory / name).read_bytes() for name in TOKENIZER_FILES
                 if (directory / name).is_file()}
        try:
            backend = Backend.from_str(files["tokenizer.json"].decode())
            config = json.loads(files.get("tokenizer_config.json", b"{}"))
        except Exception as err:  # the tokenizers library raises its own Exception type
            raise ArgumentError(f"the tokenizer in {directory} cannot be read: {err}",
                                hint="give a directory whose tokenizer.json was written by "
                                "tokenizers or transformers' save_pretrained") from None
        template = None
        if "chat_template.jinja" in files:
            template = files["chat_template.jinja"].decode()
        elif "chat_template.json" in files:
            template = _template_of(json.loads(files["chat_template.json"]))
        return cls(backend, config, chat_template=template, files=files)

    @classmethod
    def from_transformers(cls, tokenizer) -> "Tokenizer":
        """A transformers tokenizer (``AutoTokenizer``'s), through the files it saves."""
        with tempfile.TemporaryDirectory(prefix="tvm-distx-tokenizer-") as scratch:
            tokenizer.save_pretrained(scratch)
            found = cls.from_directory(scratch)
        if found is None:
            raise ArgumentError(f"{type(tokenizer).__name__} saves no tokenizer.json",
                                hint="give a fast tokenizer: AutoTokenizer.from_pretrained("
                                "path, use_fast=True)")
        return found

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "Tokenizer | None":
        """The tokenizer a GGUF file's metadata describes (converted by transformers); None
        without transformers or without tokenizer metadata."""
        path = Path(path)
        try:
            from transformers import AutoTokenizer
        except ImportError:
            logger.info("%s: transformers is not installed; no tokenizer from the GGUF "
                        "metadata (token ids only)", path.name)
            return None
        try:
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        except Exception as err:  # noqa: BLE001 - a file without tokenizer metadata
            logger.info("%s: no tokenizer from its metadata (%s); token ids only", path.name,
                        str(err).splitlines()[0] if str(err) else type(err).__name__)
            return None
        return cls.from_transformers(tokenizer)

    @classmethod
    def _converted(cls, directory: Path) -> "Tokenizer":
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ArgumentError(
                f"the tokenizer in {directory} has no tokenizer.json, and converting its "
                f"other files needs transformers", hint="pip install 'tvm-distx[hf]', or save "
                "the tokenizer with save_pretrained to write a tokenizer.json") from None
        return cls.from_transformers(AutoTokenizer.from_pretrained(directory))

    def save(self, directory: str | os.PathLike) -> list[str]:
        """Write the tokenizer's files into ``directory``; their names."""
        directory = Path(directory)
        for name, data in self.files.items():
            (directory / name).write_bytes(data)
        return sorted(self.files)

    # ------------------------------------------------------------------ tokens
    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer knows, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def special(self, name: str) -> str | None:
        """The text of special token ``name`` (``"bos_token"``, ``"eos_token"``, ...)."""
        value = self.config.get(name)
        if isinstance(value, dict):  # transformers' serialized AddedToken
            value = value.get("content")
        return value if isinstance(value, str) else None

    def token_id(self, text: str | None) -> int | None:
        """The id of a token's text, None if unknown."""
        return None if text is None else self.backend.token_to_id(text)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The token ids of ``text`` (with the model's BOS when its tokenizer adds one)."""
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """The text of ``ids``."""
        return self.backend.decode([int(t) for t in ids],
                                   skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ chat
    def render_chat(self, messages: Sequence[dict], *,
                    add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text of ``messages`` by the chat template.

        Raises
        ------
        ArgumentError
            If the tokenizer has no chat template, the messages are not a list of
            ``{"role": ..., "content": ...}``, or the template refuses them.
        """
        if not self.chat_template:
            raise ArgumentError("this model's tokenizer has no chat template",
                                hint="generate from a prompt text instead of messages, or "
                                "add a chat_template to its tokenizer_config.json",
                                cli_hint="use --prompt instead of --chat")
        _check_messages(messages)
        import jinja2  # a board's Python, which runs generation.py, has no jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals.update(raise_exception=raise_exception,
                           strftime_now=lambda fmt: datetime.now().strftime(fmt))
        special = {name: self.special(name) for name in (
            "bos_token", "eos_token", "pad_token", "unk_token")}
        try:
            return env.from_string(self.chat_template).render(
                messages=list(messages), add_generation_prompt=add_generation_prompt,
                **{k: v for k, v in special.items() if v is not None}, **extra)
        except jinja2.exceptions.TemplateError as err:
            raise ArgumentError(f"the chat template refuses these messages: {err}",
                                hint="give messages as the model's template expects "
                                "(roles user/assistant/system, alternating)") from None

    def encode_chat(self, messages: Sequence[dict], **extra: Any) -> list[int]:
        """The prompt ids of ``messages`` (the template writes the special tokens)."""
        return self.encode(self.render_chat(messages, **extra), add_special_tokens=False)


class TextStream:
    """Text pieces of a growing list of token ids, never splitting a character.

    Parameters
    ----------
    tokenizer : Tokenizer
        Decodes the ids.
    skip_special_tokens : bool
        Leave special tokens (an end token) out of the text.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # ids before this decode as context only
        self._read = 0  # ids before this are in ``text``

    def push(self, token: int) -> str:
        """Add one token; the new text it completes ("" while a character is incomplete)."""
        self.ids.append(int(token))
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if len(after) <= len(before) or after.endswith(_REPLACEMENT):
            return ""
        piece = after[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += piece
        return piece

    def flush(self) -> str:
        """What is left at the end (an incomplete character, as the decoder renders it)."""
        rest = self._decode(self.ids[self._prefix:])[len(self._decode(
            self.ids[self._prefix:self._read])):]
        self._prefix = self._read = len(self.ids)
        self.text += rest
        return rest

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip) if ids else ""


def _template_of(config: dict) -> str | None:
    """The default chat template of a config (a string, or transformers' named list)."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {item.get("name"): item.get("template") for item in template
                 if isinstance(item, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _check_messages(messages) -> None:
    if not isinstance(messages, (list, tuple)) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m
            for m in messages):
        raise ArgumentError("chat messages must be a non-empty list of {'role': ..., "
                            "'content': ...}",
                            hint='lm.chat([{"role": "user", "content": "Hello"}])')
