"""Sampling as transformers defines it: each processor against transformers' own, the draw
against the processed softmax (a chi-square test), and the options' validation.

The runs on a model's ranks (seeded determinism across backends, ``top_k=1`` equal to
greedy, the first sampled token's distribution) are in ``tests/llm/test_causal_lm.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import tvm_distx as td  # noqa: E402
from tvm_distx.generation.sampling import Sampler, Sampling  # noqa: E402

VOCAB = 64


def _transformers_scores(logits: np.ndarray, previous, sampling: Sampling) -> np.ndarray:
    """The same processing through transformers' processors, in ``generate``'s order."""
    from transformers import generation as g

    processors = [g.RepetitionPenaltyLogitsProcessor(sampling.repetition_penalty)]
    if sampling.do_sample:
        processors += [g.TemperatureLogitsWarper(sampling.temperature)]
        if sampling.top_k:
            processors += [g.TopKLogitsWarper(sampling.top_k)]
        if sampling.top_p < 1:
            processors += [g.TopPLogitsWarper(sampling.top_p)]
        if sampling.min_p:
            processors += [g.MinPLogitsWarper(sampling.min_p)]
    ids = torch.tensor([list(previous)], dtype=torch.long)
    scores = torch.tensor(logits[None, :], dtype=torch.float64)
    for processor in processors:
        scores = processor(ids, scores)
    return scores[0].numpy()


OPTIONS = [
    dict(),                                                   # greedy
    dict(repetition_penalty=1.3),                             # greedy with a penalty
    dict(do_sample=True),                                     # top_k 50 by default
    dict(do_sample=True, temperature=0.7, top_k=0),
    dict(do_sample=True, top_k=5),
    dict(do_sample=True, top_k=0, top_p=0.8),
    dict(do_sample=True, top_k=0, min_p=0.2),
    dict(do_sample=True, temperature=1.5, top_k=20, top_p=0.9, min_p=0.05,
         repetition_penalty=1.2),
]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "greedy")
def test_each_processor_equals_transformers(options):
    rng = np.random.default_rng(3)
    sampling = Sampling(**options)
    for trial in range(5):
        logits = rng.normal(0, 2, VOCAB)
        logits[rng.integers(0, VOCAB, 3)] = logits.max()  # ties
        previous = rng.integers(0, VOCAB, 6)
        got = sampling.processed(logits, previous)
        want = _transformers_scores(logits, previous, sampling)
        np.testing.assert_array_equal(np.isinf(got), np.isinf(want), err_msg=f"trial {trial}")
        kept = ~np.isinf(want)
        np.testing.assert_allclose(got[kept], want[kept], rtol=1e-12)


def test_the_draws_follow_the_processed_distribution():
    logits = np.random.default_rng(0).normal(0, 1.5, VOCAB)
    sampling = Sampling(do_sample=True, temperature=0.8, top_k=12, top_p=0.95, seed=11)
    probs = sampling.probabilities(logits)
    sampler = Sampler(sampling)
    draws = np.bincount([sampler(logits) for _ in range(20000)], minlength=VOCAB)
    kept = probs > 0
    assert draws[~kept].sum() == 0  # a token the warpers removed is never drawn
    _, p_value = stats.chisquare(draws[kept], probs[kept] * draws.sum())
    assert p_value > 1e-3, p_value


def test_a_seed_gives_the_same_draws_and_top_k_1_is_greedy():
    logits = np.random.default_rng(1).normal(0, 1, VOCAB)
    first = [Sampler(Sampling(do_sample=True, seed=5))(logits) for _ in range(3)]
    assert len(set(first)) == 1
    run = Sampler(Sampling(do_sample=True, seed=5))
    assert [run(logits) for _ in range(50)] != [first[0]] * 50  # draws vary along a run
    assert Sampler(Sampling(do_sample=True, top_k=1, seed=9))(logits) == int(logits.argmax())


@pytest.mark.parametrize("options, message", [
    (dict(temperature=0.0), r"temperature=0.0: must be > 0"),
    (dict(top_k=-1), r"top_k=-1: must be an int >= 0"),
    (dict(top_p=1.5), r"top_p=1.5: must be in \(0, 1\]"),
    (dict(min_p=-0.1), r"min_p=-0.1: must be in \[0, 1\]"),
    (dict(repetition_penalty=0), r"repetition_penalty=0: must be > 0"),
    (dict(seed=-2), r"seed=-2: must be an int >= 0"),
    (dict(top_k=2.5), r"top_k=2.5"),
])
def test_an_option_out_of_range_is_refused_naming_it(options, message):
    with pytest.raises(td.errors.ArgumentError, match=message) as err:
        Sampling(**options)
    assert "generate(" in err.value.hint


def test_an_unknown_option_is_refused_with_the_known_ones():
    with pytest.raises(td.errors.ArgumentError, match="unknown option.*top_q") as err:
        Sampling.of({"top_q": 0.9})
    assert "top_p" in err.value.hint
