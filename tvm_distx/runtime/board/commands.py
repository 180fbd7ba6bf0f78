"""The commands of ``python3 -m tvm_distx.runtime.board`` (see :mod:`tvm_distx.runtime.board.__main__`).

``run`` and ``generate`` check the bundle and start the ranks
(:func:`tvm_distx.runtime.board.launch.launch`); ``job run|generate`` is what each rank runs
under ``mpiexec`` (:func:`tvm_distx.runtime.board.job.run_job`), rank 0 doing the command's
work on its :class:`~tvm_distx.runtime.board.job.JobSession`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from tvm_distx.runtime.board.job import MARK, run_job
from tvm_distx.runtime.board.launch import launch
from tvm_distx.bundle.generation import read_generation
from tvm_distx.errors import ArgumentError, DistxError
from tvm_distx.generation.generator import Generator
from tvm_distx.runtime.inputs import load_array, read_inputs, split_item

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """argparse that raises :class:`ArgumentError` on bad usage instead of exiting."""

    def error(self, message: str):
        raise ArgumentError(message, hint=f"see {self.prog} --help")


def _command_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    if command == "run":
        parser.add_argument("-i", "--input", dest="inputs", action="append", default=[],
                            help="an input .npy, in parameter order; NAME=PATH names it")
        parser.add_argument("-o", "--output", type=Path, required=True,
                            help="the results directory (out0.npy, out1.npy, ...)")
        parser.add_argument("--function", default="main", help="the public function to run")
    else:
        prompt = parser.add_mutually_exclusive_group(required=True)
        prompt.add_argument("--ids", type=int, nargs="+", help="the prompt's token ids")
        prompt.add_argument("--input", type=Path, help="the prompt's token ids as .npy")
        parser.add_argument("--max-new-tokens", type=int, default=32)
        parser.add_argument("--stop-at-eos", action="store_true",
                            help="stop at the model's end token")
        parser.add_argument("-o", "--output", type=Path,
                            help="write the prompt and the new tokens as a (1, n) .npy")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="./run.sh", description="Run a tvm-distx bundle with the board's "
                     "Python, numpy and MPI (no TVM).")
    sub = parser.add_subparsers(dest="command", required=True)
    for command, text in (("run", "run a function of the bundle once"),
                          ("generate", "greedy tokens from a generation bundle")):
        p = sub.add_parser(command, help=text)
        p.add_argument("bundle", help="the bundle's directory (run.sh gives it)")
        _command_arguments(p, command)
        p.add_argument("--hostfile", help="hosts, one 'host[:slots]' per line (several boards)")
        p.add_argument("--mpiexec", help="the mpiexec to use (default: PATH's)")
        p.add_argument("--verbose", action="store_true", help="show every rank's output")
    job = sub.add_parser("job", help="one rank's part (started by mpiexec)")
    inner = job.add_subparsers(dest="what", required=True)
    for command in ("run", "generate"):
        p = inner.add_parser(command)
        p.add_argument("bundle")
        _command_arguments(p, command)
    return parser


def _prompt(args) -> np.ndarray:
    if args.ids:
        return np.asarray(args.ids, np.int64)
    return load_array(args.input, "--input file").astype(np.int64).reshape(-1)


def _check_output(args) -> None:
    out = args.output
    if out is None:
        return
    parent = out if args.command == "run" else out.parent
    if out.exists() and args.command == "run" and not out.is_dir():
        raise ArgumentError(f"-o {out} is an existing file", hint="give a directory for -o")
    if not (parent if parent.exists() else parent.parent).exists():
        raise ArgumentError(f"-o {out}: the directory {parent.parent} does not exist",
                            hint="create it first, or give another -o")


def _job(args) -> int:
    if args.what == "run":
        inputs, named = read_inputs(args.inputs)

        def command(session):
            results = session.run(*inputs, params=named, function=args.function)
            results = results if isinstance(results, tuple) else (results,)
            args.output.mkdir(parents=True, exist_ok=True)
            for index, value in enumerate(results):
                np.save(args.output / f"out{index}.npy", value)
            sys.stdout.write(f"wrote {len(results)} result(s) to {args.output}\n")
    else:
        prompt, info = _prompt(args), read_generation(args.bundle)

        def command(session):
            lm = Generator.on(info, session)
            stop = lm.eos_token_id if args.stop_at_eos else None
            tokens = list(lm.stream(prompt, args.max_new_tokens, eos_token_id=stop))
            out = np.concatenate([prompt, np.asarray(tokens, np.int64)])
            if args.output is not None:
                np.save(args.output, out[None, :])
            sys.stdout.write(" ".join(str(t) for t in out) + "\n")
            sys.stderr.write(f"{MARK}generated {len(tokens)} tokens: prefill "
                             f"{lm.stats.prefill_seconds:.2f} s, decode "
                             f"{lm.stats.decode_tokens_per_second:.2f} tokens/s\n")
    return run_job(args.bundle, command)


def main(argv: list[str]) -> int:
    """Run one command line; errors are one line (and a hint), never a traceback."""
    try:
        args = _parser().parse_args(argv)
        if args.command == "job":
            return _job(args)
        _check_output(args)
        if args.command == "run":
            read_inputs(args.inputs)  # refused here, before any rank starts
        else:
            _prompt(args)
            read_generation(args.bundle)
        return launch(args.command, args.bundle, _job_arguments(args), hostfile=args.hostfile,
                      mpiexec=args.mpiexec, verbose=args.verbose)
    except DistxError as err:
        sys.stderr.write(f"error: {_for_cli(err)}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130


def _job_arguments(args) -> list[str]:
    """The command's own arguments for every rank's job, with absolute paths."""
    def absolute(path) -> str:
        return str(Path(path).resolve())

    if args.command == "run":
        out = []
        for item in args.inputs:
            name, path = split_item(item)
            out += ["-i", absolute(path) if name is None else f"{name}={absolute(path)}"]
        return out + ["-o", absolute(args.output), "--function", args.function]
    out = ["--ids", *map(str, args.ids)] if args.ids else ["--input", absolute(args.input)]
    out += ["--max-new-tokens", str(args.max_new_tokens)]
    out += ["--stop-at-eos"] if args.stop_at_eos else []
    return out + (["-o", absolute(args.output)] if args.output is not None else [])


def _for_cli(err: DistxError) -> str:
    text = str(getattr(err, "message", err)).strip()
    hint = err.cli_hint or getattr(err, "hint", None)
    return text + (f"\nhint: {hint}" if hint else "")
