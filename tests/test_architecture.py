"""Layers point downward: a rank process loads the runtime and the layout core, not the compiler."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import tvm_distx

RANK_ENTRY_POINTS = ("tvm_distx.runtime.mpi_rank", "tvm_distx.runtime.disco_rank")
COMPILER = ("tvm_distx.passes", "tvm_distx.legalize")


def _loaded_after_importing(*modules: str) -> list[str]:
    """The tvm_distx modules in sys.modules after importing ``modules`` in a fresh interpreter."""
    code = (
        "import importlib, json, sys\n"
        f"for name in {list(modules)!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('tvm_distx'))))\n"
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


def test_ccl_and_views_do_not_import_the_compiler():
    loaded = _loaded_after_importing("tvm_distx.ccl", "tvm_distx.reports.views", "tvm_distx.layout",
                                     "tvm_distx.runtime")
    assert [m for m in loaded if m.startswith(COMPILER)] == []


def test_no_runtime_module_imports_the_compiler_even_lazily():
    # ccl -> legalize.planner -> legalize/__init__ -> lower_distir -> ccl was a cycle,
    # hidden by imports inside functions; those count here too
    package = Path(tvm_distx.__file__).parent
    sources = [package / "ccl.py", package / "reports" / "views.py",
               *sorted((package / "runtime").glob("*.py")), *sorted((package / "bundle").glob("*.py")),
               *sorted((package / "layout").glob("*.py"))]
    for source in sources:
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [_absolute(node, source, package)]
            else:
                continue
            bad = [n for n in names if n.startswith(COMPILER)]
            assert not bad, f"{source.name}:{node.lineno} imports {bad}"


def _absolute(node: ast.ImportFrom, source: Path, package: Path) -> str:
    if not node.level:
        return node.module or ""
    parts = ["tvm_distx", *source.parent.relative_to(package).parts]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


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
