"""``tvm-distx annotate`` and ``tvm-distx propagate``: a module with its shardings, as TVMScript.

``annotate MODULE.py --rules R`` adds the rules' ``annotate_sharding`` calls;
``propagate MODULE.py [--rules R] [--legalize]`` types every tensor ``R.DTensor``.
Both print TVMScript, or write it with ``-o``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from tvm_distx.cli.arguments import add_module_arguments
from tvm_distx.cli.inputs import EXIT_OK, _load, _writable_file
from tvm_distx.errors import ArgumentError

__all__ = ["add_parsers", "annotate", "propagate"]


def add_parsers(sub) -> None:
    """The ``annotate`` and ``propagate`` subcommands' parsers, added to ``sub``."""
    p = sub.add_parser("annotate", help="add sharding annotations from rules")
    add_module_arguments(p)
    p.add_argument("-o", "--output", type=Path, help="write TVMScript here (default stdout)")
    p.set_defaults(handler=annotate)

    p = sub.add_parser("propagate", help="propagate sharding through the whole module")
    add_module_arguments(p)
    p.add_argument("--legalize", action="store_true",
                   help="legalize high-level operators first, as compile does, so that "
                   "their collectives are kept")
    p.add_argument("-o", "--output", type=Path, help="write TVMScript here (default stdout)")
    p.set_defaults(handler=propagate)


def annotate(args: argparse.Namespace) -> int:
    """``tvm-distx annotate``: the module with the rules' (or the preset's) annotations."""
    _writable_file(args.output, "-o")
    if args.rules is None and args.preset is None:
        raise ArgumentError("annotate needs --rules or --preset", hint="tvm-distx annotate "
                            "model.py --rules rules.json, or --preset tensor-parallel")
    _write_module(_load(args), args.output)
    return EXIT_OK


def propagate(args: argparse.Namespace) -> int:
    """``tvm-distx propagate``: every tensor of the module typed ``R.DTensor``."""
    from tvm_distx.passes import propagate as propagate_sharding

    _writable_file(args.output, "-o")
    mod = _load(args)
    if args.legalize:
        from tvm_distx.compiler.pipeline import legalize_ops

        mod = legalize_ops(mod)
    result = propagate_sharding(mod, require_legalized=args.legalize, warn_unlegalized=False)
    _write_module(result.mod, args.output)
    if result.unlegalized:  # the Python warning's advice, in flags
        fn, var, op = result.unlegalized[0]
        sys.stderr.write(f"tvm-distx: warning: {len(result.unlegalized)} high-level operator "
                         f"call(s) take sharded operands ({op} at '{var}' in '{fn}'); legalizing "
                         "them after propagation would lose collectives\n"
                         "hint: add --legalize to legalize them first, as compile does\n")
    return EXIT_OK


def _write_module(mod, output: Path | None) -> None:
    """Print ``mod`` as TVMScript, or write it to ``output`` (no half-written file)."""
    text = mod.script(show_meta=False)
    if output is None:
        sys.stdout.write(text + "\n")
        return
    try:
        Path(output).write_text(text + "\n")
    except OSError as err:
        with contextlib.suppress(OSError):  # no half-written file
            Path(output).unlink()
        raise ArgumentError(f"cannot write {output}: {err.strerror}",
                            hint="give -o a path in an existing, writable directory") from None
    sys.stderr.write(f"wrote {output}\n")
