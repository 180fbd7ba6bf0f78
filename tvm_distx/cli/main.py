"""The ``tvm-distx`` command line (also ``python -m tvm_distx``).

==============  ===========================================================================
subcommand      what it does
==============  ===========================================================================
``annotate``    ``MODULE.py --rules R`` -> the module with ``annotate_sharding`` calls
``propagate``   ``MODULE.py [--rules R]`` -> every tensor typed ``R.DTensor``
``explain``     ``MODULE.py [--rules R] [--value F:V] [--png P]`` -> the sharding tables,
                the comm report, and optionally how one value is cut across the ranks
``plan``        ``MODULE.py [--rules R]`` -> the comm report: every collective, bytes/rank
``compile``     ``MODULE.py [--rules R] [--weights W.npz] --target x86|rvv -o DIR`` -> a
                bundle
``bundle``      as ``compile``, and for ``--target rvv`` every kernel is checked under qemu
``run``         ``BUNDLE -n N [--backend mpi|disco|emulate] [-i X.npy ...] [-o OUT]`` -> results;
                on several hosts with ``--hostfile F`` (or ``--hosts a:2,b``)
``generate``    ``MODEL --ids 1 15 22 [--backend mpi|disco|emulate] [-n N]`` -> greedy
                tokens from a generation bundle (``CausalLM.export``)
``deploy``      ``BUNDLE (--hostfile F | --hosts a:2,b) --dest DIR [--rsh PROGRAM]`` -> each
                host a copy with only its ranks' weights, checked there
                (``--split-only OUT``: ``OUT/<host>/`` here)
==============  ===========================================================================

``--split-fused`` runs :class:`tvm_distx.passes.SplitFusedProjections` on the
module before the rules, so that rules can place each segment's weight.

``MODULE.py`` is a TVMScript file. Rules are a JSON or YAML list of
:class:`tvm_distx.ShardingRule` fields, for example
``[{"param": "A", "result": "S[1]", "function": "mlp"}]``. ``annotate`` and
``propagate`` print TVMScript, or write it with ``-o``.

Errors are one readable line and a hint on stderr; the traceback only with
``--verbose``. Long steps show progress on a terminal, and nothing when the
output is not one. Exit codes: 0 success, 1 a run that failed, 2 bad usage or
input, 130 interrupted.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import signal
import sys
import threading
from typing import NoReturn

from tvm_distx.cli import autoshard, deploy, explain, generate, run, serve, sharding
from tvm_distx.cli import compile as compile_
from tvm_distx.cli.inputs import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE
from tvm_distx.cli.startup import WITHOUT_TORCH, import_tvm_without_torch
from tvm_distx.errors import ArgumentError, DistxError, LaunchError

__all__ = ["main"]

logger = logging.getLogger(__name__)

#: What adds each subcommand's parser (and its handler), in the order ``--help`` lists them.
_SUBCOMMANDS = (sharding.add_parsers, explain.add_parsers, compile_.add_parsers,
                autoshard.add_parser, run.add_parser, generate.add_parser, serve.add_parser,
                deploy.add_parser)


class _Parser(argparse.ArgumentParser):
    """argparse that raises :class:`ArgumentError` on bad usage instead of exiting."""

    def error(self, message: str):
        raise ArgumentError(message, hint=f"see {self.prog} --help")


def _version() -> str:
    """``tvm-distx X (TVM Y)``, from the installed packages' metadata (no import of TVM)."""
    from importlib import metadata

    found = {}
    for name in ("tvm-distx", "apache-tvm"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "unknown"
    return f"tvm-distx {found['tvm-distx']} (TVM {found['apache-tvm']})"


def _parser() -> argparse.ArgumentParser:
    """The ``tvm-distx`` parser: the global flags, and each subcommand's own parser."""
    parser = _Parser(prog="tvm-distx",
                     description="Sharding, lowering and multi-rank execution for TVM Relax's "
                     "distributed IR.")
    parser.add_argument("--verbose", "-v", action="store_true",
                        help="log progress and show tracebacks")
    parser.add_argument("--version", action="version", version=_version(),
                        help="show the versions of tvm-distx and TVM, and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in _SUBCOMMANDS:
        add(sub)
    return parser


def _on_ctrl_c(signum: int, frame) -> None:
    """SIGINT handler: raise KeyboardInterrupt, but never while a module is being imported.

    The commands import TVM and torch lazily, and a KeyboardInterrupt raised inside an
    extension module's initialisation can abort the process (torch's C++ start-up turns it
    into ``std::terminate``). During an import the Ctrl-C is held: the handler sends itself
    the signal again a moment later, until the import has finished.
    """
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            again = threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT))
            again.daemon = True
            again.start()
            return
        frame = frame.f_back
    raise KeyboardInterrupt


