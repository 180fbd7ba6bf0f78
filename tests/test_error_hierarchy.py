"""Every exception that leaves the package is a DistxError: checked on the source's AST.

``tvm_distx`` raises its own classes (:mod:`tvm_distx.errors`), which may also
derive from a builtin (``ArgumentError`` is a ``ValueError``) so that callers who
catch the builtin keep working. Raising the builtin itself is what this forbids:
``raise ValueError(...)``, ``raise RuntimeError``, ``raise builtins.KeyError(...)``.
Re-raising a caught exception (``raise``, ``raise err``) is fine, and so is
``NotImplementedError`` in an abstract method (one whose body is only the raise,
or one marked ``@abstractmethod``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("tvm_distx", "passes", "legalize")

#: Builtin exception classes that must not be raised by name.
FORBIDDEN = frozenset({"ValueError", "RuntimeError", "TypeError", "KeyError", "IndexError",
                       "AssertionError", "Exception", "BaseException", "LookupError"})


def _raised_name(node: ast.Raise) -> str | None:
    """The builtin class a ``raise`` names (``X`` or ``X(...)`` or ``builtins.X``), if any."""
    exc = node.exc
    if exc is None:
        return None
    target = exc.func if isinstance(exc, ast.Call) else exc
    if isinstance(target, ast.Name):
        return target.id
    if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
            and target.value.id == "builtins"):
        return target.attr
    return None


def _is_abstract(func: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Marked ``@abstractmethod``, or a body that is only a docstring and one ``raise``."""
    for decorator in func.decorator_list:
        name = decorator.attr if isinstance(decorator, ast.Attribute) else getattr(decorator, "id", "")
        if name == "abstractmethod":
            return True
    body = list(func.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return len(body) == 1 and isinstance(body[0], ast.Raise)


def offenders(source: str, filename: str) -> list[str]:
    """``file:line: raise X`` for each forbidden ``raise`` in ``source``."""
    tree = ast.parse(source, filename)
    found = []

    def visit(node: ast.AST, function: ast.AST | None) -> None:
        if isinstance(node, ast.Raise):
            name = _raised_name(node)
            if name in FORBIDDEN or (name == "NotImplementedError"
                                     and not (function is not None and _is_abstract(function))):
                found.append(f"{filename}:{node.lineno}: raise {name}")
        inner = node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, None)
    return found


def _package_files() -> list[Path]:
    files = [path for top in SOURCES for path in sorted((ROOT / top).rglob("*.py"))]
    assert len(files) > 100  # the walk found the package (tvm_distx/, passes/, legalize/)
    return files


def test_no_builtin_exception_is_raised_anywhere_in_the_package():
    found = []
    for path in _package_files():
        found += offenders(path.read_text(), str(path.relative_to(ROOT)))
    assert not found, ("raise a tvm_distx.errors class instead (it may also derive from the "
                       "builtin):\n" + "\n".join(found))


@pytest.mark.parametrize("code, expected", [
    ("def f():\n    raise ValueError('x')\n", ["m.py:2: raise ValueError"]),
    ("def f():\n    raise RuntimeError\n", ["m.py:2: raise RuntimeError"]),
    ("import builtins\nraise builtins.KeyError('k')\n", ["m.py:2: raise KeyError"]),
    ("try:\n    pass\nexcept OSError as e:\n    raise TypeError('t') from e\n",
     ["m.py:4: raise TypeError"]),
    ("def f(x):\n    if x:\n        raise NotImplementedError(x)\n    return x\n",
     ["m.py:3: raise NotImplementedError"]),
    ("raise AssertionError\n", ["m.py:1: raise AssertionError"]),
    # allowed: a DistxError, a re-raise, NotImplementedError in an abstract method
    ("from tvm_distx.errors import ArgumentError\nraise ArgumentError('x')\n", []),
    ("try:\n    pass\nexcept ValueError as err:\n    raise err\nexcept KeyError:\n    raise\n", []),
    ("class A:\n    def f(self):\n        '''Doc.'''\n        raise NotImplementedError\n", []),
    ("import abc\nclass A(abc.ABC):\n    @abc.abstractmethod\n    def f(self):\n"
     "        x = 1\n        raise NotImplementedError(x)\n", []),
])
def test_the_check_names_file_and_line_of_each_offender(code, expected):
    assert offenders(code, "m.py") == expected
