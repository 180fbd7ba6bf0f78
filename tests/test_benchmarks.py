"""Every benchmark of ``scripts/bench`` at its smallest size, to keep them working.

The numbers of such a run mean nothing (sizes and repeats are tiny); what is
checked is that each benchmark runs from this checkout, checks its contenders'
outputs against numpy (they exit non-zero otherwise), prints its tables, and
that ``run_all.py`` writes ``results.md`` and the plot.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_benchmark_runs_at_its_smallest_size_and_writes_the_results(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "run_all.py"),
                           "--smoke", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = (tmp_path / "results.md").read_text()
    assert "Made by `scripts/bench/all --smoke`" in results
    for title in ("## 1. Compile time against model depth",
                  "## 2. Bytes moved by every change of placement",
                  "## 3. Collectives on 2 ranks", "## 4. Tensor-parallel MLP forward"):
        assert title in results
    # one row per contender, and the verdicts the README quotes
    assert "| 2 | " in results  # the 2-layer row of compile_scaling
    assert "OK: all 12 plans meet the lower bound" in results
    assert "| (2,) | 12 | 12 |" in results  # ours optimal on every transition of (2,)
    for contender in ("(a) ours MPI via VM", "(b) mpi4py", "(c) ours disco shm", "(d) gloo"):
        assert contender in results
    for contender in ("ours, 2 ranks over MPI", "DTensor, 2 ranks over gloo", "numpy"):
        assert contender in results
    # time to first token: ours on 2 ranks gives transformers' first token at every length
    prefill = results.split("## 5. Llama time to first token")[1].split("## 6.")[0]
    assert re.search(r"\| ours, 2 ranks over MPI \(1 thread each\) \|[^\n]* \| yes \|", prefill)
    # token generation: our tokens equal transformers', our matrix-vector kernel is chosen
    assert "## 6. Llama token generation" in results
    assert re.search(r"\| ours, 2 ranks over MPI \(1 thread each\) \|[^\n]* \| yes \|", results)
    assert "| 1x64 @ 64x256 | matvec |" in results
    # the smoke run never builds or runs llama.cpp (llm_decode.py --build-llama-cpp does)
    assert "llama.cpp: not run (--no-llama-cpp)." in results
    assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_benchmarks_across_test_hosts_run_and_take_their_hosts_down():
    """``collectives.py --hosts`` and ``llm_decode.py --hosts`` at their smallest sizes."""
    bench = ROOT / "scripts" / "bench"
    runs = {"collectives": ["--sizes", "1", "--rounds", "1", "--jobs", "1"],
            "llm_decode": ["--hidden", "64", "--layers", "1", "--prompt", "4",
                           "--new-tokens", "4", "--rounds", "1"]}
    out = {}
    for name, args in runs.items():
        done = subprocess.run([sys.executable, str(bench / f"{name}.py"), "--hosts", *args],
                              cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        out[name] = done.stdout
        k = re.search(r"k(\d+)t1", done.stdout).group(1)
        assert not Path(f"/run/tvm-distx-testhosts/{k}").exists()  # down again
    for row in ("| allreduce | 1 MiB | (a) ours MPI via VM |", "| allgather | 1 MiB | (b) mpi4py |"):
        assert row in out["collectives"]
    assert "two hosts (TCP) ms" in out["collectives"]
    assert re.search(r"\| 1 rank on each of k\d+t1 and k\d+t2 \(TCP\) \|[^\n]* \| yes \|",
                     out["llm_decode"])


def test_the_start_up_benchmark_times_every_command_against_import_tvm():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "cli_startup.py"),
                           "--rounds", "1"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for command in ("import tvm", "tvm-distx explain model.py --rules rules.json",
                    "tvm-distx run --help", "tvm-distx --version"):
        assert re.search(rf"\| `{re.escape(command)}` \| \d+\.\d\d \|", done.stdout), command
