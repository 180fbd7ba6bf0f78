"""``tvm-distx explain`` and ``tvm-distx plan``: what a sharding moves between the ranks.

``explain MODULE.py [--rules R] [--value F:V] [--png P]`` prints the sharding tables and
the comm report, and optionally how one value is cut across the ranks; ``plan
MODULE.py [--rules R]`` prints the comm report alone (with ``--preset``: the plan per
layer, against the ideal).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tvm_distx.cli.arguments import add_module_arguments
from tvm_distx.cli.inputs import (EXIT_OK, _console, _hint_if_unsharded, _load, _load_plain,
                                  _preset, _progress, _with_mesh, _writable_file)
from tvm_distx.errors import ArgumentError

__all__ = ["add_parsers", "explain", "plan"]


def add_parsers(sub) -> None:
    """The ``explain`` and ``plan`` subcommands' parsers, added to ``sub``."""
    p = sub.add_parser("explain", help="sharding tables, comm report, one value's layout")
    add_module_arguments(p)
    p.add_argument("--value", help="FUNCTION:VALUE to draw across the mesh")
    p.add_argument("--png", type=Path, help="also draw --value into this PNG")
    p.set_defaults(handler=explain)

    p = sub.add_parser("plan", help="the comm report: every collective with bytes per rank")
    add_module_arguments(p)
    p.set_defaults(handler=plan)


def explain(args: argparse.Namespace) -> int:
    """``tvm-distx explain``: the sharding tables, the comm report and one value's layout."""
    from tvm_distx.reports.comm_report import comm_report
    from tvm_distx.compiler.pipeline import legalize_ops, run_stages
    from tvm_distx.reports.views import (comm_table, plot_value, sharding_tables, show_value,
                                         value_sharding)

    # legalized first, as compile does: TVM types few high-level operators on DTensors
    _writable_file(args.png, "--png")
    function, _, value = (args.value or "").partition(":")
    if args.value and not value:
        raise ArgumentError(f"--value takes FUNCTION:VALUE, got {args.value!r}",
                            hint="for example --value mlp:A")
    annotated = legalize_ops(_load(args))
    if args.value:
        value_sharding(annotated, function, value)  # an unknown value: its error, no tables
    with _progress("propagating and lowering"):
        stages = run_stages(annotated)
    console = _console()
    for table in sharding_tables(annotated):
        console.print(table)
    console.print(comm_table(comm_report(stages["local_view"])))
    if args.value:
        show_value(annotated, function, value, console=console)
        if args.png:
            try:
                plot_value(annotated, function, value, path=args.png)
            except OSError as err:
                raise ArgumentError(f"cannot write --png {args.png}: {err.strerror}") from None
            console.print(f"wrote {args.png}")
    _hint_if_unsharded(args, annotated)
    return EXIT_OK


def plan(args: argparse.Namespace) -> int:
    """``tvm-distx plan``: the comm report, or with ``--preset`` the plan per layer."""
    from tvm_distx.compiler.pipeline import run_stages
    from tvm_distx.reports.comm_report import comm_report
    from tvm_distx.reports.views import comm_table

    preset = _preset(args)
    if preset is not None:  # the plan per layer, against the ideal
        mod = _with_mesh(_load_plain(args), args.mesh)
        with _progress("planning, propagating and lowering"):
            summary = preset.layers(mod)
        sys.stdout.write(str(summary) + "\n")
        return EXIT_OK
    mod = _load(args)
    with _progress("propagating and lowering"):
        report = comm_report(run_stages(mod)["local_view"])
    _console().print(comm_table(report))
    _hint_if_unsharded(args, mod)
    return EXIT_OK
