"""The ``tvm-distx`` command line (also ``python -m tvm_distx``).

``tvm-distx bundle MODULE.py --rules rules.json [--weights w.npz] --target x86|rvv -o DIR``
compiles an annotated module into a bundle (``--check`` runs an RVV bundle's kernels
under qemu).

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


def _bundle(args: argparse.Namespace) -> int:
    import json

    from . import compile as compile_module
    from .passes import AnnotateSharding
    from .rules import ShardingRule
    from .script import load_module

    mod = load_module(args.module)
    if args.rules:
        try:
            data = json.loads(Path(args.rules).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ArgumentError(f"cannot read rules from {args.rules}: {err}",
                                hint='give a JSON list such as [{"param": "A", "result": '
                                '"S[1]", "function": "mlp"}]') from None
        rules = [ShardingRule(**{**r, "args": {int(k): v for k, v in r.get("args", {}).items()}})
                 for r in data]
        mod = AnnotateSharding(rules)(mod)
    weights = {}
    if args.weights:
        with np.load(args.weights, allow_pickle=False) as archive:
            weights = {name: archive[name] for name in archive.files}
    options = {"vlen": args.vlen} if args.vlen else {}
    exe = compile_module(mod, target=args.target, **options)
    out = exe.export(args.output, params=weights, function=args.function)
    if args.check and exe.target.is_riscv:
        from .rvv import check_kernels

        checks = check_kernels(out / "kernels", vlen=args.vlen or 128)
        for check in checks:
            sys.stdout.write(f"kernel {check.name}: max |error| {check.max_error:g} under qemu, "
                             f"vector code {'ran' if check.vector_ran else 'absent'}\n")
    sys.stdout.write(f"wrote the {exe.target.name} bundle for {exe.num_ranks} ranks to {out}\n")
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
    bundle = sub.add_parser("bundle", help="compile an annotated module into a bundle")
    bundle.add_argument("module", type=Path, help="a TVMScript file")
    bundle.add_argument("--rules", type=Path, help="sharding rules, a JSON list of "
                        "ShardingRule fields")
    bundle.add_argument("--weights", type=Path, help="an .npz of global weights by parameter")
    bundle.add_argument("--target", default="x86", choices=["x86", "rvv"])
    bundle.add_argument("--vlen", type=int, default=None, help="RVV vector length in bits")
    bundle.add_argument("--function", default="main")
    bundle.add_argument("--check", action="store_true",
                        help="for rvv: run every kernel under qemu against this host")
    bundle.add_argument("-o", "--output", type=Path, required=True)
    bundle.set_defaults(handler=_bundle)
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
