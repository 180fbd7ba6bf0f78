"""The stress driver: ``PYTHONPATH=tests python -m randprog --cases N [--seed S]`` (or ``scripts/stress``)."""

from __future__ import annotations

from typing import Sequence

from randprog.check import report, run_case
from randprog.draw import SeededDrawer
from randprog.generate import generate
from randprog.numpy_reference import random_inputs


def main(argv: Sequence[str] | None = None) -> int:
    """Stress driver: ``PYTHONPATH=tests python -m randprog --cases N [--seed S]``.

    Runs the seeded programs ``S .. S+N-1`` on the emulated backend, prints
    every failing seed with its program, and a summary line. Returns 1 if any
    case failed.
    """
    import argparse
    import logging
    import time
    import traceback

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=None,
                        help="first seed (default: from the clock, printed)")
    parser.add_argument("--backend", default="emulate", choices=("emulate", "mpi", "disco"))
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    first = args.seed if args.seed is not None else int(time.time()) % 1_000_000 * 1000
    print(f"stress: seeds {first} .. {first + args.cases - 1} on {args.backend}", flush=True)
    counts = {"ok": 0, "failed": 0}
    failed = []
    started = time.monotonic()
    for seed in range(first, first + args.cases):
        program = generate(SeededDrawer(seed))
        try:
            run_case(program, random_inputs(program, seed), args.backend)
            status = "ok"
        except Exception:  # noqa: BLE001 - every failure is reported, then counted
            status = "failed"
            failed.append(seed)
            print(f"FAILED {report(program, seed)}\n{traceback.format_exc()}", flush=True)
        counts[status] += 1
        if args.verbose or (seed - first + 1) % 100 == 0:
            print(f"  {seed - first + 1}/{args.cases}: {counts}", flush=True)
    elapsed = time.monotonic() - started
    print(f"stress: {args.cases} cases from seed {first} in {elapsed:.0f} s: "
          f"{counts['ok']} equal to numpy, {counts['failed']} failed"
          + (f" (seeds {', '.join(map(str, failed))})" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
