"""Persistent sessions: the ranks start once, load their weights once, and serve many calls.

Every test runs real MPI ranks. A session's results equal numpy's call after
call; its rank processes and weight loads stay the same across calls; a bad
call leaves it usable; a killed rank ends it with an error naming the rank and
leaves no process or directory behind.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest


import tvm_distx as td
from tvm_distx import ShardingRule
from tvm_distx.passes import AnnotateSharding

from programs import Accumulate
from locations import TESTS_DIR

DATA = TESTS_DIR / "data"


@pytest.fixture(scope="module")
def tensor_parallel():
    """The seed MLP, called twice, Megatron-split over 2 ranks; its weights."""
    mod = td.load_module(DATA / "seed_tensor_parallel.py")
    rules = [ShardingRule(param="A", result="S[1]", function="mlp"),
             ShardingRule(param="B", result="S[0]", function="mlp"),
             ShardingRule(callee="mlp", args={0: "R"}, function="main")]
    rng = np.random.default_rng(0)
    weights = {name: 0.1 * rng.standard_normal((128, 128), dtype="float32") for name in "AB"}
    return td.compile(AnnotateSharding(rules)(mod)), weights


def _mlp_twice(x, weights):
    def mlp(v):
        return np.maximum(v @ weights["A"], 0) @ weights["B"]

    return mlp(mlp(x))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _gone(pids, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def test_calls_reuse_the_ranks_and_their_weights(tensor_parallel):
    exe, weights = tensor_parallel
    rng = np.random.default_rng(1)
    with exe.session(params=weights) as session:
        pids = [p.pid for p in session.ranks]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        for _ in range(3):
            x = rng.standard_normal((128, 128), dtype="float32")
            np.testing.assert_allclose(session.run(x), _mlp_twice(x, weights), atol=1e-5)
            # the same processes, each with its 2 weight shards loaded once
            assert [p.pid for p in session.ranks] == pids and all(_alive(p) for p in pids)
            assert session.weights_loaded == {0: 2, 1: 2}
        assert session.calls == 3
        folder = session._dir
    assert _gone(pids) and not folder.exists()
    with pytest.raises(td.errors.ArgumentError, match="the session is closed"):
        session.run(x)


def test_a_rank_maps_tvms_runtime_library_and_neither_its_compiler_nor_torch(tensor_parallel):
    """Three quarters of a rank's memory before its weights, were they loaded."""
    exe, weights = tensor_parallel
    with exe.session(params=weights) as session:
        x = np.ones((128, 128), dtype="float32")
        np.testing.assert_allclose(session.run(x), _mlp_twice(x, weights), atol=1e-5)
        for rank in session.ranks:
            libraries = {Path(line.split()[-1]).name
                         for line in Path(f"/proc/{rank.pid}/maps").read_text().splitlines()
                         if line.split()[-1].endswith(".so") or ".so." in line.split()[-1]}
            assert "libtvm_runtime.so" in libraries
            assert not {"libtvm_compiler.so", "libtorch_cpu.so"} & libraries


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_ranks_between_calls_sleep_and_each_gets_its_own_message(tensor_parallel):
    """An idle session costs no CPU: no rank spins in an MPI collective waiting for the next
    call (it would take a core from the caller and from rank 0 on every call)."""
    exe, weights = tensor_parallel
    with exe.session(params=weights) as session:
        x = np.ones((128, 128), dtype="float32")
        session.run(x)
        before = {r.pid: _cpu_seconds(r.pid) for r in session.ranks}
        time.sleep(2.0)
        used = {pid: _cpu_seconds(pid) - seconds for pid, seconds in before.items()}
        assert all(u < 0.2 for u in used.values()), used
        np.testing.assert_allclose(session.run(x), _mlp_twice(x, weights), atol=1e-5)


def test_a_bad_call_leaves_the_session_usable(tensor_parallel):
    exe, weights = tensor_parallel
    x = np.ones((128, 128), "float32")
    with exe.session(params=weights) as session:
        with pytest.raises(td.errors.ArgumentError, match="has shape \\(64, 128\\)"):
            session.run(np.ones((64, 128), "float32"))
        with pytest.raises(td.errors.ArgumentError, match="A is a weight stored in the bundle"):
            session.run(x, params={"A": weights["A"]})
        np.testing.assert_allclose(session.run(x), _mlp_twice(x, weights), atol=1e-5)


