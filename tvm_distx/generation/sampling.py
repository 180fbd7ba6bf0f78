"""How the next token is chosen from the logits: :class:`Sampling`, as transformers defines it.

The ranks return the last position's logits; the host chooses the token. The
choice follows transformers' ``generate``: a repetition penalty on every token
already in the sequence (prompt included), then, when sampling, the warpers in
transformers' order (temperature, top-k, top-p, min-p), and a draw from the
softmax of what is left. Without sampling the token is the argmax of the
penalised logits (greedy). The draws come from a NumPy generator seeded by
``seed``: the same seed gives the same tokens on every backend.

This module imports NumPy only: a board's job and the server use it too.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
import math
from typing import Any, Sequence

import numpy as np

from tvm_distx.errors import ArgumentError

__all__ = ["Sampler", "Sampling"]


@dataclass(frozen=True)
class Sampling:
    """The choice of each new token; the fields and defaults of transformers' ``generate``.

    Parameters
    ----------
    do_sample : bool
        Draw the token from the processed distribution; False: the argmax (greedy).
    temperature : float
        The logits are divided by it before the draw (> 0).
    top_k : int or None
        Keep the ``top_k`` most likely tokens (ties with the last one kept too);
        0 or None keeps all. transformers' default is 50.
    top_p : float
        Keep the most likely tokens whose probabilities add up to ``top_p``
        (nucleus sampling, 0 < top_p <= 1; 1 keeps all).
    min_p : float or None
        Keep the tokens at least ``min_p`` times as likely as the most likely one.
    repetition_penalty : float
        Logits of tokens already in the sequence are divided by it (multiplied
        when negative), greedy or not; 1 is none.
    seed : int or None
        Seed of the draws; None draws from fresh entropy.

    Raises
    ------
    ArgumentError
        If a value is out of its range, naming it and the range.
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = 50
    top_p: float = 1.0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        checks = [
            ("temperature", self.temperature, _positive(self.temperature), "> 0"),
            ("top_k", self.top_k, self.top_k is None or (
                isinstance(self.top_k, (int, np.integer)) and self.top_k >= 0), "an int >= 0"),
            ("top_p", self.top_p, _number(self.top_p) and 0 < self.top_p <= 1, "in (0, 1]"),
            ("min_p", self.min_p, self.min_p is None or (
                _number(self.min_p) and 0 <= self.min_p <= 1), "in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty,
             _positive(self.repetition_penalty), "> 0"),
            ("seed", self.seed, self.seed is None or (
                isinstance(self.seed, (int, np.integer)) and self.seed >= 0), "an int >= 0"),
        ]
        for name, value, ok, wanted in checks:
            if not ok:
                raise ArgumentError(f"{name}={value!r}: must be {wanted}",
                                    hint=f"generate(..., {name}=<{wanted}>)",
                                    cli_hint=f"--{name.replace('_', '-')} <{wanted}>")

    @classmethod
    def of(cls, options: dict[str, Any]) -> "Sampling":
        """The sampling of ``generate``'s keyword arguments; an unknown one is an error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ArgumentError(f"generate() got unknown option(s) {', '.join(unknown)}",
                                hint=f"the sampling options are {', '.join(sorted(known))}")
        return cls(**options)

    def processed(self, logits: np.ndarray, previous: Sequence[int] = ()) -> np.ndarray:
        """The logits after the penalty and, when sampling, the warpers (float64; removed
        tokens are ``-inf``)."""
        scores = np.array(logits, dtype=np.float64).reshape(-1)
        if self.repetition_penalty != 1.0 and len(previous):
            seen = np.unique(np.asarray(previous, dtype=np.int64))
            seen = seen[(seen >= 0) & (seen < scores.size)]
            picked = scores[seen]
            scores[seen] = np.where(picked < 0, picked * self.repetition_penalty,
                                    picked / self.repetition_penalty)
        if not self.do_sample:
            return scores
        scores = scores / self.temperature
        if self.top_k and self.top_k < scores.size:
            kth = np.partition(scores, -self.top_k)[-self.top_k]
            scores[scores < kth] = -np.inf
        if self.top_p < 1.0:
            order = np.argsort(scores, kind="stable")  # ascending, as transformers sorts
            cumulative = np.cumsum(_softmax(scores[order]))
            remove = cumulative <= 1.0 - self.top_p
            remove[-1] = False  # the most likely token always stays
            scores[order[remove]] = -np.inf
        if self.min_p is not None and self.min_p > 0:
            probs = _softmax(scores)
            scores[probs < self.min_p * probs.max()] = -np.inf
        return scores

    def probabilities(self, logits: np.ndarray, previous: Sequence[int] = ()) -> np.ndarray:
        """The distribution each new token is drawn from (one-hot at the argmax when greedy)."""
        scores = self.processed(logits, previous)
        if not self.do_sample:
            out = np.zeros_like(scores)
            out[int(np.argmax(scores))] = 1.0
            return out
        return _softmax(scores)


class Sampler:
    """Chooses tokens as ``sampling`` says, drawing from its own seeded generator.

    Parameters
    ----------
    sampling : Sampling, optional
        Greedy when None.
    """

    def __init__(self, sampling: Sampling | None = None) -> None:
        self.sampling = sampling if sampling is not None else Sampling()
        self._rng = np.random.default_rng(self.sampling.seed)

    def __call__(self, logits: np.ndarray, previous: Sequence[int] = ()) -> int:
        """The next token for one row of ``logits`` after the tokens ``previous``."""
        scores = self.sampling.processed(logits, previous)
        if not self.sampling.do_sample:
            return int(np.argmax(scores))
        cumulative = np.cumsum(_softmax(scores))
        # inverse CDF: one uniform draw per token, whatever the vocabulary's size
        token = int(np.searchsorted(cumulative, self._rng.random() * cumulative[-1],
                                    side="right"))
        return min(token, scores.size - 1)


def _softmax(scores: np.ndarray) -> np.ndarray:
    shifted = np.exp(scores - np.max(scores))
    return shifted / shifted.sum()


def _number(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, bool) and math.isfinite(value)


def _positive(value) -> bool:
    return _number(value) and value > 0
