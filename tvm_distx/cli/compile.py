"""``tvm-distx compile`` and ``tvm-distx bundle``: a module compiled into a bundle.

``MODULE.py [--rules R] [--weights W.npz] --target x86|rvv -o DIR`` writes a bundle of
every rank's program and weight shards; ``bundle`` does the same and, for ``--target rvv``,
checks every kernel under qemu. A ``--weights`` archive is checked against the function's
parameters before anything compiles.
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from pathlib import Path

import numpy as np

from tvm_distx.cli.arguments import add_module_arguments, positive
from tvm_distx.cli.inputs import EXIT_OK, _load, _output_directory, _progress
from tvm_distx.errors import ArgumentError

__all__ = ["add_parsers", "bundle", "compile_bundle"]


def add_parsers(sub) -> None:
    """The ``compile`` and ``bundle`` subcommands' parsers, added to ``sub``."""
    for name, handler, text in (("compile", compile_bundle, "compile into a bundle"),
                                ("bundle", bundle, "compile into a bundle; for rvv, check "
                                 "every kernel under qemu")):
        p = sub.add_parser(name, help=text)
        add_module_arguments(p)
        p.add_argument("--weights", type=Path, help="an .npz of global weights by parameter")
        p.add_argument("--target", default="x86", choices=["x86", "rvv"],
                       help="the machine to compile for: x86 (this host's kind) or rvv "
                       "(RISC-V with vectors) (default: %(default)s)")
        p.add_argument("--vlen", type=positive(int), default=None,
                       help="RVV vector length in bits")
        p.add_argument("--function", default="main",
                       help="the function whose parameters --weights gives (default: "
                       "%(default)s)")
        p.add_argument("--check", action="store_true",
                       help="for rvv: run every kernel under qemu against this host")
        p.add_argument("-o", "--output", type=Path, required=True,
                       help="the bundle's directory (made if missing)")
        p.set_defaults(handler=handler)


def compile_bundle(args: argparse.Namespace, check: bool = False) -> int:
    """``tvm-distx compile``: the bundle of the module's ranks; ``check`` (or ``--check``)
    runs every RVV kernel under qemu."""
    from tvm_distx import compile as compile_module

    _output_directory(args.output, "-o")
    mod = _load(args)
    weights = _read_weights(args.weights) if args.weights else {}
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


def bundle(args: argparse.Namespace) -> int:
    """``tvm-distx bundle``: ``compile``, with every RVV kernel checked under qemu."""
    return compile_bundle(args, check=True)


def _read_weights(path: Path) -> dict[str, np.ndarray]:
    """The arrays of the ``--weights`` archive, by parameter name."""
    problem = None
    try:
        loaded = np.load(path, allow_pickle=False)
        if hasattr(loaded, "files"):
            with loaded as archive:
                return {name: archive[name] for name in archive.files}
        problem = "it holds one array, not arrays named by parameter"  # a .npy: no names
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        problem = str(err)
    raise ArgumentError(f"cannot read weights from {path}: {problem}",
                        hint="give an .npz of global weights keyed by parameter "
                        "name (numpy.savez)")


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
