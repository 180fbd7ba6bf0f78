"""The ``tvm-distx`` command line (also ``python -m tvm_distx``).

``tvm-distx run BUNDLE -n N [--backend mpi] [--function main] [-i x.npy ...] [-o OUT]``
runs a bundle on N ranks. Inputs are global ``.npy`` files in the order of
the function's parameters that are not weights stored in the bundle; the
results are written to ``OUT/out0.npy``, ``OUT/out1.npy``, ...

Errors are one readable line and a hint on stderr (the traceback only with
``--verbose``). Exit codes: 0 success, 1 a run that failed, 2 bad usage or
input (argparse's convention), 130 interrupted.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import numpy as np

from .errors import ArgumentError, DistxError, LaunchError

__all__ = ["main"]

logger = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def _run(args: argparse.Namespace) -> int:
    from .runtime.launcher import launch

    if args.backend != "mpi":
        raise ArgumentError(f"a bundle runs with --backend mpi, not {args.backend!r}",
                            hint="use tvm_distx.compile(...).run(backend='disco') from Python "
                            "for disco")
    inputs = []
    for path in args.inputs:
        if not Path(path).is_file():
            raise ArgumentError(f"input file {path} does not exist")
        try:
            inputs.append(np.load(path, allow_pickle=False))
        except ValueError as err:
            raise ArgumentError(f"input file {path} is not a .npy array ({err})") from None
    hosts = [h for h in args.hosts.split(",") if h] if args.hosts else None
    results = launch(args.bundle, inputs, num_ranks=args.n, function=args.function,
                     timeout=args.timeout, hosts=hosts)
    results = results if isinstance(results, tuple) else (results,)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    for index, value in enumerate(results):
        np.save(out / f"out{index}.npy", value)
    sys.stdout.write(f"wrote {len(results)} result(s) to {out}\n")
    return EXIT_OK


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tvm-distx",
                                     description="Sharding, lowering and multi-rank execution "
                                     "for TVM Relax's distributed IR.")
    parser.add_argument("--verbose", "-v", action="store_true",
                        help="log progress and show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a bundle on N ranks")
    run.add_argument("bundle", type=Path, help="a directory written by DistExecutable.export")
    run.add_argument("-n", type=int, required=True, help="the number of ranks")
    run.add_argument("--backend", default="mpi", choices=["mpi", "disco"])
    run.add_argument("--function", default="main")
    run.add_argument("-i", "--inputs", nargs="*", default=[], metavar="NPY",
                     help="global inputs, in parameter order")
    run.add_argument("-o", "--output", default="out", help="directory for the results")
    run.add_argument("--timeout", type=float, default=300.0)
    run.add_argument("--hosts", default=None,
                     help="comma-separated hosts for mpiexec -hosts (the bundle must be at the "
                     "same path on each)")
    run.set_defaults(handler=_run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return EXIT_INTERRUPTED
    except DistxError as err:
        if args.verbose:
            logger.exception("tvm-distx failed")
        sys.stderr.write(f"tvm-distx: error: {err}\n")
        return EXIT_FAILED if isinstance(err, LaunchError) else EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
