"""``tvm-distx autoshard``: every placement chosen by cost, written as editable rules.

``MODULE.py --mesh AxB [--memory SIZE] [--objective latency|throughput] [--rules R]
[-o RULES.yaml]`` solves for the placements (:func:`tvm_distx.autoshard.auto_shard`),
reports the plan on stderr and writes its rules, for ``--rules`` of the other subcommands.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from tvm_distx.cli.inputs import (EXIT_OK, _input_file, _load_plain, _progress, _read_rules,
                         _rules_as_written, _with_mesh, _writable_file)
from tvm_distx.errors import ArgumentError

__all__ = ["add_parser", "autoshard"]

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30}


def add_parser(sub) -> argparse.ArgumentParser:
    """The ``autoshard`` subcommand's parser, added to ``sub``."""
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
    p.set_defaults(handler=autoshard)
    return p


def _bytes(text: str) -> int:
    """``1GiB``, ``512MiB``, ``2e9``: a number of bytes for --memory."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text or "")
    unit = match.group(2).lower() if match else None
    value = None
    if match is not None and unit in _UNITS:
        try:
            value = float(match.group(1)) * _UNITS[unit]
        except ValueError:  # "1e+e": the pattern lets through what float() refuses
            value = None
    if value is None:
        raise ArgumentError(f"--memory {text!r} is not a size",
                            hint="give bytes with a unit: --memory 1GiB, --memory 512MiB")
    return int(value)


def autoshard(args: argparse.Namespace) -> int:
    """``tvm-distx autoshard``: choose the placements and write them as rules."""
    from tvm_distx.autoshard import CostProfile, auto_shard

    _writable_file(args.output, "-o")
    memory = _bytes(args.memory) if args.memory is not None else None
    profile = None
    if args.profile is not None:
        _input_file(args.profile, "--profile file")
        profile = CostProfile.load(args.profile)
    mod = _with_mesh(_load_plain(args), args.mesh)
    meshes = mod.global_infos.get("mesh") if mod.global_infos else None
    if not meshes or len(meshes) != 1:
        raise ArgumentError("autoshard needs one mesh: the module has "
                            f"{len(meshes) if meshes else 'none'}",
                            hint="tvm-distx autoshard model.py --mesh 2x2 --memory 1GiB "
                            "-o rules.yaml")
    shape = tuple(int(n) for n in meshes[0].shape)
    rules = _read_rules(args.rules)
    if args.function not in [gv.name_hint for gv in mod.functions]:
        from tvm import relax

        names = sorted(gv.name_hint for gv, f in mod.functions.items()
                       if isinstance(f, relax.Function))
        raise ArgumentError(f"autoshard --function {args.function}: {args.module} has no "
                            "such function", hint="its functions: " + ", ".join(names)
                            + f" (--function {names[0] if names else 'main'})")
    sizes = dict(_size(text) for text in args.size)
    with _progress("choosing placements"), _rules_as_written(rules):
        _, report = auto_shard(mod, shape, memory_per_rank=memory, objective=args.objective,
                               rules=rules, profile=profile, time_limit=args.time_limit,
                               pin=False, function=args.function, sizes=sizes or None)
    sys.stderr.write(str(report) + "\n")
    data = report.rules_data(args.function)
    if args.output is not None and Path(args.output).suffix == ".json":
        text = json.dumps(data, indent=2) + "\n"
    else:
        import yaml

        text = "# written by tvm-distx autoshard; edit and pass back with --rules\n" + \
            yaml.safe_dump(data, sort_keys=False)
    if args.output is None:
        sys.stdout.write(text)
    else:
        Path(args.output).write_text(text)
        sys.stderr.write(f"wrote {args.output}\n")
    return EXIT_OK


def _size(text: str) -> tuple[str, int]:
    """``seq=128``: a symbolic extent's example size for ``autoshard --size``."""
    name, _, value = text.partition("=")
    if not name or not value.strip().isdigit() or int(value) < 1:
        raise ArgumentError(f"--size takes NAME=INT, got {text!r}",
                            hint="for example --size seq=128 (repeat it for each extent)")
    return name.strip(), int(value)
