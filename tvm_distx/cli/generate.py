"""``tvm-distx generate``: greedy tokens from a generation bundle, a checkpoint or a GGUF file.

``MODEL --ids 1 15 22 [--backend mpi|disco|emulate] [-n N] [--max-new-tokens K]``
serves MODEL on the chosen backend (on several hosts with ``--hostfile``, see
:mod:`tvm_distx.cli.hosts`) and prints the prompt followed by the new tokens, with a
progress display on a terminal. MODEL is

* a generation bundle (``CausalLM.export``), served with
  :meth:`~tvm_distx.llm.causal_lm.CausalLM.from_bundle`: the bundle fixes the rank
  count, so ``-n`` only checks it, before any rank starts;
* a Hugging Face checkpoint directory (``config.json``), served with
  :meth:`~tvm_distx.llm.causal_lm.CausalLM.from_pretrained` on ``-n`` ranks (2),
  its weights as stored or as ``--dtype`` and ``--quantization`` say;
* a llama.cpp ``.gguf`` file, served with
  :meth:`~tvm_distx.llm.causal_lm.CausalLM.from_gguf` in its stored formats.

Errors are those of :mod:`tvm_distx.cli.main`: one line with a hint in flags.
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


def _magic(path: Path) -> bytes:
    """The first four bytes of a file."""
    with open(path, "rb") as f:
        return f.read(4)


def _open(args: argparse.Namespace, prompt: np.ndarray, causal_lm):
    """The model of ``args.bundle`` (a bundle, a checkpoint or a GGUF file), its ranks started."""
    path = args.bundle
    is_gguf = path.suffix == ".gguf" or (path.is_file() and _magic(path) == b"GGUF")
    checkpoint = path.is_dir() and (path / "config.json").is_file()
    if not (is_gguf or checkpoint):
        for flag in ("dtype", "quantization", "max_length"):
            if getattr(args, flag) is not None:
                raise ArgumentError(f"--{flag.replace('_', '-')} applies to a checkpoint or a "
                                    f"GGUF file; {path} is a bundle, whose weights and cache "
                                    "were fixed when it was exported",
                                    hint=f"leave --{flag.replace('_', '-')} out")
        _check_rank_count(path, args.ranks)
        with _progress(f"starting the ranks of {path} ({args.backend})"):
            return causal_lm.from_bundle(path, backend=args.backend, num_ranks=args.ranks,
                                         timeout=args.timeout, **session_options(args))
    if is_gguf and not path.is_file():
        raise ArgumentError(f"{path} does not exist", hint="give the path of a .gguf file")
    ranks = args.ranks or 2
    length = args.max_length or len(prompt) + args.max_new_tokens
    common = dict(backend=args.backend, max_length=length, timeout=args.timeout,
                  **session_options(args))
    with _progress(f"compiling {path} for {ranks} ranks and starting them ({args.backend})"):
        if is_gguf:
            if args.dtype is not None or args.quantization is not None:
                raise ArgumentError("--dtype and --quantization apply to a checkpoint; a GGUF "
                                    "file is served in the formats it stores",
                                    hint="leave them out, or convert the file with "
                                    "llama-quantize")
            return causal_lm.from_gguf(path, ranks, **common)
        return causal_lm.from_pretrained(path, ranks, dtype=args.dtype,
                                         quantization=args.quantization, **common)


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
    console = Console(stderr=True)
    lm = _open(args, prompt, CausalLM)
    lm.prefill_chunk = args.prefill_chunk
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