def test_symbolic_inputs_of_different_sizes_in_one_session():
    exe = td.compile(td.load_module(DATA / "data_parallel_symbolic.py"))
    w = np.random.default_rng(2).standard_normal((64, 32), dtype="float32")
    with exe.session(params={"w": w}) as session:
        for rows in (2, 6, 4):
            x = np.random.default_rng(rows).standard_normal((rows, 64), dtype="float32")
            np.testing.assert_allclose(session.run(x), np.maximum(x @ w, 0), atol=1e-5)


def test_a_rank_killed_between_calls_ends_the_session_naming_it(tensor_parallel):
    exe, weights = tensor_parallel
    x = np.ones((128, 128), "float32")
    session = exe.session(params=weights)
    session.run(x)
    pids = [p.pid for p in session.ranks]
    folder = session._dir
    os.kill(pids[1], signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(td.errors.LaunchError, match="rank 1"):
        session.run(x)
    assert time.monotonic() - started < 30
    assert _gone(pids) and not folder.exists()
    with pytest.raises(td.errors.ArgumentError, match="the session is closed"):
        session.run(x)


def test_an_exception_in_the_caller_stops_the_ranks(tensor_parallel):
    exe, weights = tensor_parallel
    with pytest.raises(KeyboardInterrupt):
        with exe.session(params=weights) as session:
            pids = [p.pid for p in session.ranks]
            raise KeyboardInterrupt
    assert _gone(pids)


def test_a_session_needs_the_programs_rank_count(tensor_parallel):
    exe, _ = tensor_parallel  # disco and emulated sessions: tests/runtime/test_session_backends.py
    with pytest.raises(td.errors.ArgumentError, match="needs 2 ranks, not 4"):
        exe.session(4)




def test_state_stays_on_the_ranks_between_calls():
    """An accumulator kept on the ranks (split by columns, as many rows as the input, a
    run-time extent): each call adds to it in place of the last, and only the scalar result
    comes back. A kept value whose extent no input sets is refused, naming it."""
    exe = td.compile(Accumulate)
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal((8, 16), dtype="float32") for _ in range(3)]
    with exe.session() as session:
        for step in range(3):
            (total,) = session.run(xs[step], state={"acc": "acc"}, keep={1: "acc"})
            np.testing.assert_allclose(total, np.sum(xs[: step + 1]), rtol=1e-5, atol=1e-4)
        with pytest.raises(td.errors.ArgumentError, match="keep= keeps every result"):
            session.run(xs[0], state={"acc": "acc"}, keep={0: "t", 1: "acc"})
        with pytest.raises(td.errors.ArgumentError, match="no parameter named accumulator"):
            session.run(xs[0], state={"accumulator": "acc"})
        with pytest.raises(td.errors.ArgumentError,
                           match="'other' takes 'acc' from state, but its extent m is not set"):
            session.run(xs[0], function="other", state={"acc": "acc"})
        # the state survived the refused calls
        (total,) = session.run(np.zeros((8, 16), "float32"), state={"acc": "acc"},
                               keep={1: "acc"})
        np.testing.assert_allclose(total, np.sum(xs), rtol=1e-5, atol=1e-4)


def test_a_host_that_does_not_answer_fails_the_session_before_launch(tensor_parallel, tmp_path):
    """Rank 0 may run anywhere; a host the remote shell cannot reach is named in one line."""
    exe, weights = tensor_parallel
    shell = tmp_path / "rsh"  # called like ssh; knows no host at all
    shell.write_text("#!/bin/sh\necho \"ssh: Could not resolve hostname $1\" >&2\nexit 255\n")
    shell.chmod(0o755)
    started = time.monotonic()
    with pytest.raises(td.errors.LaunchError, match="host elsewhere.example does not answer: "
                       "ssh: Could not resolve hostname") as info:
        exe.session(params=weights, hosts=["elsewhere.example", "localhost"], rsh=str(shell))
    assert info.value.host == "elsewhere.example" and info.value.reason == "unreachable"
    assert time.monotonic() - started < 30
