"""CausalLM across the test hosts: a tiny Llama with grouped-query attention gives the same
logits as on this machine and transformers' greedy tokens; a host killed mid-generation is
named.

The model has 8 query heads and 4 key/value heads, so it splits 2 and 4 ways. Each rank
count is compiled once, by ``CausalLM.from_hf(..., hosts=...)`` across the test hosts; the
2-rank executable also serves the same weights on this machine alone: the reference.
"""

from __future__ import annotations

import os
import re
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tvm_distx.errors import LaunchError  # noqa: E402
from tvm_distx.llm.causal_lm import CausalLM  # noqa: E402

from hf_tiny import VOCAB, greedy, prompt_ids  # noqa: E402
from host_leftovers import assert_nothing_new, everything  # noqa: E402

MAX_LENGTH = 24
NEW_TOKENS = 10
FUNCTIONS = ("prefill", "decode")


@pytest.fixture(scope="module")
def model():
    """A one-layer Llama, 8 query heads sharing 4 key/value heads, random weights."""
    torch.manual_seed(30)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=1,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
        tie_word_embeddings=False, initializer_range=0.2)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def across2(test_hosts, model):
    """2 ranks with rank 0 on the second test host (not this machine) and rank 1 on the first;
    the session persists for the module."""
    t1, t2, _ = test_hosts.names
    with CausalLM.from_hf(model, num_ranks=2, hosts=f"{t2},{t1}", rsh=test_hosts.rsh,
                          max_length=MAX_LENGTH) as lm:
        yield lm


def _here(lm: CausalLM) -> CausalLM:
    """The same compiled program and weights, on MPI ranks on this machine alone."""
    return CausalLM(lm.cache, lm.exe.session(lm.exe.num_ranks, params=lm.weights,
                                             function=FUNCTIONS), eos_token_id=lm.eos_token_id)


@pytest.fixture(scope="module")
def here2(across2):
    with _here(across2) as lm:
        yield lm


def _logits(lm: CausalLM, prompt: np.ndarray, steps: int) -> list[np.ndarray]:
    """The prefill's logits, then each greedy decode step's (the caches stay on the ranks)."""
    names = lm.cache.names
    state = {n: n for n in names}
    keep = {i + 1: n for i, n in enumerate(names)}
    (logits,) = lm.session.run(prompt[None, :], np.arange(len(prompt)), function="prefill",
                               state=state, keep=keep)
    out = [np.asarray(logits)]
    for step in range(steps):
        token = int(out[-1][0, -1].argmax())
        (logits,) = lm.session.run(np.array([[token]], prompt.dtype),
                                   np.array([len(prompt) + step]), function="decode",
                                   state=state, keep=keep)
        out.append(np.asarray(logits))
    return out


def _same_as_here(across: CausalLM, here: CausalLM, prompt: np.ndarray) -> None:
    for got, want in zip(_logits(across, prompt, 4), _logits(here, prompt, 4), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_persistent_session_with_rank_0_on_another_host_generates_transformers_tokens(
        test_hosts, model, across2, here2):
    t1, t2, _ = test_hosts.names
    assert test_hosts.caller not in (t1, t2)
    assert [(r.rank, r.host) for r in across2.session.ranks] == [(0, t2), (1, t1)]
    pids = [r.pid for r in across2.session.ranks]
    for seed in (1, 2):  # one session, two generations
        prompt = prompt_ids(4 + seed, seed=seed)
        want = greedy(model, prompt, NEW_TOKENS)
        assert len(set(want[len(prompt):])) > 2  # varied tokens, not one repeated
        np.testing.assert_array_equal(across2.generate(prompt, NEW_TOKENS)[0], want)
        _same_as_here(across2, here2, prompt)
    assert [r.pid for r in across2.session.ranks] == pids
    assert across2.session.calls >= 2 * NEW_TOKENS


def test_four_ranks_on_three_hosts_equal_one_host(test_hosts, model, here2, tmp_path):
    """Slots 2+1+1 from a hostfile; the reference on one host is the 2-rank one (its
    partial sums add up in another order, well within 1e-5)."""
    t1, t2, t3 = test_hosts.names
    hostfile = test_hosts.hostfile(tmp_path / "hosts.txt", [2, 1, 1], [t1, t2, t3])
    with CausalLM.from_hf(model, num_ranks=4, hostfile=hostfile, rsh=test_hosts.rsh,
                          max_length=MAX_LENGTH) as across:
        assert [r.host for r in across.session.ranks] == [t1, t1, t2, t3]
        prompt = prompt_ids(6, seed=3)
        np.testing.assert_array_equal(across.generate(prompt, NEW_TOKENS)[0],
                                      greedy(model, prompt, NEW_TOKENS))
        _same_as_here(across, here2, prompt)


def test_two_stages_on_two_hosts_each_hold_their_layers_and_generate_transformers_tokens(
        test_hosts, tmp_path):
    """Stage 0 (layer 0, the embedding) on one host, stage 1 (layer 1, the head) on the
    other: the activations of each prompt, of its own length, cross the hosts' link."""
    torch.manual_seed(31)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
        tie_word_embeddings=False, initializer_range=0.2)
    model = transformers.LlamaForCausalLM(config).eval()
    t1, t2, _ = test_hosts.names
    hostfile = test_hosts.hostfile(tmp_path / "hosts.txt", [1, 1], [t1, t2])
    with CausalLM.from_hf(model, num_ranks=2, stages=2, hostfile=hostfile, rsh=test_hosts.rsh,
                          max_length=MAX_LENGTH, compile_cache=False) as lm:
        assert [r.host for r in lm.session.ranks] == [t1, t2]
        for seed in (4, 5):
            prompt = prompt_ids(3 + seed, seed=seed)
            np.testing.assert_array_equal(lm.generate(prompt, NEW_TOKENS)[0],
                                          greedy(model, prompt, NEW_TOKENS))


def test_a_hosts_ranks_killed_mid_generation_are_named_and_leave_nothing(
        test_hosts, across2):
    """Another session of the same program, rank 1 on the third host: that host's rank is
    killed after the first tokens. Nothing of that session stays on any host nor here, and
    the persistent session goes on."""
    t1, _, t3 = test_hosts.names
    before = everything(test_hosts)
    session = across2.exe.session(2, params=across2.weights, function=FUNCTIONS,
                                  hosts=[t1, t3], rsh=test_hosts.rsh)
    owned = list(session._owned)  # its bundle, here
    prompt = prompt_ids(5, seed=4)
    tokens = CausalLM(across2.cache, session).stream(prompt, NEW_TOKENS)
    try:
        first = [next(tokens), next(tokens)]
        test_hosts.run(t3, ["pkill", "-KILL", "-f", f"[m]pi_rank .*{session._tag}"])
        started = time.monotonic()
        with pytest.raises(LaunchError) as caught:
            list(tokens)
        elapsed = time.monotonic() - started
    finally:
        session.close()
    err = caught.value
    assert elapsed < 30, f"{elapsed:.1f} s"
    assert (err.reason, err.rank, err.host) == ("killed", 1, t3)
    line = str(err).splitlines()[0]
    assert re.fullmatch(f"\\[launch\\] rank 1 on {t3} \\(pid \\d+\\) died with status 9 "
                        "\\(SIGKILL\\) running 'decode'", line), line
    assert_nothing_new(test_hosts, before)
    assert not [p for p in owned if os.path.exists(p)]
    # the persistent session, on other ranks of the same hosts, goes on
    assert not across2.session.closed
    np.testing.assert_array_equal(across2.generate(prompt, 2)[0][len(prompt):], first)