def _interrupted(err: BaseException) -> bool:
    """Whether ``err`` stands for a Ctrl-C: Python wraps a KeyboardInterrupt raised in some
    places (a class body's ``__set_name__`` while a library imports) in another exception."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, KeyboardInterrupt):
            return True
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return False


def _errors_for_cli(record: logging.LogRecord) -> bool:
    """A logging filter: an error logged as a warning shows its command-line form (hint in flags)."""
    if isinstance(record.args, tuple) and any(isinstance(a, DistxError) for a in record.args):
        record.args = tuple(a.for_cli() if isinstance(a, DistxError) else a for a in record.args)
    return True


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    previous = signal.getsignal(signal.SIGINT)
    if (threading.current_thread() is not threading.main_thread()
            or previous in (signal.SIG_IGN, None)):
        return _command(argv)
    signal.signal(signal.SIGINT, _on_ctrl_c)  # Ctrl-C: KeyboardInterrupt, caught in _command
    try:
        return _command(argv)
    finally:
        signal.signal(signal.SIGINT, previous)


def _command(argv: list[str] | None) -> int:
    """Parse ``argv`` and run its command (:func:`_run_command`)."""
    try:
        parser = _parser()
        args = parser.parse_args(argv)
    except ArgumentError as err:  # bad usage: argparse's exit code, our one line and hint
        sys.stderr.write(f"tvm-distx: error: {err}\n")
        raise SystemExit(EXIT_USAGE) from None
    except (KeyboardInterrupt, Exception) as err:
        if not _interrupted(err):
            raise
        sys.stderr.write("interrupted\n")
        return EXIT_INTERRUPTED
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    # warnings in flags for this command only: main() may run inside a larger program
    handlers = list(logging.getLogger().handlers)
    for handler in handlers:
        handler.addFilter(_errors_for_cli)
    try:
        return _run_command(args)
    finally:
        for handler in handlers:
            handler.removeFilter(_errors_for_cli)


def _run_command(args: argparse.Namespace) -> int:
    """Run the parsed command; errors and Ctrl-C become exit codes."""
    try:
        if args.command in WITHOUT_TORCH:
            import_tvm_without_torch()
        return args.handler(args)
    except (KeyboardInterrupt, Exception) as err:
        if _interrupted(err):
            sys.stderr.write("interrupted\n")
            return EXIT_INTERRUPTED
        if not isinstance(err, DistxError):
            raise
        if args.verbose:
            logger.exception("tvm-distx failed")
            if getattr(err, "details", ""):
                sys.stderr.write(f"{err.details.rstrip()}\n")
        sys.stderr.write(f"tvm-distx: error: {err.for_cli()}\n")
        return EXIT_FAILED if isinstance(err, LaunchError) else EXIT_USAGE


def console() -> NoReturn:
    """The ``tvm-distx`` process: run :func:`main` and exit with its code.

    A Ctrl-C that lands while an extension module runs Python code of its own (TVM's import
    does) leaves CPython marked to kill itself with SIGINT once it finalizes, even though
    :func:`main` caught the interrupt and cleaned up. The process therefore leaves through
    ``os._exit`` after the interpreter's exit handlers, so the shell always sees exit 130.
    """
    code = main()
    if code != EXIT_INTERRUPTED:
        # the command has finished and said so: a Ctrl-C while the interpreter tears TVM
        # down would only turn its exit code into a kill by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        sys.exit(code)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    console()
