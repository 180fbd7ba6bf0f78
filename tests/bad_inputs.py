"""Run one case of the bad-input corpus (``tests/data/bad/``) and report how it was refused.

Usage::

    python tests/bad_inputs.py CASE --workdir DIR [--bundle PRISTINE]
    python tests/bad_inputs.py --build-bundle DIR
    python tests/bad_inputs.py --serve          # the fork server of the test (see serve)

The case format is described in ``tests/data/bad/README.md``. The runner
prepares ``DIR`` (a copy of the pristine bundle with the case's damage applied,
and the input files the case asks for), runs the case, and then:

* on a ``tvm_distx`` error (a ``DistxError``) prints one line
  ``error: <ClassName>: <message on one line>`` to stderr and exits 2;
* if the case ran without an error, prints ``no error`` and exits 3;
* on any other exception Python prints its traceback and exits 1.

This module's top level imports only the standard library and numpy, so that
the test can reuse :func:`load_case` and :func:`prepare` without importing TVM.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
BAD = DATA / "bad"
#: A ``torch`` that cannot be imported: TVM's FFI imports torch eagerly when it can (3 s of
#: CPU per process); none of the cases needs it.
NO_TORCH = BAD / "_no_torch"

TP_RULES = [{"param": "A", "result": "S[1]", "function": "mlp"},
            {"param": "B", "result": "S[0]", "function": "mlp"}]


@dataclass
class Case:
    """One corpus entry, read from its file."""

    path: Path
    expect: str
    message: str
    run: str = "propagate"
    rules: list = field(default_factory=list)
    inputs: list = field(default_factory=list)
    params: dict = field(default_factory=dict)
    cli: list | None = None
    exit: int = 2
    bundle: bool = False
    damage: list = field(default_factory=list)
    make: dict = field(default_factory=dict)
    launch: dict | None = None
    call: dict | None = None
    absent: list = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.path.name


# ---------------------------------------------------------------------- reading cases
def load_case(path: str | os.PathLike) -> Case:
    """Read a case: a TVMScript ``.py`` with ``# key: value`` header lines, or a ``.json``."""
    path = Path(path)
    if path.suffix == ".py":
        header = {}
        for line in path.read_text().splitlines():
            m = re.match(r"#\s*(\w+):\s*(.*)$", line)
            if m:
                header[m.group(1)] = m.group(2).strip()
            elif line.strip() and not line.startswith("#"):
                break
        expect, _, message = header["expect"].partition(":")
        case = Case(path, expect.strip(), message.strip(), run=header.get("run", "propagate"))
        if "rules" in header:
            case.rules = json.loads(header["rules"])
        if "inputs" in header:
            case.inputs = header["inputs"].split()
        if "params" in header:
            case.params = dict(p.split("=", 1) for p in header["params"].split())
        if "cli" in header:
            case.cli = header["cli"].split()
        if "absent" in header:
            case.absent = header["absent"].split()
        if "exit" in header:
            case.exit = int(header["exit"])
        return case
    data = json.loads(path.read_text())
    known = {f for f in Case.__dataclass_fields__} - {"path"}
    unknown = set(data) - known - {"description"}
    if unknown:
        raise ValueError(f"{path}: unknown fields {sorted(unknown)}")
    return Case(path, **{k: v for k, v in data.items() if k in known})


def cases() -> list[Path]:
    """Every case file of the corpus, sorted."""
    return sorted(p for p in BAD.iterdir()
                  if p.suffix in (".py", ".json") and not p.name.startswith("_"))


# ---------------------------------------------------------------------- preparing
def spec_array(text: str) -> np.ndarray:
    """``"float32[128,64]"`` -> zeros of that dtype and shape (``float32[]`` is a scalar)."""
    m = re.fullmatch(r"(\w+)\[([\d,\s]*)\]", text)
    if m is None:
        raise ValueError(f"bad array spec {text!r}")
    shape = tuple(int(n) for n in m.group(2).split(",") if n.strip())
    return np.zeros(shape, m.group(1))


def substitute(text: str, workdir: Path) -> str:
    """Expand ``{tmp}`` (the work dir), ``{bundle}``, ``{case}`` (the corpus) and ``{data}``."""
    return (text.replace("{tmp}", str(workdir)).replace("{bundle}", str(workdir / "bundle"))
            .replace("{case}", str(BAD)).replace("{data}", str(DATA)))


def _dotted(data, key: str):
    *parents, last = key.split(".")
    for p in parents:
        data = data[int(p)] if isinstance(data, list) else data[p]
    return data, (int(last) if isinstance(data, list) else last)


