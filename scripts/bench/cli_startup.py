"""Command-line start-up: the time from a ``tvm-distx`` command to its first line of output.

Three commands, each a fresh process from the environment this script runs in (the
``.venv`` that ``scripts/test`` builds), against the floor that every command which
compiles pays:

* **import tvm**: ``python -c "import tvm"`` (in this environment TVM's FFI imports
  PyTorch too, because it is installed);
* **explain**: ``tvm-distx explain model.py --rules rules.json`` on the seed program
  (``tests/data/seed_tensor_parallel.py``) with the tour's rules: it loads the
  module, propagates the sharding and prints its tables;
* **run --help**: ``tvm-distx run --help``;
* **--version**: ``tvm-distx --version``.

Each time is from the start of the process to the first line it writes on standard
output. Each round runs every command once, in an order that rotates; the table gives
medians over rounds, and each command's time over ``import tvm`` as the median of
per-round ratios (min-max).

Usage::

    python scripts/bench/cli_startup.py --rounds 7
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, median, spread, table  # noqa: E402

RULES = [{"param": "A", "result": "S[1]", "function": "mlp"},
         {"param": "B", "result": "S[0]", "function": "mlp"}]


def first_line_seconds(command: list[str], cwd: Path) -> float:
    """Seconds from starting ``command`` to its first line on standard output."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    began = time.perf_counter()
    with subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True) as proc:
        line = proc.stdout.readline()
        seconds = time.perf_counter() - began
        proc.stdout.read()
        code = proc.wait()
    if code != 0 or not line:
        raise SystemExit(f"{' '.join(command)} failed (exit {code})")
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="launches of every command")
    parser.add_argument("--json", help="also write the per-round figures to this JSON file")
    opts = parser.parse_args(argv)
    tool = shutil.which("tvm-distx", path=str(Path(sys.executable).parent))
    if tool is None:
        raise SystemExit("tvm-distx is not installed in this environment (pip install -e .)")
    commands = {
        "import tvm": [sys.executable, "-c", "import tvm; print('ok')"],
        "tvm-distx explain model.py --rules rules.json":
            [tool, "explain", "model.py", "--rules", "rules.json"],
        "tvm-distx run --help": [tool, "run", "--help"],
        "tvm-distx --version": [tool, "--version"],
    }
    names = list(commands)
    with tempfile.TemporaryDirectory(prefix="distx-startup-") as tmp:
        work = Path(tmp)
        shutil.copy(ROOT / "tests" / "data" / "seed_tensor_parallel.py", work / "model.py")
        (work / "rules.json").write_text(json.dumps(RULES))
        for command in commands.values():  # warm the file cache, check every command works
            first_line_seconds(command, work)
        rounds: list[dict[str, float]] = []
        for r in range(opts.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            rounds.append({name: first_line_seconds(commands[name], work) for name in order})
    floor = "import tvm"
    rows = []
    for name in names:
        times = [one[name] for one in rounds]
        ratios = [one[name] / one[floor] for one in rounds]
        rows.append((f"`{name}`", f"{median(times):.2f}", f"{min(times):.2f}-{max(times):.2f}",
                     "-" if name == floor else f"**{median(ratios):.2f}** ({spread(ratios)})"))
    print(f"{opts.rounds} rounds, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f}\n")
    print(table(["command", "seconds to first line (median)", "min-max", "over import tvm"],
                rows))
    if opts.json:
        Path(opts.json).write_text(json.dumps(rounds, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
