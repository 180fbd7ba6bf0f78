"""Persistent sessions on disco workers and on emulated ranks, as on MPI.

``exe.session(backend="disco")`` keeps disco worker processes (one per rank, rank 0 a
thread of this process) and ``backend="emulate"`` keeps one virtual machine per rank in
this process; both take the calls of ``MPISession`` (``state``/``keep`` included). The
tests serve tiny random Hugging Face models with ``CausalLM`` and compare the tokens
with transformers' ``generate(do_sample=False)``; they check that later calls reuse the
same ranks and weights, and that a killed worker ends the session naming its rank and
leaves no process or shared memory behind.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import tvm_distx as td  # noqa: E402
from tvm_distx.bundle.manifest import Manifest  # noqa: E402
from tvm_distx.llm.causal_lm import CausalLM  # noqa: E402
from tvm_distx.runtime.backends import open_session  # noqa: E402

from hf_tiny import build, greedy, prompt_ids  # noqa: E402
import proc_tools  # noqa: E402
from programs import Accumulate  # noqa: E402
from locations import TESTS_DIR

NEW_TOKENS = 32
PROMPT = 6




def _segments() -> set[str]:
    """The shared-memory descriptors this process holds."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "memfd:" in target or target.startswith("/dev/shm"):
            found.add(f"{fd} {target}")
    return found


