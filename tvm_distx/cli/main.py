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
import contextlib
import logging
import os
import signal
import sys
import threading
import zipfile
from pathlib import Path
from typing import NoReturn

import numpy as np

from tvm_distx.cli.deploy import add_parser as _add_deploy_parser
from tvm_distx.cli.hosts import add_host_arguments, session_options
from tvm_distx.cli.startup import WITHOUT_TORCH, import_tvm_without_torch
from tvm_distx.cli.inputs import (EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, _console,
                         _hint_if_unsharded, _input_file, _load_plain, _output_directory, _progress,
                         _read_rules, _rules_as_written, _with_mesh, _writable_file)
from tvm_distx.errors import ArgumentError, DistxError, LaunchError
from tvm_distx.runtime.backends import BACKENDS, NAMES, launch
from tvm_distx.generation.generator import PREFILL_CHUNK
from tvm_distx.runtime.inputs import read_inputs

__all__ = ["main"]

logger = logging.getLogger(__name__)


def _load(args: argparse.Namespace):
    from tvm_distx.passes import AnnotateSharding
    from tvm_distx.frontend.script import load_module

    _input_file(args.module, "module file")
    mod = _with_mesh(load_module(args.module), getattr(args, "mesh", None))
    preset = _preset(args)
    if preset is not None:
        return preset.apply(mod)
    if getattr(args, "split_fused", False):
        from tvm_distx.passes import SplitFusedProjections

        mod = SplitFusedProjections()(mod)
    rules = _read_rules(getattr(args, "rules", None))
    with _rules_as_written(rules):
        return AnnotateSharding(rules)(mod) if rules else mod


def _preset(args: argparse.Namespace):
    """The preset --preset names (None without one); --rules and --preset exclude each other."""
    name = getattr(args, "preset", None)
    if name is None:
        return None
    if getattr(args, "rules", None) is not None:
        raise ArgumentError("--rules and --preset both say how to shard",
                            hint="give one of them: --rules FILE, or --preset tensor-parallel")
    from tvm_distx.plans.presets import tensor_parallel

    return tensor_parallel()


def _write_module(mod, output: Path | None) -> None:
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


# ---------------------------------------------------------------------- subcommands
def _annotate(args: argparse.Namespace) -> int:
    _writable_file(args.output, "-o")
    if args.rules is None and args.preset is None:
        raise ArgumentError("annotate needs --rules or --preset", hint="tvm-distx annotate "
                            "model.py --rules rules.json, or --preset tensor-parallel")
    _write_module(_load(args), args.output)
    return EXIT_OK


def _propagate(args: argparse.Namespace) -> int:
    from tvm_distx.passes import propagate

    _writable_file(args.output, "-o")
    mod = _load(args)
    if args.legalize:
        from tvm_distx.compiler.pipeline import legalize_ops

        mod = legalize_ops(mod)
    result = propagate(mod, require_legalized=args.legalize, warn_unlegalized=False)
    _write_module(result.mod, args.output)
    if result.unlegalized:  # the Python warning's advice, in flags
        fn, var, op = result.unlegalized[0]
        sys.stderr.write(f"tvm-distx: warning: {len(result.unlegalized)} high-level operator "
                         f"call(s) take sharded operands ({op} at '{var}' in '{fn}'); legalizing "
                         "them after propagation would lose collectives\n"
                         "hint: add --legalize to legalize them first, as compile does\n")
    return EXIT_OK


def _plan(args: argparse.Namespace) -> int:
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


def _autoshard(args: argparse.Namespace) -> int:
    from tvm_distx.cli.autoshard import autoshard

    return autoshard(args)


def _explain(args: argparse.Namespace) -> int:
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