def _damage(root: Path, op: dict) -> None:
    """Apply one damage operation to the bundle copy at ``root``."""
    kind, target = op["op"], root / op.get("path", "manifest.json")
    if kind == "write":
        target.write_text(op["text"])
    elif kind == "truncate":
        target.write_bytes(target.read_bytes()[: op["bytes"]])
    elif kind == "delete":
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    elif kind == "flip":  # invert one byte
        raw = bytearray(target.read_bytes())
        raw[op["offset"]] ^= 0xFF
        target.write_bytes(bytes(raw))
    elif kind == "copy":  # a corpus file over a bundle file, optionally re-hashed in the manifest
        shutil.copyfile(BAD / op["from"], target)
        if op.get("rehash"):
            _damage(root, {"op": "rehash", "path": op["path"]})
    elif kind == "rehash":  # record a weight file's current sha256 in the manifest
        import hashlib

        digest = hashlib.sha256(target.read_bytes()).hexdigest()
        manifest = json.loads((root / "manifest.json").read_text())
        for w in manifest["weight_files"]:
            if w["file"] == op["path"]:
                w["sha256"] = digest
        (root / "manifest.json").write_text(json.dumps(manifest))
    elif kind == "patch":  # JSON edits by dotted key
        manifest = json.loads(target.read_text())
        for key, value in op.get("set", {}).items():
            parent, last = _dotted(manifest, key)
            parent[last] = value
        for key in op.get("delete", []):
            parent, last = _dotted(manifest, key)
            del parent[last]
        target.write_text(json.dumps(manifest))
    else:
        raise ValueError(f"unknown damage op {kind!r}")


def prepare(case: Case, workdir: Path, pristine: Path | None) -> None:
    """Fill ``workdir``: the damaged bundle copy and the input files of ``case``."""
    workdir.mkdir(parents=True, exist_ok=True)
    if case.bundle:
        if pristine is None:
            raise ValueError(f"{case.name} needs --bundle")
        shutil.copytree(pristine, workdir / "bundle")
        for op in case.damage:
            _damage(workdir / "bundle", op)
    for name, spec in case.make.items():
        target = workdir / name
        if spec.startswith("text:"):
            target.write_text(substitute(spec[5:], workdir))
        elif spec.startswith("npz:"):  # npz:A=float32[128,64],B=float32[128,128]
            arrays = dict(item.split("=", 1) for item in re.split(r",(?=\w+=)", spec[4:]))
            np.savez(target, **{k: spec_array(v) for k, v in arrays.items()})
        elif spec.startswith("copy:"):  # a file of the corpus or of tests/data
            shutil.copyfile(substitute(spec[5:], workdir), target)
        else:
            np.save(target, spec_array(spec))


def argv(case: Case, workdir: Path) -> list[str]:
    """The case's command line arguments, placeholders expanded."""
    return [substitute(a, workdir) for a in case.cli or []]


# ---------------------------------------------------------------------- running
def _module(case: Case):
    import tvm_distx as td
    from tvm_distx import ShardingRule
    from tvm_distx.cli.inputs import _rule_fields
    from tvm_distx.passes import AnnotateSharding

    mod = td.load_module(case.path)
    if case.rules:
        mod = AnnotateSharding([ShardingRule(**_rule_fields(r)) for r in case.rules])(mod)
    return mod


def _run_cli(arguments: list[str]) -> None:
    """The CLI's parsing and handler, in this process, so that the error's class is seen."""
    from tvm_distx.cli import main as cli

    args = cli._parser().parse_args(arguments)
    code = args.handler(args)
    if code != 0:
        raise SystemExit(code)


def execute(case: Case, workdir: Path) -> None:
    """Run the case; returns normally only if nothing was refused."""
    if case.cli is not None:
        _run_cli(argv(case, workdir))
        return
    if case.launch is not None:
        from tvm_distx.runtime.backends import launch

        options = dict(case.launch)
        inputs = [spec_array(s) for s in options.pop("inputs", [])]
        params = {k: spec_array(v) for k, v in options.pop("params", {}).items()}
        launch(workdir / "bundle", inputs, params=params or None, **options)
        return
    if case.call is not None:
        _call(case, workdir)
        return
    import tvm_distx as td
    from tvm import relax

    if case.run == "load":
        td.load_module(case.path)
        return
    mod = _module(case)
    if case.run == "annotate":
        return
    if case.run == "propagate":
        from tvm_distx.passes import PropagateSharding

        PropagateSharding()(mod)
    elif case.run == "legalize-propagate":
        from tvm_distx.passes import PropagateSharding

        PropagateSharding(require_legalized=True)(relax.transform.LegalizeOps()(mod))
    elif case.run == "distribute":
        td.lower_to_ranks(mod)
    elif case.run == "execute":
        exe = td.compile(mod, schedule=False)
        exe.run(*[spec_array(s) for s in case.inputs],
                params={k: spec_array(v) for k, v in case.params.items()} or None,
                backend="emulate", timeout=60)
    elif case.run == "export":
        exe = td.compile(mod, schedule=False)
        exe.export(workdir / "export", params={k: spec_array(v) for k, v in case.params.items()})
    else:
        raise ValueError(f"{case.name}: unknown run mode {case.run!r}")


