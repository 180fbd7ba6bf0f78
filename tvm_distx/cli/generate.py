"""``tvm-distx generate``: greedy tokens from a generation bundle (``CausalLM.export``).

``BUNDLE --ids 1 15 22 [--backend mpi|disco|emulate] [-n N] [--max-new-tokens K]``
serves the bundle with :meth:`tvm_distx.llm.causal_lm.CausalLM.from_bundle` on the
chosen backend (on several hosts with ``--hostfile``, see :mod:`tvm_distx.cli.hosts`)
and prints the prompt followed by the new tokens, with a
progress display on a terminal. The bundle fixes the rank count: ``-n`` only
checks it, before any rank starts. Errors are those of :mod:`tvm_distx.cli.main`:
one line with a hint in flags.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import numpy as np

from tvm_distx.cli.hosts import session_options
from tvm_distx.cli.inputs import EXIT_OK, _input_file, _progress, _writable_file
from tvm_distx.errors import ArgumentError

__all__ = ["generate"]

logger = logging.getLogger(__name__)


def _check_rank_count(bundle: Path, ranks: int | None) -> None:
    """Refuse ``--ranks`` other than the bundle's own count, in flags (before any rank starts)."""
    from tvm_distx.bundle.manifest import read_manifest
    from tvm_distx.errors import BundleError

    if ranks is None:
        return
    try:
        built = read_manifest(bundle).num_ranks
    except BundleError:
        return  # not a bundle: CausalLM.from_bundle says so, with its own hint
    if ranks != built:
        raise ArgumentError(f"generate --ranks {ranks}: the bundle {bundle} holds the shards "
                            f"of {built} ranks", hint=f"--ranks {built}, or leave --ranks out")


def generate(args: argparse.Namespace) -> int:
    """``tvm-distx generate``: greedy tokens from a generation bundle on its ranks."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from tvm_distx.llm.causal_lm import CausalLM

    _writable_file(args.output, "-o")
    if args.ids:
        prompt = np.asarray(args.ids, np.int64)
    elif args.input is not None:
        _input_file(args.input, "--input file")
        try:
            prompt = np.load(args.input, allow_pickle=False).astype(np.int64).reshape(-1)
        except ValueError as err:
            raise ArgumentError(f"--input file {args.input} is not a .npy array ({err})") \
                from None
    else:
        raise ArgumentError("generate needs a prompt", hint="give token ids: --ids 1 15 22, "
                            "or --input prompt.npy")
    _check_rank_count(args.bundle, args.ranks)
    console = Console(stderr=True)
    with _progress(f"starting the ranks of {args.bundle} ({args.backend})"):
        lm = CausalLM.from_bundle(args.bundle, backend=args.backend, num_ranks=args.ranks,
                                  timeout=args.timeout, **session_options(args))
    with lm, Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("{task.fields[rate]}"), console=console, transient=True,
                      disable=not console.is_terminal) as progress:
        task = progress.add_task("tokens", total=args.max_new_tokens, rate="")
        tokens = []
        for token in lm.stream(prompt, args.max_new_tokens, eos_token_id=(
                lm.eos_token_id if args.stop_at_eos else None)):
            tokens.append(token)
            progress.update(task, advance=1,
                            rate=f"{lm.stats.decode_tokens_per_second:.1f} tokens/s")
    out = np.concatenate([prompt, np.asarray(tokens, np.int64)])
    if args.output is not None:
        np.save(args.output, out[None, :])
    sys.stdout.write(" ".join(str(t) for t in out) + "\n")
    logger.info("generated %d tokens: prefill %.3f s, decode %.1f tokens/s", len(tokens),
                lm.stats.prefill_seconds, lm.stats.decode_tokens_per_second)
    return EXIT_OK