def _gone(pids, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(Path(f"/proc/{pid}").exists() for pid in pids):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def llama():
    """Llama with grouped-query attention (4 query heads, 2 key/value heads) on 2 disco ranks."""
    model = build("llama", layers=1)
    with CausalLM.from_hf(model, num_ranks=2, backend="disco",
                          max_length=PROMPT + NEW_TOKENS) as lm:
        yield model, lm


def _session(lm: CausalLM, backend: str):
    """Another session of ``lm``'s bundle (no export, no compile), and a CausalLM on it."""
    session = open_session(lm.session.manifest.root, backend=backend)
    return session, CausalLM(lm.cache, session)


@pytest.fixture(scope="module")
def accumulate():
    return td.compile(Accumulate)


@pytest.fixture(scope="module")
def gpt2():
    """GPT-2: fused q|k|v in one Conv1D, learned positions, a tied head."""
    model = build("gpt2", layers=1)
    with CausalLM.from_hf(model, num_ranks=2, backend="disco",
                          max_length=PROMPT + NEW_TOKENS) as lm:
        yield model, lm


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_disco_generates_the_tokens_of_transformers(family, request):
    model, lm = request.getfixturevalue(family)
    assert type(lm.session).__name__ == "DiscoSession"
    prompt = prompt_ids(PROMPT, seed=len(family))
    out = lm.generate(prompt, max_new_tokens=NEW_TOKENS)
    np.testing.assert_array_equal(out[0], greedy(model, prompt, NEW_TOKENS))
    assert lm.stats.new_tokens == NEW_TOKENS - 1


def test_disco_serves_a_batch_of_prompts_of_different_lengths(llama):
    model, lm = llama
    prompts = [prompt_ids(3, seed=2), prompt_ids(7, seed=3)]
    rows = lm.generate(prompts, max_new_tokens=10)
    assert [len(r) for r in rows] == [13, 17]
    for prompt, row in zip(prompts, rows):
        np.testing.assert_array_equal(row, greedy(model, prompt, 10))


def test_emulated_ranks_generate_the_same_tokens(llama):
    model, lm = llama
    session, emulated = _session(lm, "emulate")
    with emulated:
        prompt = prompt_ids(PROMPT, seed=7)
        out = emulated.generate(prompt, max_new_tokens=NEW_TOKENS)
        np.testing.assert_array_equal(out, lm.generate(prompt, max_new_tokens=NEW_TOKENS))
        np.testing.assert_array_equal(out[0], greedy(model, prompt, NEW_TOKENS))
        assert session.calls == NEW_TOKENS  # one prefill, 31 decodes
    assert session.closed


def test_a_second_generation_neither_relaunches_workers_nor_reloads_weights(llama, monkeypatch):
    """Rank 0 is a thread of this process: every weight it reads goes through here."""
    _, lm = llama
    reads = []
    original = Manifest.read_weight

    def counted(self, rank, name):
        reads.append((rank, name))
        return original(self, rank, name)

    monkeypatch.setattr(Manifest, "read_weight", counted)
    session, fresh = _session(lm, "disco")
    with fresh:
        workers = dict(session._workers.pool.procs)
        pids = [p.pid for p in session.ranks]
        assert pids[0] == os.getpid() and pids[1] == workers[1].pid
        prompt = prompt_ids(PROMPT, seed=8)
        first = fresh.generate(prompt, max_new_tokens=4)
        loaded = dict(session.weights_loaded)
        assert sorted(loaded) == [0, 1] and loaded[0] > 0
        assert len(reads) == loaded[0] == len(set(reads))  # rank 0: each weight read once
        second = fresh.generate(prompt, max_new_tokens=4)
        np.testing.assert_array_equal(second, first)
        assert len(reads) == loaded[0]  # nothing read again, on either rank
        assert session.weights_loaded == loaded
        assert session._workers.pool.procs == workers and workers[1].poll() is None  # not relaunched
        assert [p.pid for p in session.ranks] == pids and session.calls == 8
    assert _gone(pids[1:])
    fresh.close()  # closing twice is fine


def test_a_worker_killed_mid_decode_ends_the_session_naming_it(llama):
    _, lm = llama
    children, segments = proc_tools.children(), _segments()
    session, doomed = _session(lm, "disco")
    stream = doomed.stream(prompt_ids(5, 11), max_new_tokens=10)
    next(stream), next(stream)  # the prefill and one decode step ran
    worker = session.ranks[1].pid
    os.kill(worker, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(td.errors.LaunchError, match="rank 1 died running 'decode'") as info:
        for _ in stream:
            pass
    assert time.monotonic() - started < 30
    assert info.value.rank == 1
    assert _gone([worker]) and proc_tools.children() == children  # no orphan worker
    assert _segments() == segments  # the segment is closed
    assert session.closed
    with pytest.raises(td.errors.ArgumentError, match="the session is closed"):
        doomed.generate(prompt_ids(3, 1), max_new_tokens=2)
    doomed.close()


@pytest.mark.parametrize("backend", ["disco", "emulate"])
def test_state_stays_on_the_ranks_and_bad_calls_leave_the_session_usable(backend, accumulate):
    """MPISession's state/keep test (tests/runtime/test_session.py) on the other backends; then
    Ctrl-C in the caller ends the session."""
    exe = accumulate
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal((8, 16), dtype="float32") for _ in range(3)]
    children = proc_tools.children()
    with pytest.raises(KeyboardInterrupt), exe.session(backend=backend) as session:
        for step in range(3):
            (total,) = session.run(xs[step], state={"acc": "acc"}, keep={1: "acc"})
            np.testing.assert_allclose(total, np.sum(xs[: step + 1]), rtol=1e-5, atol=1e-4)
        with pytest.raises(td.errors.ArgumentError, match="keep= keeps every result"):
            session.run(xs[0], state={"acc": "acc"}, keep={0: "t", 1: "acc"})
        with pytest.raises(td.errors.ArgumentError, match="has shape \\(8, 17\\)"):
            session.run(np.zeros((8, 17), "float32"), state={"acc": "acc"}, keep={1: "acc"})
        # the rows are a run-time extent: 4 rows do not fit the 8 the ranks keep
        with pytest.raises(td.errors.ArgumentError, match="the ranks keep 'acc' of shape "
                           "\\(8, 16\\)"):
            session.run(xs[0][:4], state={"acc": "acc"}, keep={1: "acc"})
        (total,) = session.run(np.zeros((8, 16), "float32"), state={"acc": "acc"},
                               keep={1: "acc"})
        np.testing.assert_allclose(total, np.sum(xs), rtol=1e-5, atol=1e-4)
        # without state, the accumulator is an input and both results come back
        total, new = session.run(xs[0], xs[1])
        np.testing.assert_allclose(new, xs[0] + xs[1], rtol=1e-6)
        assert session.calls == 5
        raise KeyboardInterrupt
    assert session.closed and _gone([p.pid for p in session.ranks if p.pid != os.getpid()])
    assert proc_tools.children() == children
    with pytest.raises(td.errors.ArgumentError, match="the session is closed"):
        session.run(xs[0], xs[1])


@pytest.mark.parametrize("fault, message", [
    ("raise", r"rank 1 failed running 'main': .*injected fault on rank 1"),
    ("hang", r"rank 1 did not finish running 'main' within 1.0 s")], ids=["raise", "hang"])
def test_a_rank_that_raises_or_hangs_ends_the_disco_session_naming_it(
        accumulate, monkeypatch, fault, message):
    from tvm_distx.runtime import disco

    monkeypatch.setattr(disco, "_GRACE", 1.0)
    monkeypatch.setenv("TVM_DISTX_FAULT", f"1:{fault}")  # the workers start with it
    children, segments = proc_tools.children(), _segments()
    session = accumulate.session(backend="disco")
    started = time.monotonic()
    with pytest.raises(td.errors.LaunchError, match=message) as info:
        session.run(np.ones((8, 16), "float32"), np.ones((8, 16), "float32"), timeout=1.0)
    assert info.value.rank == 1 and time.monotonic() - started < 15
    assert session.closed and _gone([session.ranks[1].pid]) and proc_tools.children() == children
    assert _segments() == segments


def test_sessions_refuse_an_unknown_backend_and_options_they_do_not_take(accumulate):
    exe = accumulate
    with pytest.raises(td.errors.ArgumentError, match="unknown backend 'nccl'"):
        exe.session(backend="nccl")
    with pytest.raises(td.errors.ArgumentError, match="a disco session takes no option hosts"):
        exe.session(backend="disco", hosts=["localhost"])


def test_symbolic_inputs_of_any_size_and_a_growing_segment_on_disco():
    """Batches of 2, 8192 and 4 rows: the 2 MB call outgrows the segment's 1 MB input area,
    which grows; the ranks map it anew and the session carries on."""
    exe = td.compile(td.load_module(TESTS_DIR / "data" / "data_parallel_symbolic.py"))
    w = np.random.default_rng(2).standard_normal((64, 32), dtype="float32")
    with exe.session(params={"w": w}, backend="disco") as session:
        size = session._workers.layout.size
        for rows in (2, 8192, 4):
            x = np.random.default_rng(rows).standard_normal((rows, 64), dtype="float32")
            np.testing.assert_allclose(session.run(x), np.maximum(x @ w, 0), atol=1e-4)
        assert session._workers.layout.size > size and session.weights_loaded == {0: 1, 1: 1}
