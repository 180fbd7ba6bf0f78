"""Every pass of passes/ and legalize/ is tested in TVM's form: Before, Expected, structurally.

The passes are found in the source: every class (or function) of ``passes/*.py`` and
``legalize/*.py`` decorated by a pass decorator (``module_pass``, TVM's
``function_pass``/``dataflowblock_pass``). That list is checked against the
``tvm.transform.Pass`` classes the two packages define once imported, so a pass made
some other way is not missed, and against the passes known today, so a scan that
finds nothing fails.

A pass is covered when a test function of its folder's structural test files
(``tests/passes/test_*_structural.py``, ``tests/legalize/test_*_structural.py``)
both names the pass and calls ``assert_structural_equal``, directly or through a
helper function of the same file. A new pass without such a test fails here, by name.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import textwrap
from pathlib import Path

import pytest
import tvm

from locations import REPO_ROOT, TESTS_DIR

#: source folder -> the structural test files that must cover its passes
FOLDERS = {
    "passes": "passes/test_*_structural.py",
    "legalize": "legalize/test_*_structural.py",
}

#: the passes each folder defines today: a floor for the scan, not the list it checks
KNOWN = {
    "passes": {"AnnotateSharding", "PropagateSharding", "SplitFusedProjections",
               "VocabParallelEmbedding", "GroupedQueryAttention"},
    "legalize": {"LowerDistIR", "LegalizeRedistribute", "MergeAllReduces",
                 "LowerGlobalViewToLocalView", "LegalizeLinear"},
}

_PASS_DECORATORS = {"module_pass", "function_pass", "dataflowblock_pass"}
_ASSERT = "assert_structural_equal"


# --------------------------------------------------------------------------- finding passes
def _decorator_name(node: ast.expr) -> str | None:
    """``module_pass`` for ``@module_pass(...)``, ``@tvm.transform.module_pass(...)`` or bare."""
    target = node.func if isinstance(node, ast.Call) else node
    if isinstance(target, ast.Name):
        return target.id
    if isinstance(target, ast.Attribute):
        return target.attr
    return None


def passes_in_source(source: str) -> set[str]:
    """The names of the classes and functions a pass decorator decorates in ``source``."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and any(
                _decorator_name(d) in _PASS_DECORATORS for d in node.decorator_list):
            found.add(node.name)
    return found


def passes_in_folder(folder: str) -> dict[str, str]:
    """Pass name -> the file of ``folder`` (at the repository root) that defines it."""
    out = {}
    for path in sorted((REPO_ROOT / folder).glob("*.py")):
        for name in passes_in_source(path.read_text()):
            out[name] = path.name
    return out


def passes_imported(folder: str) -> set[str]:
    """The ``tvm.transform.Pass`` classes the package ``tvm_distx.<folder>`` defines."""
    package = importlib.import_module(f"tvm_distx.{folder}")
    found = set()
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, tvm.transform.Pass) and \
                    obj.__module__ == module.__name__:
                found.add(name)
    return found


# --------------------------------------------------------------------------- finding tests
def _names_in(node: ast.AST) -> set[str]:
    """Every name and attribute name used inside ``node``."""
    names = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            names.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            names.add(sub.attr)
    return names


def structural_tests(source: str) -> dict[str, set[str]]:
    """Test function -> the names it uses, through the same file's helper functions too,
    for the tests that call ``assert_structural_equal``."""
    tree = ast.parse(source)
    functions = {node.name: node for node in tree.body
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    direct = {name: _names_in(node) for name, node in functions.items()}

    def reached(name: str) -> set[str]:
        seen, todo, names = set(), [name], set()
        while todo:
            current = todo.pop()
            if current in seen:
                continue
            seen.add(current)
            names |= direct[current]
            todo.extend(n for n in direct[current] if n in functions)
        return names

    out = {}
    for name in functions:
        if name.startswith("test"):
            names = reached(name)
            if _ASSERT in names:
                out[name] = names
    return out


def coverage(passes, files) -> dict[str, list[str]]:
    """Pass -> the ``file::test`` names that compare its output structurally."""
    out = {name: [] for name in passes}
    for path in files:
        for test, names in structural_tests(Path(path).read_text()).items():
            for name in passes:
                if name in names:
                    out[name].append(f"{Path(path).name}::{test}")
    return out


# --------------------------------------------------------------------------- the checks
@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_the_scan_finds_every_pass_the_package_defines(folder):
    """The decorators found in the source are exactly the Pass classes the package
    defines once imported, and include every pass known today."""
    scanned = set(passes_in_folder(folder))
    assert scanned == passes_imported(folder)
    assert KNOWN[folder] <= scanned, f"not found any more: {sorted(KNOWN[folder] - scanned)}"


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_every_pass_has_a_before_expected_test(folder):
    """Each pass of the folder is named by a test of the folder's structural test files
    that calls assert_structural_equal."""
    files = sorted(TESTS_DIR.glob(FOLDERS[folder]))
    assert files, f"no file matches tests/{FOLDERS[folder]}"
    found = coverage(passes_in_folder(folder), files)
    missing = sorted(name for name, tests in found.items() if not tests)
    assert not missing, (
        f"passes of {folder}/ with no Before/Expected test in tests/{FOLDERS[folder]}: "
        f"{', '.join(f'{name} ({passes_in_folder(folder)[name]})' for name in missing)}; "
        "write one that runs the pass and compares with tvm.ir.assert_structural_equal")


# --------------------------------------------------------------------------- the checker itself
_DEFINES = textwrap.dedent("""
    @module_pass(name="x.Plain")
    class Plain: ...

    @tvm.transform.module_pass(opt_level=0, name="x.Tvm")
    class ThroughTvm: ...

    @dataclass
    class NotAPass: ...

    def helper(): ...
""")

_TESTS = textwrap.dedent("""
    def run(mod):
        return Plain()(mod)

    def test_plain_through_a_helper():
        tvm.ir.assert_structural_equal(run(Before), Expected)

    def test_tvm_without_a_comparison():
        assert ThroughTvm()(Before) is not None

    def test_compares_another_thing():
        tvm.ir.assert_structural_equal(Before, Before)
""")


def test_the_checker_finds_decorated_passes_only():
    """Both decorator spellings count; an ordinary class or function does not."""
    assert passes_in_source(_DEFINES) == {"Plain", "ThroughTvm"}


def test_the_checker_counts_a_test_only_when_it_compares_the_pass_output(tmp_path):
    """A test comparing through a helper covers its pass; running a pass without
    assert_structural_equal, or comparing without the pass, covers nothing."""
    path = tmp_path / "test_x_structural.py"
    path.write_text(_TESTS)
    found = coverage(passes_in_source(_DEFINES), [path])
    assert found == {"Plain": ["test_x_structural.py::test_plain_through_a_helper"],
                     "ThroughTvm": []}
