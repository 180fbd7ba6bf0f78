"""``tvm-distx generate``: text or tokens from a generation bundle, a checkpoint or a GGUF file.

``MODEL --prompt "text" | --chat "message" | --ids 1 15 22 [--backend mpi|disco|emulate]
[-n N] [--max-new-tokens K] [--do-sample --temperature T --top-k K --top-p P --seed S]``
serves MODEL on the chosen backend (on several hosts with ``--hostfile``, see
:mod:`tvm_distx.cli.hosts`). With ``--prompt`` or ``--chat`` it prints the new text as it
is generated, by the tokenizer that sits with the model (its chat template for
``--chat``); with ``--ids`` it prints the prompt followed by the new tokens, with a
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
from typing import TYPE_CHECKING

import numpy as np

from tvm_distx.cli.arguments import add_backend_argument, add_stages_argument, positive
from tvm_distx.cli.hosts import add_host_arguments, session_options
from tvm_distx.cli.inputs import EXIT_OK, _input_file, _progress, _writable_file
from tvm_distx.errors import ArgumentError
from tvm_distx.generation.generator import PREFILL_CHUNK

if TYPE_CHECKING:
    from tvm_distx.generation.opened_bundle import OpenedBundle

__all__ = ["add_parser", "generate", "open_model"]

logger = logging.getLogger(__name__)


def _magic(path: Path) -> bytes:
    """The first four bytes of a file."""
    with open(path, "rb") as f:
        return f.read(4)


def _is_gguf(path: Path) -> bool:
    return path.suffix == ".gguf" or (path.is_file() and _magic(path) == b"GGUF")


def _is_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def open_bundle(args: argparse.Namespace) -> OpenedBundle | None:
    """The generation bundle ``args.bundle`` names, read once; None for a checkpoint or a
    GGUF file. The backend and its options are checked first, and the flags that apply to
    a checkpoint or GGUF file only are refused for a bundle.

    Raises
    ------
    BundleError
        If the path is neither, nor a generation bundle.
    """
    from tvm_distx.generation.opened_bundle import OpenedBundle
    from tvm_distx.runtime.backends import check_backend

    check_backend(args.backend, session_options(args))  # a bad flag first, then the model
    path = args.bundle
    if _is_gguf(path) or _is_checkpoint(path):
        return None
    for flag in ("dtype", "quantization", "max_length"):
        if getattr(args, flag) is not None:
            raise ArgumentError(f"--{flag.replace('_', '-')} applies to a checkpoint or a "
                                f"GGUF file; {path} is a bundle, whose weights and cache "
                                "were fixed when it was exported",
                                hint=f"leave --{flag.replace('_', '-')} out")
    return OpenedBundle.open(path)


def open_model(args: argparse.Namespace, length: int, causal_lm, ids: np.ndarray | None = None,
               bundle: OpenedBundle | None = None):
    """The model of ``args.bundle`` (a bundle, a checkpoint or a GGUF file), its ranks started;
    a checkpoint's or GGUF file's cache holds ``args.max_length`` tokens, else ``length``.

    A bundle (``bundle``, as :func:`open_bundle` read it; read here when not given) is
    first asked what it rules out, in flags and before any rank starts: another rank
    count, ``ids`` (the prompt's token ids, when given as ids) outside its vocabulary,
    more tokens than its cache holds.
    """
    if bundle is None:
        bundle = open_bundle(args)
    path = args.bundle
    if bundle is not None:
        if getattr(args, "stages", None) is not None:
            raise ArgumentError("--stages applies to a checkpoint or a GGUF file; a bundle "
                                "keeps the stages it was compiled with",
                                hint="leave --stages out, or export a bundle with "
                                "CausalLM.from_pretrained(..., stages=S).export(DIR)")
        bundle.check_ranks(args.ranks)
        if ids is not None:
            bundle.check_ids([ids])
        new_tokens = getattr(args, "max_new_tokens", None)
        if new_tokens is not None:
            bundle.check_room(length - new_tokens, new_tokens)
        with _progress(f"starting the ranks of {path} ({args.backend})",
                       follow="tvm_distx.llm"):
            return causal_lm.from_bundle(bundle, backend=args.backend, timeout=args.timeout,
                                         **session_options(args))
    is_gguf = _is_gguf(path)
    if is_gguf and not path.is_file():
        raise ArgumentError(f"{path} does not exist", hint="give the path of a .gguf file")
    ranks = args.ranks or 2
    length = args.max_length or length
    common = dict(backend=args.backend, max_length=length, timeout=args.timeout,
                  stages=getattr(args, "stages", None),
                  compile_cache=not args.no_cache, **session_options(args))
    with _progress(f"{path} on {ranks} ranks ({args.backend})", follow="tvm_distx.llm"):
        if is_gguf:
            if args.dtype is not None or args.quantization is not None:
                raise ArgumentError("--dtype and --quantization apply to a checkpoint; a GGUF "
                                    "file is served in the formats it stores",
                                    hint="leave them out, or convert the file with "
                                    "llama-quantize")
            return causal_lm.from_gguf(path, ranks, **common)
        return causal_lm.from_pretrained(path, ranks, dtype=args.dtype,
                                         quantization=args.quantization, **common)


#: The sampling flags, by the name of their :class:`~tvm_distx.generation.sampling.Sampling` field.
_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed")


def _sampling(args: argparse.Namespace) -> dict:
    """The sampling options the flags give (transformers' defaults for the others)."""
    options = {name: getattr(args, name) for name in _SAMPLING if getattr(args, name) is not None}
    if args.do_sample:
        options["do_sample"] = True
    return options


def _prompt_is_text(args: argparse.Namespace) -> bool:
    """Whether the prompt is text (``--prompt``, ``--chat``), refusing flags that do not fit."""
    if args.prompt is None and args.chat is None:
        for flag in ("system", "stop"):
            if getattr(args, flag):
                raise ArgumentError(f"--{flag} applies to text", hint="give --prompt or --chat")
        return False
    if args.prompt is not None and args.chat is not None:
        raise ArgumentError("give --prompt or --chat, not both", hint="--chat 'Hello'")
    if args.ids or args.input is not None:
        raise ArgumentError("give the prompt once: as text (--prompt, --chat) or as token ids "
                            "(--ids, --input)", hint="leave --ids and --input out")
    if args.system is not None and args.chat is None:
        raise ArgumentError("--system applies to --chat", hint="--chat 'Hello' --system "
                            "'Answer briefly'")
    return True


def _text_prompt(args: argparse.Namespace, bundle: OpenedBundle | None):
    """``(prompt, ids)`` of ``--prompt`` or ``--chat`` (text or messages), encoded by the
    bundle's tokenizer or the checkpoint's or GGUF file's."""
    from tvm_distx.generation.text import Tokenizer

    path = args.bundle
    tokenizer = (bundle.tokenizer if bundle is not None else Tokenizer.from_gguf(path)
                 if path.is_file() else Tokenizer.from_directory(path))
    if tokenizer is None:
        raise ArgumentError(f"{path} holds no tokenizer, so it cannot take text",
                            hint="give token ids with --ids, or put the tokenizer files "
                            "(tokenizer.json, tokenizer_config.json) beside the model")
    if args.chat is not None:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
            [{"role": "user", "content": args.chat}]
        return messages, np.asarray(tokenizer.encode_chat(messages), np.int64)
    return args.prompt, np.asarray(tokenizer.encode(args.prompt), np.int64)


def _id_prompt(args: argparse.Namespace) -> np.ndarray:
    """The token ids of ``--ids`` or ``--input``."""
    if args.ids:
        return np.asarray(args.ids, np.int64)
    if args.input is not None:
        _input_file(args.input, "--input file")
        try:
            return np.load(args.input, allow_pickle=False).astype(np.int64).reshape(-1)
        except ValueError as err:
            raise ArgumentError(f"--input file {args.input} is not a .npy array ({err})") \
                from None
    raise ArgumentError("generate needs a prompt", hint="give text: --prompt 'Once upon a "
                        "time', or --chat 'Hello', or token ids: --ids 1 15 22")


def generate(args: argparse.Namespace) -> int:
    """``tvm-distx generate``: text or tokens from a model on its ranks."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from tvm_distx.llm.causal_lm import CausalLM
    from tvm_distx.generation.sampling import Sampling

    _writable_file(args.output, "-o")
    sampling = _sampling(args)
    Sampling.of(sampling)  # refused before any rank starts
    ids = None if _prompt_is_text(args) else _id_prompt(args)
    bundle = open_bundle(args)  # read once: its checks, its tokenizer and its ranks
    text = _text_prompt(args, bundle) if ids is None else None
    prompt = text[1] if text is not None else ids
    console = Console(stderr=True)
    lm = open_model(args, len(prompt) + args.max_new_tokens, CausalLM,
                    ids=ids, bundle=bundle)
    lm.prefill_chunk = args.prefill_chunk
    if text is not None:
        with lm:
            for piece in lm.stream_text(text[0], args.max_new_tokens, stop_strings=args.stop,
                                        **sampling):
                sys.stdout.write(piece)
                sys.stdout.flush()
        sys.stdout.write("\n")
        if console.is_terminal:  # the times a user compares, after the text
            console.print(f"first token after {lm.stats.prefill_seconds:.2f} s, "
                          f"{lm.stats.decode_tokens_per_second:.1f} tokens/s", style="dim")
        _log_speed(lm)
        return EXIT_OK
    with lm, Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("{task.fields[rate]}"), console=console, transient=True,
                      disable=not console.is_terminal) as progress:
        task = progress.add_task("tokens", total=args.max_new_tokens, rate="")
        tokens = []
        for token in lm.stream(prompt, args.max_new_tokens, eos_token_id=(
                lm.eos_token_id if args.stop_at_eos else None), **sampling):
            tokens.append(token)
            progress.update(task, advance=1,
                            rate=f"{lm.stats.decode_tokens_per_second:.1f} tokens/s")
    out = np.concatenate([prompt, np.asarray(tokens, np.int64)])
    if args.output is not None:
        np.save(args.output, out[None, :])
    sys.stdout.write(" ".join(str(t) for t in out) + "\n")
    _log_speed(lm)
    return EXIT_OK


def _log_speed(lm) -> None:
    logger.info("prefill %.3f s, decode %.1f tokens/s (%d tokens)", lm.stats.prefill_seconds,
                lm.stats.decode_tokens_per_second, lm.stats.new_tokens)


def add_parser(sub) -> argparse.ArgumentParser:
    """The ``generate`` subcommand's parser, added to ``sub``."""
    p = sub.add_parser("generate", help="text or tokens from a generation bundle "
                       "(CausalLM.export), a Hugging Face checkpoint or a GGUF file")
    p.add_argument("bundle", type=Path, metavar="MODEL",
                   help="a directory written by CausalLM.export, a checkpoint directory "
                   "written by save_pretrained, or a llama.cpp .gguf file")
    p.add_argument("--ids", type=int, nargs="+", help="the prompt's token ids")
    p.add_argument("--input", type=Path, help="the prompt's token ids as a .npy array")
    p.add_argument("--max-new-tokens", type=positive(int), default=32,
                   help="the most tokens to generate after the prompt (default: %(default)s)")
    p.add_argument("--prefill-chunk", type=positive(int), default=PREFILL_CHUNK,
                   help="the most prompt tokens per prefill call; a longer prompt is "
                   "prefilled chunk by chunk (default: %(default)s)")
    add_backend_argument(p)
    p.add_argument("-n", "--ranks", type=positive(int), default=None,
                   help="the rank count (2 for a checkpoint or a GGUF file); a bundle fixes "
                   "it, so for a bundle this only checks it")
    add_stages_argument(p)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="a checkpoint's weights on the ranks (default: as the checkpoint "
                   "stores them)")
    p.add_argument("--quantization", choices=("q8", "q4"),
                   help="store a checkpoint's linear weights as int8 or int4 groups of 32")
    p.add_argument("--max-length", type=positive(int), default=None,
                   help="a checkpoint's or GGUF file's cache length (default: the prompt "
                   "and the new tokens)")
    p.add_argument("--no-cache", action="store_true",
                   help="compile a checkpoint or GGUF file again, and keep no copy "
                   "(default: reuse and fill the compile cache, $TVM_DISTX_CACHE or "
                   "~/.cache/tvm-distx)")
    p.add_argument("--stop-at-eos", action="store_true",
                   help="with --ids: stop at the model's end token (kept in the output); "
                   "text always stops there")
    p.add_argument("--prompt", help="the prompt as text, by the model's tokenizer; the new "
                   "text is printed as it is generated")
    p.add_argument("--chat", metavar="MESSAGE", help="a user message, by the tokenizer's chat "
                   "template; the reply is printed as it is generated")
    p.add_argument("--system", help="with --chat: a system message before it")
    p.add_argument("--stop", action="append", metavar="TEXT",
                   help="with --prompt or --chat: stop once the text holds TEXT (repeatable)")
    _add_sampling_arguments(p)
    p.add_argument("-o", "--output", type=Path,
                   help="also save the prompt and the new tokens as a (1, n) .npy")
    p.add_argument("--timeout", type=positive(float), default=300.0,
                   help="seconds for the ranks to start and for each step")
    add_host_arguments(p)
    p.set_defaults(handler=generate)
    return p


def _add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of :func:`_sampling`: how each new token is drawn."""
    p.add_argument("--do-sample", action="store_true",
                   help="draw each token (transformers' do_sample); greedy without it")
    p.add_argument("--temperature", type=float, help="divide the logits by it (default 1)")
    p.add_argument("--top-k", type=int, help="keep the K most likely tokens (default 50)")
    p.add_argument("--top-p", type=float, help="keep the most likely tokens up to this "
                   "probability (default 1)")
    p.add_argument("--min-p", type=float, help="keep tokens at least this fraction as likely "
                   "as the most likely one")
    p.add_argument("--repetition-penalty", type=float, help="penalise tokens already there "
                   "(default 1: none)")
    p.add_argument("--seed", type=int, help="seed of the draws: the same tokens every run")
