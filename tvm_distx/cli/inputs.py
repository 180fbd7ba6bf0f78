"""What every ``tvm-distx`` subcommand shares: exit codes, checked inputs and outputs, progress.

Every subcommand's module (:mod:`tvm_distx.cli.sharding`, :mod:`tvm_distx.cli.compile`,
:mod:`tvm_distx.cli.generate`, ...) imports from here. Every check refuses a bad
input or output before any work, with a hint in terms of the command's flags.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import json
import logging
import math
import os
import sys
import tempfile
import time
from pathlib import Path

from tvm_distx.errors import ArgumentError, DistxError
from tvm_distx.layout.mesh import set_device_meshes

__all__ = ["EXIT_OK", "EXIT_FAILED", "EXIT_USAGE", "EXIT_INTERRUPTED"]

logger = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def _read_rules(path: Path | None) -> list:
    from tvm_distx.layout.rules import ShardingRule

    if path is None:
        return []
    import yaml

    _input_file(path, "--rules file")
    hint = ('give --rules a JSON or YAML list such as [{"param": "A", "result": "S[1]", '
            '"function": "mlp"}]')
    try:
        text = Path(path).read_text()
        if Path(path).suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or type(err).__name__
        raise ArgumentError(f"cannot read rules from {path}: YAML {problem}{where}",
                            hint=hint) from None
    except (OSError, ValueError) as err:  # JSON errors are ValueErrors
        raise ArgumentError(f"cannot read rules from {path}: {err}", hint=hint) from None
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise ArgumentError(f"rules in {path} must be a list of objects",
                            hint='for example [{"callee": "mlp", "args": {"0": "R"}}]')
    rules = []
    known = [f.name for f in dataclasses.fields(ShardingRule)]
    for index, fields in enumerate(data):
        unknown = [name for name in fields if name not in known]
        if unknown:
            close = difflib.get_close_matches(str(unknown[0]), known, n=1)
            raise ArgumentError(f"rule {index} in {path} has an unknown field "
                                f"{', '.join(repr(str(n)) for n in unknown)}"
                                + (f" (did you mean {close[0]!r}?)" if close else ""),
                                hint=f"fields are {', '.join(known)}")
        try:
            rules.append(ShardingRule(**_rule_fields(fields)))
        except TypeError as err:
            raise ArgumentError(f"rule {index} in {path}: {err}",
                                hint=f"fields are {', '.join(known)}") from None
    return rules


@contextlib.contextmanager
def _rules_as_written(rules: list):
    """Errors raised inside show each rule of ``rules`` as the rules file writes it
    (``{"param": "A", "result": "S[1]"}``), not as Python's ``ShardingRule(...)``."""
    try:
        yield
    except DistxError as err:
        err.cli_names = tuple(err.cli_names) + tuple((repr(r), r.as_json()) for r in rules)
        raise


def _rule_fields(fields: dict) -> dict:
    """A rule's fields as read from JSON or YAML, with ``args`` keyed by position."""
    fields = dict(fields)
    if isinstance(fields.get("args"), dict):  # JSON keys are text: "0" is position 0
        fields["args"] = {_position(k): v for k, v in fields["args"].items()}
    return fields


def _position(key):
    """An argument position from a JSON or YAML key; anything else is left for the rule to refuse."""
    if isinstance(key, str) and key.strip().lstrip("-").isdigit():
        return int(key)
    return key


def _input_file(path: Path, what: str) -> None:
    """Refuse, before any work, an input that is missing or is a directory."""
    if Path(path).is_dir():
        raise ArgumentError(f"{what} {path} is a directory, not a file",
                            hint=f"give the {what} itself, for example {Path(path) / 'model.py'}"
                            if what == "module file" else f"give the {what} itself")
    if not Path(path).is_file():
        raise ArgumentError(f"{what} {path} does not exist")


def _writable_file(path: Path | None, option: str) -> None:
    """Refuse, before any work, an output file whose directory does not exist."""
    if path is not None and not Path(path).parent.is_dir():
        raise ArgumentError(f"cannot write {option} {path}: {Path(path).parent} is not a directory",
                            hint=f"give {option} a path in an existing directory")