def _check_weights_complete(mod, function: str, weights: dict, path: Path) -> None:
    """Refuse a ``--weights`` archive that leaves out some of the function's weights, or holds
    one of another shape.

    The weights are the parameters after the run-time inputs: the first
    ``num_input`` parameters when the function says so (modules imported from
    PyTorch do), otherwise every parameter from the first one the archive names.
    A fused weight cut by ``--split-fused`` counts as given when its source is.
    """
    from tvm_distx.ir.helpers import static_shape
    from tvm_distx.passes import derivations_of

    if function not in [gv.name_hint for gv in mod.functions]:
        return  # the compile itself names the missing function
    func = mod[function]
    names = [p.name for p in func.params]
    derived = derivations_of(mod).get(function)
    given = set(weights)
    if derived:
        given |= {p.name for p in derived.params if p.source in weights}
    attrs = func.attrs
    if attrs is not None and "num_input" in attrs:
        expected = names[int(attrs["num_input"]):]
    else:
        first = next((i for i, n in enumerate(names) if n in given), len(names))
        expected = names[first:]
    missing = [n for n in expected if n not in given]
    if missing:
        inputs = [n for n in names if n not in expected]
        raise ArgumentError(
            f"{path} has no weight {', '.join(repr(n) for n in missing)} for '{function}', "
            f"whose weights are {', '.join(expected)}"
            + (f" (its run-time inputs: {', '.join(inputs)})" if inputs else ""),
            hint=f"add {' and '.join(missing)} to {path.name} (numpy.savez), or leave "
            "--weights out and pass every parameter with -i at run time")
    for param in func.params:  # each weight's shape, before anything compiles
        array, shape = weights.get(param.name), static_shape(param.ty)
        if array is None or shape is None:
            continue
        if len(shape) != array.ndim or any(w is not None and w != a
                                           for w, a in zip(shape, array.shape)):
            shown = tuple("?" if w is None else w for w in shape)
            raise ArgumentError(
                f"weight '{param.name}' in {path} has shape {tuple(array.shape)}; "
                f"'{function}' takes {shown}",
                hint=f"save {param.name} with shape {shown} in {path.name} (numpy.savez)")


def _compile(args: argparse.Namespace, check: bool = False) -> int:
    from tvm_distx import compile as compile_module

    _output_directory(args.output, "-o")
    mod = _load(args)
    weights = {}
    if args.weights:
        problem = None
        try:
            loaded = np.load(args.weights, allow_pickle=False)
            if hasattr(loaded, "files"):
                with loaded as archive:
                    weights = {name: archive[name] for name in archive.files}
            else:  # a .npy: one array, no names
                problem = "it holds one array, not arrays named by parameter"
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
            problem = str(err)
        if problem is not None:
            raise ArgumentError(f"cannot read weights from {args.weights}: {problem}",
                                hint="give an .npz of global weights keyed by parameter "
                                "name (numpy.savez)")
    if weights:
        _check_weights_complete(mod, args.function, weights, args.weights)
    options = {"vlen": args.vlen} if args.vlen else {}
    with _progress(f"compiling for {args.target}"):
        exe = compile_module(mod, target=args.target, **options)
    with _progress(f"exporting {exe.num_ranks} ranks' weight shards"):
        out = exe.export(args.output, params=weights, function=args.function)
    if (check or args.check) and exe.target.is_riscv:
        from tvm_distx.compiler.rvv import check_kernels

        with _progress("checking every kernel under qemu"):
            checks = check_kernels(out / "kernels", vlen=args.vlen or 128)
        for c in checks:
            sys.stdout.write(f"kernel {c.name}: max |error| {c.max_error:g} under qemu, "
                             f"vector code {'ran' if c.vector_ran else 'absent'}\n")
    sys.stdout.write(f"wrote the {exe.target.name} bundle for {exe.num_ranks} ranks to {out}\n")
    return EXIT_OK


def _bundle(args: argparse.Namespace) -> int:
    return _compile(args, check=True)


def _run(args: argparse.Namespace) -> int:
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


def _generate(args: argparse.Namespace) -> int:
    from tvm_distx.cli.generate import generate

    return generate(args)


def _serve(args: argparse.Namespace) -> int:
    from tvm_distx.cli.serve import serve

    return serve(args)


def _deploy(args: argparse.Namespace) -> int:
    from tvm_distx.cli.deploy import deploy

    return deploy(args)


# ---------------------------------------------------------------------- parser
class _Parser(argparse.ArgumentParser):
    """argparse that raises :class:`ArgumentError` on bad usage instead of exiting."""

    def error(self, message: str):
        raise ArgumentError(message, hint=f"see {self.prog} --help")


#: The ``--backend`` help of run and generate, from the one list of backends.
_BACKEND_HELP = "where the ranks run: " + "; ".join(
    f"{b.name}: {b.summary}" for b in BACKENDS.values()) + f" (default {NAMES[0]})"


def _positive(kind):
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


