"""A generation bundle opened once: its manifest, ``generation.json`` and tokenizer.

:meth:`OpenedBundle.open` reads a generation bundle (:meth:`tvm_distx.llm.causal_lm.
CausalLM.export`) once: its ``manifest.json``
(:func:`~tvm_distx.bundle.manifest.read_manifest`), its ``generation.json``
(:func:`~tvm_distx.bundle.generation.read_generation`) and the tokenizer beside them
(:class:`~tvm_distx.generation.text.Tokenizer`). Everything that serves the bundle takes
the object instead of the path: the command line asks it what the bundle rules out
(its rank count, vocabulary and cache length, each checked here and nowhere else), then
hands it to :meth:`~tvm_distx.llm.causal_lm.CausalLM.from_bundle`, which gives its
manifest to the session.

It imports no TVM.
"""

from __future__ import annotations

from dataclasses import dataclass
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from tvm_distx.bundle.generation import GenerationInfo, read_generation
from tvm_distx.bundle.manifest import Manifest, read_manifest
from tvm_distx.errors import ArgumentError
from tvm_distx.generation.generator import check_token_ids, vocabulary_of
from tvm_distx.generation.text import Tokenizer

__all__ = ["OpenedBundle"]


@dataclass(frozen=True)
class OpenedBundle:
    """A generation bundle, read once (see the module documentation).

    Attributes
    ----------
    root : pathlib.Path
        The bundle's directory.
    manifest : tvm_distx.bundle.manifest.Manifest
        Its ``manifest.json``.
    generation : tvm_distx.bundle.generation.GenerationInfo
        Its ``generation.json``: the caches' layouts, the end and pad tokens.
    tokenizer : tvm_distx.generation.text.Tokenizer or None
        The tokenizer saved with it; None when it holds none.
    """

    root: Path
    manifest: Manifest
    generation: GenerationInfo
    tokenizer: Tokenizer | None

    @classmethod
    def open(cls, directory: str | os.PathLike) -> "OpenedBundle":
        """Read the bundle at ``directory``: ``generation.json``, ``manifest.json`` and the
        tokenizer, each once.

        Raises
        ------
        BundleError
            If the directory does not exist or is not a generation bundle (no
            ``generation.json``, a bad manifest), in one line.
        ArgumentError
            If its tokenizer's files cannot be read.
        """
        root = Path(directory)
        generation = read_generation(root)  # first: it says "not a generation bundle"
        return cls(root, read_manifest(root), generation, Tokenizer.from_directory(root))

    @property
    def num_ranks(self) -> int:
        """The rank count the bundle holds the shards of."""
        return self.manifest.num_ranks

    @property
    def vocab_size(self) -> int | None:
        """The size of ``decode``'s logits; None when the bundle has no such function."""
        try:
            return vocabulary_of(self.manifest)
        except (KeyError, IndexError):
            return None

    def check_ranks(self, num_ranks: int | None) -> None:
        """Refuse a rank count other than the bundle's (None: the bundle's own).

        Raises
        ------
        ArgumentError
            In Python's words (``CausalLM.from_bundle(num_ranks=3)``) and the command
            line's (``generate --ranks 3``).
        """
        if num_ranks is None or num_ranks == self.num_ranks:
            return
        asked = f"CausalLM.from_bundle(num_ranks={num_ranks})"
        error = ArgumentError(f"{asked}: the bundle {self.root} holds the shards of "
                              f"{self.num_ranks} ranks",
                              hint=f"CausalLM.from_bundle(directory, num_ranks={self.num_ranks})"
                              ", or leave num_ranks out",
                              cli_hint=f"--ranks {self.num_ranks}, or leave --ranks out")
        error.cli_names = ((asked, f"generate --ranks {num_ranks}"),)
        raise error

    def check_ids(self, prompts: Sequence[np.ndarray]) -> None:
        """Refuse token ids outside the bundle's vocabulary
        (:func:`~tvm_distx.generation.generator.check_token_ids`)."""
        check_token_ids(prompts, self.vocab_size)

    def check_room(self, prompt_tokens: int, new_tokens: int) -> None:
        """Refuse a prompt and new tokens that need more cache positions than the bundle's
        cache holds (the last new token needs none).

        Raises
        ------
        ArgumentError
            Naming the positions needed and held, with the most new tokens that fit.
        """
        limit = self.generation.cache.max_length
        needed = prompt_tokens + new_tokens - 1
        if needed <= limit:
            return
        most = limit - prompt_tokens + 1
        asked = f"max_new_tokens={new_tokens}"
        error = ArgumentError(f"a {prompt_tokens}-token prompt and {asked} need {needed} cache "
                              f"positions; the bundle {self.root} holds {limit}",
                              hint=f"max_new_tokens={most} at most" if most >= 1 else
                              "a shorter prompt, or a bundle exported with a larger max_length",
                              cli_hint=f"--max-new-tokens {most} at most" if most >= 1 else None)
        error.cli_names = ((asked, f"--max-new-tokens {new_tokens}"),)
        raise error