def _output_directory(path: Path, option: str) -> None:
    """Refuse, before any work, an output directory that cannot be written."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ArgumentError(f"{option} {path} is not a directory (it is an existing file)",
                            hint=f"give {option} a new or existing directory")
    # the results must not be lost after the work is done: write a probe now, into the
    # directory or its nearest existing ancestor (nothing is created before the run)
    probe = next(p for p in [path, *path.absolute().parents] if p.exists())
    try:
        if not probe.is_dir():
            raise NotADirectoryError(20, "Not a directory")
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as err:
        raise ArgumentError(f"cannot write {option} {path}: {err.strerror}",
                            hint=f"give {option} a directory you can write") from None


def _with_mesh(mod, text: str | None):
    """``mod`` on the mesh of --mesh (``2``, ``2x2``): added, or replacing the module's one mesh.

    A module's own mesh (its ``I.module_global_infos``) gives way to --mesh, with a
    warning when the shape changes. Refused, before any work, where it cannot: a module
    with several meshes (pipeline stages), or one whose values are typed on its mesh
    already (the output of ``propagate``).
    """
    if text is None:
        return mod
    try:
        shape = tuple(int(n) for n in text.lower().split("x"))
    except ValueError:
        shape = ()
    if not shape or any(n <= 0 for n in shape):
        raise ArgumentError(f"--mesh {text!r} is not a mesh shape",
                            hint="give --mesh a device count or a shape: --mesh 2, --mesh 2x2")
    meshes = list(mod.global_infos.get("mesh", [])) if mod.global_infos else []
    if not meshes:
        return _with_device_num(set_device_meshes(mod, [shape]), shape)
    olds = [tuple(int(n) for n in m.shape) for m in meshes]
    shown = ", ".join("x".join(map(str, o)) for o in olds)
    if len(meshes) > 1:
        raise ArgumentError(f"--mesh {text}: the module has {len(meshes)} meshes (shapes "
                            f"{shown}: pipeline stages), and one --mesh cannot replace them",
                            hint="drop --mesh to run on the module's meshes, or change them "
                            "in its I.module_global_infos")
    if olds[0] == shape:
        logger.info("--mesh %s: the module's mesh has that shape already", text)
        return mod
    if _typed_on_meshes(mod):
        raise ArgumentError(f"--mesh {text}: the module's values are typed on its mesh "
                            f"(shape {shown}) already, as R.DTensor, so they cannot move to "
                            "another", hint="drop --mesh, or give --mesh the module from before "
                            "propagate (with R.Tensor types)")
    sys.stderr.write(f"tvm-distx: warning: --mesh {text} replaces the module's mesh (shape "
                     f"{shown}) by a mesh of shape {'x'.join(map(str, shape))}\n")
    return _with_device_num(set_device_meshes(mod, [shape]), shape)


def _with_device_num(mod, shape: tuple[int, ...]):
    """``mod`` with its ``device_num`` attribute, where it has one, counting the mesh's devices."""
    count = math.prod(shape)
    if mod.attrs is not None and "device_num" in mod.attrs and \
            int(mod.attrs["device_num"]) != count:
        mod = mod.with_attr("device_num", count)
    return mod


def _hint_if_unsharded(args: argparse.Namespace, mod) -> None:
    """A hint on stderr when no rules, no preset and no annotation in the module shard anything."""
    if args.rules is not None or args.preset is not None or _sharded(mod):
        return
    sys.stderr.write(f"hint: nothing in {args.module} is sharded, so nothing moves: give "
                     "--rules FILE, or --preset tensor-parallel\n")


def _sharded(mod) -> bool:
    """Whether ``mod`` places anything: an annotation, a redistribution or an R.DTensor type."""
    from tvm import relax

    from tvm_distx.ir import helpers as ir_helpers

    if _typed_on_meshes(mod):
        return True
    for func in mod.functions.values():
        for block in getattr(getattr(func, "body", None), "blocks", []):
            for binding in block.bindings:
                if isinstance(binding.value, relax.Call) and (
                        ir_helpers.operator_name(binding.value) or "").startswith("relax.dist."):
                    return True
    return False


def _typed_on_meshes(mod) -> bool:
    """Whether a function of ``mod`` has a value typed ``R.DTensor`` (bound to a mesh)."""
    from tvm import relax
    from tvm.relax.distributed import DTensorType

    def dtensor(ty) -> bool:
        if isinstance(ty, DTensorType):
            return True
        return isinstance(ty, relax.TupleType) and any(dtensor(f) for f in ty.fields)

    for func in mod.functions.values():
        if not isinstance(func, relax.Function):
            continue
        if any(dtensor(p.ty) for p in func.params):
            return True
        for block in getattr(func.body, "blocks", []):
            if any(dtensor(b.var.ty) for b in block.bindings):
                return True
    return False


def _console():
    """The console tables are printed on: wrapped to a terminal's width (or $COLUMNS); a pipe
    or a file gets every row on one line, as wide as it is."""
    from rich.console import Console

    console = Console()
    if console.is_terminal or os.environ.get("COLUMNS"):
        return console
    return Console(width=_UNWRAPPED)


#: The width of tables written to a pipe or a file: no row is wrapped.
_UNWRAPPED = 10_000


@contextlib.contextmanager
def _progress(description: str, *, follow: str | None = None):
    """A spinner with elapsed time on a terminal; silent when stderr is not one.

    ``follow``: a logger (``"tvm_distx.llm"``) whose INFO messages become the spinner's
    stage (tracing, compiling, starting the ranks...) and whose warnings are printed
    above it; the time it all took is printed at the end.
    """
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    if not console.is_terminal:
        yield
        return
    started = time.perf_counter()
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task(description, total=None)
        log = logging.getLogger(follow) if follow else None
        quiet = logging.getLogger().getEffectiveLevel() > logging.INFO  # no --verbose
        if log is not None and quiet:
            handler = _StageHandler(progress, task, description)
            saved = (log.level, log.propagate)
            log.addHandler(handler)
            log.setLevel(logging.INFO)
            log.propagate = False  # the stages go to the spinner, not to stderr's log
        try:
            yield
        finally:
            if log is not None and quiet:
                log.removeHandler(handler)
                log.setLevel(saved[0])
                log.propagate = saved[1]
    console.print(f"{description}: {time.perf_counter() - started:.1f} s", style="dim")


class _StageHandler(logging.Handler):
    """Shows a logger's INFO messages as the spinner's stage; prints its warnings."""

    def __init__(self, progress, task, description: str) -> None:
        super().__init__(logging.INFO)
        self.progress, self.task, self.description = progress, task, description

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage().splitlines()[0]
        if record.levelno >= logging.WARNING:
            self.progress.console.print(f"{record.levelname} {message}")
        else:
            self.progress.update(self.task, description=f"{self.description}: {message}")


def _load_plain(args: argparse.Namespace):
    from tvm_distx.frontend.script import load_module

    _input_file(args.module, "module file")
    return load_module(args.module)


def _load(args: argparse.Namespace):
    """The module of ``args.module``, sharded as ``--preset`` or ``--rules`` say (after
    ``--split-fused``), on ``--mesh``."""
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
