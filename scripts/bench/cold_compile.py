"""A cold start: ``CausalLM.from_pretrained`` with no compile cache, this checkout against another.

The model is ``llm_prefill.py``'s 443M Llama (``llm_decode.MODEL``: hidden 1024, FFN 4096,
24 layers, 16 query heads and 8 KV heads, vocabulary 32000, untied LM head), random
weights built from a config in code (no download), saved in float32 by ``save_pretrained``
once under ``--workdir``. ``--layers`` and ``--hidden`` make it smaller.

Each start is a fresh Python process with one checkout's package on ``PYTHONPATH``:
``CausalLM.from_pretrained(checkpoint, num_ranks=2, max_length=64, compile_cache=False)``
on 2 MPI ranks (trace, shard, compile, launch), then ``generate(ids, max_new_tokens=1)`` of a
16-token prompt (``--cache``: an empty compile cache instead of none, so the bundle is
also stored, as at a user's first start). The start's time is the process's time from before the import of
tvm_distx to the return of ``from_pretrained``; beside it, the CPU time of that process
(the trace, the sharding and the compile run there; the ranks are other processes),
which a loaded machine disturbs less than the wall time.

Each round starts both checkouts once, in an order that alternates; the table gives
medians over rounds and the ratio this checkout / the other as the median of per-round
ratios (min-max). Both must give the same first token (the script exits non-zero
otherwise).

Usage::

    git worktree add /tmp/before 09a4cb2
    python scripts/bench/cold_compile.py --before /tmp/before --rounds 3
    python scripts/bench/cold_compile.py --before /tmp/before --layers 4 --rounds 1  # quick
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llm_decode  # noqa: E402
from _common import ROOT, median, spread, table  # noqa: E402

START = """
import json, sys, time
started, cpu = time.perf_counter(), time.process_time()
import numpy as np
from tvm_distx.llm.causal_lm import CausalLM
cache = sys.argv[4] if len(sys.argv) > 4 else False  # an empty directory: a cold start
lm = CausalLM.from_pretrained(sys.argv[1], num_ranks=2, max_length=64, compile_cache=cache,
                              timeout=float(sys.argv[3]))
opened, cpu = time.perf_counter(), time.process_time() - cpu
ids = np.random.default_rng(0).integers(0, int(sys.argv[2]), 16)
token = int(lm.generate(ids, max_new_tokens=1)[0, -1])
lm.close()
print(json.dumps({"start_s": opened - started, "cpu_s": cpu, "token": token}))
"""


def _start(checkout: Path, checkpoint: Path, vocab: int, timeout: float,
           cache: bool) -> dict:
    """One cold start with ``checkout``'s package; its seconds and first token."""
    env = dict(os.environ, PYTHONPATH=str(checkout), TVM_DISTX_CACHE="off")
    with tempfile.TemporaryDirectory(prefix="cold-cache-") as empty:
        done = subprocess.run([sys.executable, "-c", START, str(checkpoint), str(vocab),
                               str(timeout), *([empty] if cache else [])],
                              capture_output=True, text=True, env=env, timeout=timeout,
                              cwd=checkout)
    if done.returncode != 0:
        sys.exit(f"a start with {checkout} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _commit(checkout: Path) -> str:
    return subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip() or "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True,
                        help="the checkout to compare against (its root goes on PYTHONPATH)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, help="decoder layers (24 by default)")
    parser.add_argument("--hidden", type=int, help="hidden size (heads of 64)")
    parser.add_argument("--workdir", type=Path,
                        default=Path("/var/cache/tvm-distx/bench/cold_compile"))
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--cache", action="store_true",
                        help="start with an empty compile cache (the bundle is stored, as "
                        "a user's first start does) instead of none")
    args = parser.parse_args()
    config = dict(llm_decode.MODEL)
    if args.hidden:
        heads = max(4, args.hidden // 64)
        config.update(hidden_size=args.hidden, num_attention_heads=heads,
                      num_key_value_heads=max(2, heads // 2), intermediate_size=4 * args.hidden,
                      vocab_size=max(64, args.hidden * 32))
    if args.layers:
        config["num_hidden_layers"] = args.layers
    name = "llama-443m" if config == llm_decode.MODEL else "llama-" + "-".join(
        f"{config[k]}" for k in ("num_hidden_layers", "hidden_size"))
    checkpoint = args.workdir / name
    llm_decode.checkpoint(checkpoint, config, 512)  # built once
    sides = {"after": ROOT, "before": args.before.resolve()}
    times: dict[str, list[float]] = {side: [] for side in sides}
    cpus: dict[str, list[float]] = {side: [] for side in sides}
    tokens = set()
    for round_ in range(args.rounds):
        order = list(sides) if round_ % 2 == 0 else list(sides)[::-1]
        for side in order:
            got = _start(sides[side], checkpoint, config["vocab_size"], args.timeout,
                         args.cache)
            times[side].append(got["start_s"])
            cpus[side].append(got["cpu_s"])
            tokens.add(got["token"])
            print(f"  round {round_ + 1}: {side} {got['start_s']:.1f} s "
                  f"(cpu {got['cpu_s']:.1f} s)", file=sys.stderr, flush=True)
    ratios = [a / b for a, b in zip(times["after"], times["before"])]
    cpu_ratios = [a / b for a, b in zip(cpus["after"], cpus["before"])]
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{stamp}, {args.rounds} rounds, {name} ({config['num_hidden_layers']} layers, "
          f"hidden {config['hidden_size']}), 2 MPI ranks, "
          f"{'an empty compile cache' if args.cache else 'no compile cache'}, load "
          f"{os.getloadavg()[0]:.1f}\n")
    print(table(["checkout", "commit", "cold from_pretrained, median (s)", "per round (s)",
                 "its process's CPU, median (s)"],
                [(side, _commit(path), f"{median(times[side]):.1f}",
                  ", ".join(f"{t:.1f}" for t in times[side]), f"{median(cpus[side]):.1f}")
                 for side, path in sides.items()]))
    print(f"\nafter / before: **{median(ratios):.2f}x** ({spread(ratios)}) wall, "
          f"**{median(cpu_ratios):.2f}x** ({spread(cpu_ratios)}) CPU of the starting process")
    if len(tokens) != 1:
        sys.exit(f"the starts gave different first tokens: {sorted(tokens)}")
    print(f"the same first token from every start ({tokens.pop()})")


if __name__ == "__main__":
    main()