def _call(case: Case, workdir: Path) -> None:
    """A direct library call: ``{"function": "module:name", "args": [...], "kwargs": {...}}``."""
    import importlib

    spec = case.call
    module, _, name = spec["function"].partition(":")
    function = importlib.import_module(module)
    for part in name.split("."):
        function = getattr(function, part)

    def value(v):
        if isinstance(v, str) and v.startswith("array:"):
            return spec_array(v[6:])
        if isinstance(v, str) and v.startswith("sharding:"):  # sharding:(2,2):S[0]R
            from tvm_distx.layout.mesh import DeviceMesh
            from tvm_distx.layout import Placement, TensorSharding

            shape, placement = v[9:].rsplit(":", 1)
            dims = tuple(int(n) for n in shape.strip("()").split(",") if n.strip())
            mesh = DeviceMesh(dims, range(0, int(np.prod(dims))))
            return TensorSharding(mesh, Placement.parse(placement))
        if isinstance(v, str):
            return substitute(v, workdir)
        return v

    function(*[value(a) for a in spec.get("args", [])],
             **{k: value(v) for k, v in spec.get("kwargs", {}).items()})


def build_bundle(directory: Path) -> None:
    """The pristine bundle: the tensor-parallel seed on 2 ranks, weights A and B stored."""
    import tvm_distx as td
    from tvm_distx import ShardingRule
    from tvm_distx.passes import AnnotateSharding

    mod = AnnotateSharding([ShardingRule(**r) for r in TP_RULES])(
        td.load_module(DATA / "seed_tensor_parallel.py"))
    rng = np.random.default_rng(9)
    weights = {k: (0.1 * rng.standard_normal((128, 128))).astype("float32") for k in "AB"}
    td.compile(mod, schedule=False).export(directory, params=weights)


def serve() -> None:
    """Run cases in forked processes, one per request: the fork server the test uses.

    Importing TVM costs a second or more of CPU per process; this process imports it
    once and forks a fresh child for every case, so that each case still runs in its
    own process (a crash or a hang is the child's, seen as its exit status). Requests
    are JSON lines on stdin, ``{"argv": [...], "log": PATH, "timeout": SECONDS}``; the
    child's stdout and stderr go to ``log``. Each answer is a JSON line on stdout,
    ``{"returncode": N}`` (negative: killed by that signal; null: timed out, killed).
    """
    import time

    import tvm_distx  # noqa: F401  (what every case needs, imported once)
    import tvm_distx.cli.main  # noqa: F401
    import tvm_distx.legalize  # noqa: F401
    import tvm_distx.passes  # noqa: F401
    import tvm_distx.runtime.backends  # noqa: F401

    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: one case
            code = 1
            try:
                fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                code = main(request["argv"])
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else 1
            except BaseException:  # noqa: BLE001  (reported like Python would)
                import traceback

                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        deadline = time.monotonic() + float(request.get("timeout", 180))
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                answer = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                answer = None
                break
            time.sleep(0.01)
        sys.stdout.write(json.dumps({"returncode": answer}) + "\n")
        sys.stdout.flush()


def main(arguments: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", nargs="?")
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--bundle", type=Path)
    parser.add_argument("--build-bundle", type=Path)
    parser.add_argument("--serve", action="store_true", help="run as the test's fork server")
    options = parser.parse_args(arguments)
    if options.serve:
        serve()
        return 0
    if options.build_bundle:
        build_bundle(options.build_bundle)
        return 0
    case = load_case(options.case)
    prepare(case, options.workdir, options.bundle)
    from tvm_distx.errors import DistxError

    try:
        execute(case, options.workdir)
    except DistxError as err:
        text = " ".join(str(err).split("\n"))
        sys.stderr.write(f"error: {type(err).__name__}: {text}\n")
        mro = ",".join(c.__name__ for c in type(err).__mro__)
        sys.stderr.write(f"mro: {mro}\n")
        return 2
    sys.stderr.write("no error\n")
    return 3


if __name__ == "__main__":
    sys.exit(main())
