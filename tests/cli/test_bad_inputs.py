"""The bad-input corpus (``tests/data/bad/``): every malformed input is refused cleanly.

Each case runs in its own process, forked for it by ``tests/bad_inputs.py --serve`` (which
imports TVM once), so that a segfault, an abort or a hang is a failing case and not a
crash of pytest. A case passes when the
process exits with code 2 (not a signal, not a timeout), names the expected
``tvm_distx`` error class (a ``DistxError``) and message fragment, prints no traceback
and no bare TVM ``InternalError``, and leaves none of the outputs it asked for behind.
Cases that are command lines also run the real ``tvm-distx`` console script and check
its exit code and its one-line ``tvm-distx: error:`` message.

The processes run two at a time; the bundle every bundle case damages a copy of is
built once per session.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

import bad_inputs  # noqa: E402

RUNNER = Path(bad_inputs.__file__)
CASES = bad_inputs.cases()
TIMEOUT = 180.0
WORKERS = 2


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(bad_inputs.NO_TORCH)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("TVM_NUM_THREADS", "1")
    env["COLUMNS"] = "200"
    return env


def _console_script() -> list[str]:
    beside = Path(sys.executable).parent / "tvm-distx"
    if beside.is_file():
        return [str(beside)]
    found = shutil.which("tvm-distx")
    assert found, "the tvm-distx console script is not installed"
    return [found]


@dataclass
class Run:
    """One process of a case: how it ended and which of the case's outputs exist afterwards."""

    argv: list
    returncode: int | None  # None: timed out
    stderr: str
    leftovers: list


def _leftovers(case, workdir: Path) -> list:
    return [p for p in (bad_inputs.substitute(a, workdir) for a in case.absent)
            if Path(p).exists()]


def _run(argv: list, workdir: Path, case) -> Run:
    """A real process (the console script)."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT, env=_env(),
                              cwd=workdir, stdin=subprocess.DEVNULL)
        code, err = done.returncode, done.stderr
    except subprocess.TimeoutExpired as timeout:
        code = None
        err = timeout.stderr.decode(errors="replace") if isinstance(timeout.stderr, bytes) \
            else (timeout.stderr or "")
    return Run(argv, code, err, _leftovers(case, workdir))


class _Server:
    """``tests/bad_inputs.py --serve``: imports TVM once, forks one process per case."""

    def __init__(self) -> None:
        self.process = subprocess.Popen([sys.executable, str(RUNNER), "--serve"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        env=_env(), text=True)

    def run(self, argv: list, workdir: Path, case) -> Run:
        log = workdir / "runner.log"
        request = {"argv": argv, "log": str(log), "timeout": TIMEOUT}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline()
        assert answer, "the fork server died"
        code = json.loads(answer)["returncode"]
        return Run(argv, code, log.read_text(errors="replace"), _leftovers(case, workdir))

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def _outcome(path: Path, root: Path, pristine: Path | None, servers: queue.Queue) -> dict:
    case = bad_inputs.load_case(path)
    out = {}
    api = root / path.stem / "api"
    api.mkdir(parents=True)
    argv = [str(path), "--workdir", str(api)]
    if pristine is not None:
        argv += ["--bundle", str(pristine)]
    server = servers.get()
    try:
        out["runner"] = server.run(argv, api, case)
    finally:
        servers.put(server)
    if case.cli is not None:
        console = root / path.stem / "cli"
        bad_inputs.prepare(case, console, pristine)
        out["cli"] = _run(_console_script() + bad_inputs.argv(case, console), console, case)
    return out


@pytest.fixture(scope="session")
def outcomes(request, tmp_path_factory):
    """Run every selected case (two at a time) on first use."""
    root = tmp_path_factory.mktemp("bad-inputs")
    selected = [item.callspec.params["path"] for item in request.session.items
                if getattr(item, "callspec", None) is not None
                and item.callspec.params.get("path") in CASES]
    needs_bundle = any(bad_inputs.load_case(p).bundle for p in selected)
    servers: queue.Queue = queue.Queue()
    started = [_Server() for _ in range(WORKERS)]
    for server in started:
        servers.put(server)
    try:
        pristine = None
        if needs_bundle:
            pristine = root / "pristine-bundle"
            done = subprocess.run([sys.executable, str(RUNNER), "--build-bundle", str(pristine)],
                                  capture_output=True, text=True, timeout=TIMEOUT, env=_env())
            assert done.returncode == 0, done.stderr
        with ThreadPoolExecutor(WORKERS) as pool:
            futures = {p: pool.submit(_outcome, p, root, pristine, servers) for p in selected}
            return {p: f.result() for p, f in futures.items()}
    finally:
        for server in started:
            server.close()


def _assert_clean(run: Run, where: str) -> None:
    assert run.returncode is not None, f"{where}: hung (no answer in {TIMEOUT:.0f} s)"
    assert run.returncode >= 0, (
        f"{where}: killed by signal {-run.returncode}\n{run.stderr[-3000:]}")
    assert "Traceback" not in run.stderr, f"{where}: an unexpected exception\n{run.stderr[-3000:]}"
    assert "InternalError" not in run.stderr, f"{where}: a bare TVM error\n{run.stderr[-3000:]}"
    assert not run.leftovers, f"{where}: partial output left behind: {run.leftovers}"


@pytest.mark.parametrize("path", CASES, ids=[p.name for p in CASES])
def test_bad_input_is_refused_cleanly(path, outcomes):
    case = bad_inputs.load_case(path)
    runs = outcomes[path]
    runner = runs["runner"]
    _assert_clean(runner, "runner")
    assert runner.returncode != 3, f"{path.name} was accepted without an error"
    assert runner.returncode == 2, f"exit {runner.returncode}\n{runner.stderr[-3000:]}"
    lines = runner.stderr.splitlines()
    error = [line for line in lines if line.startswith("error: ")][-1]
    name, _, message = error[len("error: "):].partition(": ")
    assert name == case.expect, f"expected {case.expect}, got {error}"
    mro = [line for line in lines if line.startswith("mro: ")][-1]
    assert "DistxError" in mro[len("mro: "):].split(","), mro
    assert case.message in message, f"{case.message!r} not in {message!r}"
    if "cli" in runs:
        console = runs["cli"]
        _assert_clean(console, "tvm-distx")
        assert console.returncode == case.exit, (
            f"tvm-distx exited {console.returncode}, expected {case.exit}\n{console.stderr}")
        assert "tvm-distx: error: " in console.stderr, console.stderr
        assert case.message in " ".join(console.stderr.split("\n")), console.stderr


def test_the_corpus_covers_every_category():
    counts = {}
    for path in CASES:
        counts[path.name[:3]] = counts.get(path.name[:3], 0) + 1
    assert sorted(counts) == [f"c{n:02d}" for n in range(1, 13)], counts
    assert all(n >= 3 for n in counts.values()), counts
    assert len(CASES) >= 55