def _module_arguments(parser: argparse.ArgumentParser, rules_required: bool = False) -> None:
    parser.add_argument("module", type=Path, help="a TVMScript file")
    parser.add_argument("--rules", type=Path, required=rules_required,
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
    parser = _Parser(prog="tvm-distx",
                     description="Sharding, lowering and multi-rank execution for TVM Relax's "
                     "distributed IR.")
    parser.add_argument("--verbose", "-v", action="store_true",
                        help="log progress and show tracebacks")
    parser.add_argument("--version", action="version", version=_version(),
                        help="show the versions of tvm-distx and TVM, and exit")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("annotate", help="add sharding annotations from rules")
    _module_arguments(p)
    p.add_argument("-o", "--output", type=Path, help="write TVMScript here (default stdout)")
    p.set_defaults(handler=_annotate)

    p = sub.add_parser("propagate", help="propagate sharding through the whole module")
    _module_arguments(p)
    p.add_argument("--legalize", action="store_true",
                   help="legalize high-level operators first, as compile does, so that "
                   "their collectives are kept")
    p.add_argument("-o", "--output", type=Path, help="write TVMScript here (default stdout)")
    p.set_defaults(handler=_propagate)

    p = sub.add_parser("explain", help="sharding tables, comm report, one value's layout")
    _module_arguments(p)
    p.add_argument("--value", help="FUNCTION:VALUE to draw across the mesh")
    p.add_argument("--png", type=Path, help="also draw --value into this PNG")
    p.set_defaults(handler=_explain)

    p = sub.add_parser("plan", help="the comm report: every collective with bytes per rank")
    _module_arguments(p)
    p.set_defaults(handler=_plan)

    for name, handler, text in (("compile", _compile, "compile into a bundle"),
                                ("bundle", _bundle, "compile into a bundle; for rvv, check "
                                 "every kernel under qemu")):
        p = sub.add_parser(name, help=text)
        _module_arguments(p)
        p.add_argument("--weights", type=Path, help="an .npz of global weights by parameter")
        p.add_argument("--target", default="x86", choices=["x86", "rvv"],
                       help="the machine to compile for: x86 (this host's kind) or rvv "
                       "(RISC-V with vectors) (default: %(default)s)")
        p.add_argument("--vlen", type=_positive(int), default=None,
                       help="RVV vector length in bits")
        p.add_argument("--function", default="main",
                       help="the function whose parameters --weights gives (default: "
                       "%(default)s)")
        p.add_argument("--check", action="store_true",
                       help="for rvv: run every kernel under qemu against this host")
        p.add_argument("-o", "--output", type=Path, required=True,
                       help="the bundle's directory (made if missing)")
        p.set_defaults(handler=handler)

    p = sub.add_parser("autoshard", help="choose every placement by cost under a memory "
                       "budget, and write them as editable rules")
    p.add_argument("module", type=Path, help="a TVMScript file")
    p.add_argument("--mesh", default=None, metavar="N or AxB",
                   help="the device mesh (2, 2x2): added to the module, or replacing its one "
                   "mesh")
    p.add_argument("--memory", default=None, metavar="SIZE",
                   help="bytes per rank for weights and activations (1GiB, 512MiB)")
    p.add_argument("--objective", choices=["latency", "throughput"], default="latency",
                   help="what the plan makes short: latency, the time of one call with every "
                   "message's start-up; throughput, arithmetic and bytes only (default: "
                   "%(default)s)")
    p.add_argument("--rules", type=Path, default=None,
                   help="parameter rules the plan must keep (JSON or YAML)")
    p.add_argument("--profile", type=Path, default=None,
                   help="a cost profile (JSON, from tvm_distx.autoshard.measure_cost_profile(...).save(path))")
    p.add_argument("--time-limit", type=float, default=30.0, metavar="SECONDS",
                   help="the solver's time limit (the report gives the optimality gap)")
    p.add_argument("--function", default="main",
                   help="the function to plan (decode, prefill; default main)")
    p.add_argument("--size", action="append", default=[], metavar="NAME=INT",
                   help="the example size of a symbolic extent to price the plan at "
                   "(--size seq=128; repeatable); the rules serve every size")
    p.add_argument("-o", "--output", type=Path,
                   help="write the rules here, YAML or .json (default YAML on stdout)")
    p.set_defaults(handler=_autoshard)

    p = sub.add_parser("run", help="run a bundle on N ranks")
    p.add_argument("bundle", type=Path, help="a directory written by compile or bundle")
    p.add_argument("-n", "--ranks", dest="n", type=_positive(int), default=None,
                   help="the number of ranks; the bundle fixes it, so this only checks it")
    p.add_argument("--backend", default=NAMES[0], metavar="|".join(NAMES),
                   help=_BACKEND_HELP)
    p.add_argument("--function", default="main",
                   help="the bundle's function to run (default: %(default)s)")
    p.add_argument("-i", "--inputs", nargs="+", action="extend", default=[], metavar="NPY",
                   help="global inputs, in parameter order (-i a.npy b.npy, or -i a.npy -i b.npy); "
                   "NAME=PATH gives a parameter by name (-i x=x.npy)")
    p.add_argument("-o", "--output", default="out", help="directory for the results")
    p.add_argument("--timeout", type=_positive(float), default=300.0,
                   help="seconds before a stuck run is stopped")
    add_host_arguments(p)
    p.set_defaults(handler=_run)

    p = sub.add_parser("generate", help="text or tokens from a generation bundle "
                       "(CausalLM.export), a Hugging Face checkpoint or a GGUF file")
    p.add_argument("bundle", type=Path, metavar="MODEL",
                   help="a directory written by CausalLM.export, a checkpoint directory "
                   "written by save_pretrained, or a llama.cpp .gguf file")
    p.add_argument("--ids", type=int, nargs="+", help="the prompt's token ids")
    p.add_argument("--input", type=Path, help="the prompt's token ids as a .npy array")
    p.add_argument("--max-new-tokens", type=_positive(int), default=32,
                   help="the most tokens to generate after the prompt (default: %(default)s)")
    p.add_argument("--prefill-chunk", type=_positive(int), default=PREFILL_CHUNK,
                   help="the most prompt tokens per prefill call; a longer prompt is "
                   "prefilled chunk by chunk (default: %(default)s)")
    p.add_argument("--backend", default=NAMES[0], metavar="|".join(NAMES),
                   help=_BACKEND_HELP)
    p.add_argument("-n", "--ranks", type=_positive(int), default=None,
                   help="the rank count (2 for a checkpoint or a GGUF file); a bundle fixes "
                   "it, so for a bundle this only checks it")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="a checkpoint's weights on the ranks (default: as the checkpoint "
                   "stores them)")
    p.add_argument("--quantization", choices=("q8", "q4"),
                   help="store a checkpoint's linear weights as int8 or int4 groups of 32")
    p.add_argument("--max-length", type=_positive(int), default=None,
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
    p.add_argument("-o", "--output", type=Path,
                   help="also save the prompt and the new tokens as a (1, n) .npy")
    p.add_argument("--timeout", type=_positive(float), default=300.0,
                   help="seconds for the ranks to start and for each step")
    add_host_arguments(p)
    p.set_defaults(handler=_generate)

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, "
                       "/v1/chat/completions) for a bundle, a checkpoint or a GGUF file")
    p.add_argument("bundle", type=Path, metavar="MODEL",
                   help="a directory written by CausalLM.export, a checkpoint directory "
                   "written by save_pretrained, or a llama.cpp .gguf file; its tokenizer "
                   "files sit beside it")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address to listen on (default: %(default)s, this host only)")
    p.add_argument("--port", type=int, default=8000,
                   help="the port to listen on; 0 picks a free one (default: %(default)s)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: "
                   "$TVM_DISTX_API_KEY, or none)")
    p.add_argument("--model-name", help="the model's id in the API (default: the file or "
                   "directory name)")
    p.add_argument("--max-queue", type=_positive(int), default=16,
                   help="requests that may wait while one runs; more get 503 (default: "
                   "%(default)s)")
    p.add_argument("--backend", default=NAMES[0], metavar="|".join(NAMES),
                   help=_BACKEND_HELP)
    p.add_argument("-n", "--ranks", type=_positive(int), default=None,
                   help="the rank count (2 for a checkpoint or a GGUF file); a bundle fixes it")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="a checkpoint's weights on the ranks (default: as stored)")
    p.add_argument("--quantization", choices=("q8", "q4"),
                   help="store a checkpoint's linear weights as int8 or int4 groups of 32")
    p.add_argument("--max-length", type=_positive(int), default=None,
                   help="a checkpoint's or GGUF file's context: prompt and reply tokens "
                   "(default: 1024)")
    p.add_argument("--timeout", type=_positive(float), default=300.0,
                   help="seconds for the ranks to start and for each step")
    p.add_argument("--no-cache", action="store_true",
                   help="compile a checkpoint or GGUF file again, and keep no copy "
                   "(default: reuse and fill the compile cache)")
    add_host_arguments(p)
    p.set_defaults(handler=_serve)

    _add_deploy_parser(sub).set_defaults(handler=_deploy)
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
