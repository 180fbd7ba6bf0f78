"""The flags several ``tvm-distx`` subcommands share: a module and its rules, the backend,
positive numbers.

Each subcommand's module adds its own parser (``add_parser``), from these pieces and the
host flags of :mod:`tvm_distx.cli.hosts`, so that one flag means one thing everywhere.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tvm_distx.runtime.backends import BACKENDS, NAMES

__all__ = ["BACKEND_HELP", "add_backend_argument", "add_module_arguments", "positive"]

#: The ``--backend`` help of run, generate and serve, from the one list of backends.
BACKEND_HELP = "where the ranks run: " + "; ".join(
    f"{b.name}: {b.summary}" for b in BACKENDS.values()) + f" (default {NAMES[0]})"


def positive(kind):
    """An argparse ``type`` that reads ``kind`` (int, float) and refuses zero and less."""
    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    convert.__name__ = kind.__name__
    return convert


def stage_counts(text: str) -> int | tuple[int, ...]:
    """``--stages``: a stage count (``2``) or the layers of each stage (``10,14``)."""
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a stage count (2) or layers per stage (10,14)") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: stages and layers are counted from 1")
    return counts[0] if len(counts) == 1 else counts


def add_stages_argument(parser: argparse.ArgumentParser) -> None:
    """``--stages``, for a checkpoint or a GGUF file compiled here."""
    parser.add_argument("--stages", type=stage_counts, default=None, metavar="S|L1,L2,...",
                        help="pipeline stages: S consecutive blocks of the ranks, each "
                        "running a run of consecutive layers (tensor parallel inside), or "
                        "the layers of each stage; S divides -n (default: one stage)")


def add_backend_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--backend``: where the ranks run (the first of the backends by default)."""
    parser.add_argument("--backend", default=NAMES[0], metavar="|".join(NAMES),
                        help=BACKEND_HELP)


def add_module_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the module file and how to shard it: ``--rules``, ``--preset``, ``--mesh``,
    ``--split-fused``."""
    parser.add_argument("module", type=Path, help="a TVMScript file")
    parser.add_argument("--rules", type=Path,
                        help="sharding rules: a JSON or YAML list of rules, each one like "
                        "{\"param\": \"A\", \"result\": \"S[1]\", \"function\": \"mlp\"}")
    parser.add_argument("--preset", choices=["tensor-parallel"], default=None,
                        help="instead of --rules: Megatron's tensor-parallel plan, found from "
                        "the graph's structure (its linears), not from names")
    parser.add_argument("--mesh", default=None, metavar="N or AxB",
                        help="the device mesh (2, 2x2): added to the module, or replacing "
                        "its one mesh")
    parser.add_argument("--split-fused", action="store_true",
                        help="first give each segment of a fused projection (q|k|v, gate|up) "
                        "its own weight, <weight>_seg<j>, for the rules to place; --weights "
                        "and run-time weights stay the fused ones")
