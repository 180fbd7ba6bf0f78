"""``tvm-distx run``: a bundle run on its ranks, the results saved as ``.npy`` files.

``BUNDLE -n N [--backend mpi|disco|emulate] [-i X.npy ...] [-o OUT]`` launches the
bundle's ranks (on several hosts with ``--hostfile F`` or ``--hosts a:2,b``, see
:mod:`tvm_distx.cli.hosts`) and writes ``OUT/out<i>.npy``, one file per result.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from tvm_distx.cli.arguments import add_backend_argument, positive
from tvm_distx.cli.hosts import add_host_arguments, session_options
from tvm_distx.cli.inputs import EXIT_OK, _output_directory, _progress
from tvm_distx.runtime.backends import launch
from tvm_distx.runtime.inputs import read_inputs

__all__ = ["add_parser", "run"]


def add_parser(sub) -> argparse.ArgumentParser:
    """The ``run`` subcommand's parser, added to ``sub``."""
    p = sub.add_parser("run", help="run a bundle on N ranks")
    p.add_argument("bundle", type=Path, help="a directory written by compile or bundle")
    p.add_argument("-n", "--ranks", dest="n", type=positive(int), default=None,
                   help="the number of ranks; the bundle fixes it, so this only checks it")
    add_backend_argument(p)
    p.add_argument("--function", default="main",
                   help="the bundle's function to run (default: %(default)s)")
    p.add_argument("-i", "--inputs", nargs="+", action="extend", default=[], metavar="NPY",
                   help="global inputs, in parameter order (-i a.npy b.npy, or -i a.npy -i b.npy); "
                   "NAME=PATH gives a parameter by name (-i x=x.npy)")
    p.add_argument("-o", "--output", default="out", help="directory for the results")
    p.add_argument("--timeout", type=positive(float), default=300.0,
                   help="seconds before a stuck run is stopped")
    add_host_arguments(p)
    p.set_defaults(handler=run)
    return p


def run(args: argparse.Namespace) -> int:
    """``tvm-distx run``: launch the bundle's ranks on the inputs and save the results."""
    _output_directory(args.output, "-o")  # before any rank starts, not after the run
    # "-i x.npy" is the next input in parameter order; "-i A=A.npy" names its parameter
    inputs, named = read_inputs(args.inputs)
    options = session_options(args)
    ranks = f"{args.n} ranks" if args.n else "its ranks"
    with _progress(f"running {ranks} ({args.backend})"):
        results = launch(args.bundle, inputs, params=named, num_ranks=args.n,
                         function=args.function,
                         timeout=args.timeout, backend=args.backend, **options)
    results = results if isinstance(results, tuple) else (results,)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    for index, value in enumerate(results):
        np.save(out / f"out{index}.npy", value)
    sys.stdout.write(f"wrote {len(results)} result(s) to {out}\n")
    return EXIT_OK
