"""Batched greedy generation: a left-padded batch of prompts as one forward per step.

:meth:`tvm_distx.generation.generator.Generator.generate` hands a batch of prompts here
when the model was exported with ``max_batch=`` (``prefill_batch`` and ``decode_batch``,
see :mod:`tvm_distx.frontend.decoder`). The batch runs the way transformers'
``generate`` runs a left-padded batch:

* the prompts are padded on the left to the longest, and row ``i``'s
  ``attention_mask`` (over the whole static cache) is 0 on its padding and 1
  after it; positions beyond the current token are the causal mask's work;
* ``position_ids`` count the row's real tokens (``cumsum(mask) - 1``, 0 on the
  padding), so each prompt sees the positions it would see alone;
* one ``prefill_batch`` call fills every row's cache, then one ``decode_batch``
  call per step gives every row its next token; the cache slots (one per step)
  are shared by all rows;
* a row that has reached an end token is fed ``pad_token_id`` from then on and
  its further tokens are dropped; the loop ends when every row has ended.

A batch of fewer prompts than the exported ``max_batch`` is filled up with
copies of its last prompt, whose tokens are dropped; more prompts run in
chunks of ``max_batch``. A model exported for one static prompt length
(``prompt_length=``) pads every prompt to that length.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

import numpy as np

from tvm_distx.errors import ArgumentError

__all__ = ["generate_batch", "left_padded"]

logger = logging.getLogger(__name__)

#: The prefix of the resident names of the batched caches (beside the batch-1 ones).
RESIDENT_PREFIX = "batch_"


def left_padded(prompts: Sequence[np.ndarray], batch: int, max_length: int,
                pad_token_id: int, length: int | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The prefill inputs of ``prompts`` padded on the left to the longest (or ``length``).

    Returns
    -------
    input_ids : (batch, longest) int64
    position_ids : (batch, longest) int64
        ``cumsum(mask) - 1`` on the real tokens, 0 on the padding.
    attention_mask : (batch, max_length) int64
        0 on each row's padding, 1 from its first real token on.

    Rows past ``len(prompts)`` repeat the last prompt.
    """
    rows = list(prompts) + [prompts[-1]] * (batch - len(prompts))
    longest = length or max(len(p) for p in rows)
    ids = np.full((batch, longest), pad_token_id, np.int64)
    mask = np.ones((batch, max_length), np.int64)
    for index, prompt in enumerate(rows):
        pad = longest - len(prompt)
        ids[index, pad:] = prompt
        mask[index, :pad] = 0
    positions = np.maximum(np.cumsum(mask[:, :longest], axis=1) - 1, 0)
    return ids, positions, mask


def generate_batch(lm, prompts: Sequence[np.ndarray], max_new_tokens: int,
                   stops: set[int], pad_token_id: int | None,
                   sampler: Callable[[np.ndarray, Sequence[int]], int]) -> list[np.ndarray]:
    """Generation of ``prompts`` on ``lm``'s batched functions; each row's new tokens.

    ``sampler(logits, previous)`` chooses each row's token
    (:class:`tvm_distx.generation.sampling.Sampler`), row after row.

    The prompts run in chunks of the exported batch (``lm.batch_cache.batch``),
    all checked before the first call. Statistics go to ``lm.stats`` (one
    prefill per chunk; one decode per step, counting the tokens of the rows
    still running).

    Raises
    ------
    ArgumentError
        If the padded prompts and the new tokens do not fit the cache, or a
        prompt is longer than a static prompt length.
    """
    limit = lm.batch_cache.max_length
    longest = max(len(p) for p in prompts)
    if max_new_tokens < 1 or min(len(p) for p in prompts) < 1:
        raise ArgumentError(f"generate(max_new_tokens={max_new_tokens}) of prompts of "
                            f"{sorted({len(p) for p in prompts})} tokens: nothing to do",
                            hint="give prompts and max_new_tokens >= 1")
    static = _static_prompt_length(lm)
    if static is not None and longest > static:
        raise ArgumentError(f"generate() got a prompt of {longest} tokens; prefill_batch was "
                            f"exported for prompts of {static}",
                            hint="CausalLM.from_hf(model, prompt_length=None) takes any "
                            "length, or give shorter prompts")
    padded = static or longest
    if padded + max_new_tokens - 1 > limit:
        raise ArgumentError(f"generate(max_new_tokens={max_new_tokens}) of a batch padded to "
                            f"{padded} tokens needs {padded + max_new_tokens - 1} cache "
                            f"positions; the model was exported for {limit}",
                            hint=f"CausalLM.from_hf(model, max_length={padded + max_new_tokens - 1})")
    pad = int(pad_token_id if pad_token_id is not None else 0)
    size, new = lm.batch_cache.batch, []
    for start in range(0, len(prompts), size):
        new += _chunk(lm, prompts[start:start + size], max_new_tokens, stops, pad, static,
                      sampler)
    return new


def _chunk(lm, prompts: Sequence[np.ndarray], max_new_tokens: int, stops: set[int],
           pad: int, static: int | None, sampler) -> list[np.ndarray]:
    """:func:`generate_batch` of at most one batch of prompts (checked)."""
    batch, limit = lm.batch_cache.batch, lm.batch_cache.max_length
    ids, positions, mask = left_padded(prompts, batch, limit, pad, length=static)
    longest = ids.shape[1]
    count = len(prompts)
    lengths = np.array([len(p) for p in prompts] + [len(prompts[-1])] * (batch - count))
    new: list[list[int]] = [[] for _ in range(count)]
    running = np.ones(batch, bool)
    running[count:] = False  # the filler rows: computed, never read
    started = time.perf_counter()
    logits = _step(lm, "prefill_batch", ids, np.arange(longest), positions, mask)
    lm.stats.prefill_seconds += time.perf_counter() - started
    tokens = np.full(batch, pad, np.int64)
    for step in range(max_new_tokens):
        for row in np.flatnonzero(running):
            tokens[row] = sampler(logits[row], [*prompts[row], *new[row]])
            new[row].append(int(tokens[row]))
            if int(tokens[row]) in stops:
                running[row] = False
        if step == max_new_tokens - 1 or not running.any():
            break
        fed = np.where(running, tokens, pad).astype(np.int64)[:, None]
        started = time.perf_counter()
        logits = _step(lm, "decode_batch", fed, np.array([longest + step]),
                       (lengths + step)[:, None].astype(np.int64), mask)
        elapsed = time.perf_counter() - started
        lm.stats.decode_seconds += elapsed
        lm.stats.per_step.append(elapsed)
        lm.stats.new_tokens += int(running.sum())
    logger.debug("batch of %d prompts (padded to %d): %s new tokens", count, longest,
                 [len(n) for n in new])
    return [np.asarray(n, np.int64) for n in new]


def _static_prompt_length(lm) -> int | None:
    """The prompt length ``prefill_batch`` was exported for, None for any (symbolic)."""
    spec = lm.session.manifest.function("prefill_batch").params[0]
    return spec.shape[1] if isinstance(spec.shape[1], int) else None


def _step(lm, function: str, ids, cache_position, positions, mask) -> np.ndarray:
    """One batched call, the caches kept on the ranks; each row's last logits."""
    names = lm.batch_cache.names
    (logits,) = lm.session.run(
        ids, cache_position, positions, mask, function=function,
        state={n: RESIDENT_PREFIX + n for n in names},
        keep={index + 1: RESIDENT_PREFIX + name for index, name in enumerate(names)})
    return np.asarray(logits)[:, -1]
