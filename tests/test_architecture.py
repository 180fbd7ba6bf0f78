"""Layers point downward, declared as import-linter contracts and checked here.

``[tool.importlinter]`` in pyproject.toml lists the layers; ``lint-imports`` checks them
(with every import, those inside functions included), that no package has an import cycle
between its modules, and that private modules stay in their package. The other tests check
what the contracts cannot see: which imports may wait inside a function, and what a rank
process or ``import tvm_distx`` actually loads.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tomllib
from pathlib import Path


RANK_ENTRY_POINTS = ("tvm_distx.runtime.mpi_rank", "tvm_distx.runtime.disco_rank",
                     "tvm_distx.hosts.remote")
COMPILER = ("tvm_distx.passes", "tvm_distx.legalize")


def _loaded_after_importing(*modules: str) -> list[str]:
    """The tvm_distx and tvm modules in sys.modules after importing ``modules`` afresh."""
    code = (
        "import importlib, json, sys\n"
        f"for name in {list(modules)!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(m for m in sys.modules\n"
        "                        if m.split('.')[0] in ('tvm_distx', 'tvm'))))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def test_rank_entry_points_do_not_import_the_compiler():
    loaded = _loaded_after_importing(*RANK_ENTRY_POINTS)
    assert set(RANK_ENTRY_POINTS) <= set(loaded)
    assert "tvm_distx.layout" in loaded  # the geometry comes from the layout core
    compiler = [m for m in loaded if m.startswith(COMPILER)]
    assert compiler == [], f"a rank process imports compiler modules: {compiler}"


def test_the_check_run_on_each_host_imports_neither_tvm_nor_the_compiler():
    # `python -m tvm_distx.hosts.remote` runs on every host before a launch: a host needs
    # Python, numpy, safetensors and tvm-distx, not TVM
    loaded = _loaded_after_importing("tvm_distx.hosts.remote")
    assert "tvm_distx.hosts.remote" in loaded and "tvm" not in loaded
    assert [m for m in loaded if m.startswith(COMPILER)] == []


def test_ccl_layout_and_runtime_do_not_import_the_compiler():
    loaded = _loaded_after_importing("tvm_distx.ccl", "tvm_distx.layout", "tvm_distx.runtime")
    assert [m for m in loaded if m.startswith(COMPILER)] == []


def test_the_package_loads_the_frontend_and_the_compiler_only_on_first_use():
    code = (
        "import json, sys, tvm_distx\n"
        "before = sorted(m for m in sys.modules if m.startswith(\n"
        "    ('tvm_distx.passes', 'tvm_distx.legalize', 'tvm_distx.frontend.pytorch')))\n"
        "from tvm_distx import from_torch\n"
        "from tvm_distx.frontend.pytorch import from_torch as original\n"
        "print(json.dumps([before, from_torch is original]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=True)
    before, same = json.loads(done.stdout.splitlines()[-1])
    assert before == []  # `import tvm_distx` alone loads neither the frontend nor the compiler
    assert same  # tvm_distx.from_torch is the frontend's, loaded on first use


# ------------------------------------------------------------------ declared layers
REPO = Path(__file__).resolve().parents[1]


def test_the_links_give_the_checkout_the_installed_layout():
    # tvm_distx/passes and tvm_distx/legalize link to the folders at the root, so that
    # `python` and `lint-imports` run from the checkout see the package as it installs
    for sub in ("passes", "legalize"):
        link = REPO / "tvm_distx" / sub
        assert link.is_symlink() and link.resolve() == REPO / sub


def test_the_layers_are_import_linter_contracts_and_they_hold():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    contracts = config["contracts"]
    assert {c["type"] for c in contracts} == {"layers", "acyclic_siblings", "private_modules"}
    assert not any("ignore_imports" in c for c in contracts), "no import may be ignored"
    layers = next(c for c in contracts if c["type"] == "layers")
    assert layers["exhaustive"] is True  # every module of tvm_distx is in a layer
    # as a developer runs it: `lint-imports` at the repository's root
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(lint), "--no-cache"], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert f"{len(contracts)} kept, 0 broken" in done.stdout


#: Modules a function may import when it runs rather than with its module: optional or heavy
#: dependencies (torch, transformers and accelerate come with extras; scipy with the auto
#: extra; matplotlib and safetensors only where a picture or a weight file is made; gguf and
#: tokenizers where a GGUF file or a tokenizer is read; ml_dtypes, TVM's, and jinja2, for chat
#: templates, which a board without TVM lacks), and mpi4py, whose import starts MPI.
LAZY_ANYWHERE = {"torch", "transformers", "accelerate", "scipy", "safetensors", "sympy",
                 "matplotlib", "mpi4py", "gguf", "tokenizers", "ml_dtypes", "jinja2"}
#: TVM takes about 3 s to import. The layers below the compiler (what ``import tvm_distx``,
#: a rank's driver and the command line's start load) import it when a function needs it.
LAZY_TVM_IN = ("tvm_distx/layout/", "tvm_distx/sources/", "tvm_distx/bundle/",
               "tvm_distx/generation/", "tvm_distx/runtime/", "tvm_distx/errors.py",
               "tvm_distx/ccl.py")
#: The command line's dispatch loads only what a subcommand needs.
LAZY_ALL_IN = ("tvm_distx/cli/",)
#: The backends that import TVM are imported when a session of them opens (the one list of
#: backends names each by its import, so the layer contracts see it).
LAZY_BACKENDS = {"tvm_distx/runtime/backends.py": ("tvm_distx.runtime.disco",
                                                   "tvm_distx.runtime.emulated")}


def _sources():
    for folder in ("tvm_distx", "passes", "legalize"):
        for path in sorted((REPO / folder).rglob("*.py")):
            yield path.relative_to(REPO).as_posix(), path


def _imports_inside_functions(tree: ast.AST):
    for func in ast.walk(tree):
        if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(func):
                if isinstance(node, ast.Import):
                    yield node, [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom):
                    yield node, ["tvm_distx" if node.level else (node.module or "")]


def test_imports_wait_inside_functions_only_where_the_house_allows():
    offenders = set()
    for rel, path in _sources():
        if rel.startswith(LAZY_ALL_IN):
            continue
        for node, names in _imports_inside_functions(ast.parse(path.read_text())):
            for name in names:
                top = name.split(".")[0]
                if top in LAZY_ANYWHERE:
                    continue
                if top in ("tvm", "tvm_ffi") and rel.startswith(LAZY_TVM_IN):
                    continue
                if name in LAZY_BACKENDS.get(rel, ()):
                    continue
                offenders.add(f"{rel}:{node.lineno} imports {name}")
    assert not offenders, "move these imports to the top of their module:\n" + "\n".join(
        sorted(offenders))


def test_the_layout_core_and_the_bundle_format_import_without_tvm():
    loaded = _loaded_after_importing("tvm_distx", "tvm_distx.layout", "tvm_distx.bundle.manifest",
                                     "tvm_distx.ccl")
    assert "tvm" not in loaded
    assert not [m for m in loaded if m.startswith(COMPILER)]


#: The longest a function may be, in lines from its ``def`` to its last line (docstring and
#: nested functions included); the package's median is under ten.
MAX_FUNCTION_LINES = 120


def test_no_function_is_longer_than_the_house_allows():
    offenders, seen = [], set()
    for rel, path in _sources():
        real = path.resolve()  # tvm_distx/passes and tvm_distx/legalize link to the roots
        if real in seen:
            continue
        seen.add(real)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    offenders.append(f"{rel}:{node.lineno} {node.name}: {length} lines")
    assert seen, "no source found"
    assert not offenders, (f"split these functions into pieces of at most {MAX_FUNCTION_LINES} "
                           "lines:\n" + "\n".join(offenders))
