"""``tvm-distx autoshard``: every placement chosen by cost, written as editable rules.

Kept apart from :mod:`tvm_distx.cli.main` (which parses the command line and calls
:func:`autoshard`) so that neither grows past a readable size.
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

__all__ = ["autoshard"]

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30}


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
