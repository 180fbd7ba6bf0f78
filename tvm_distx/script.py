"""Reading TVMScript modules from files."""

from __future__ import annotations

import ast
import os
from pathlib import Path

from .errors import ShardingError

__all__ = ["load_module", "ScriptError"]


class ScriptError(ShardingError):
    """A TVMScript file cannot be read as an IRModule."""

    rule = "tvmscript"


def load_module(path: str | os.PathLike):
    """Parse a TVMScript file that defines one ``@I.ir_module`` class.

    The file is parsed, never executed: its ``from tvm.script import ...`` lines
    are read for the names they bind (``I``, ``R``, ``T``) and the module class
    is handed to TVM's parser.

    Parameters
    ----------
    path : str or os.PathLike
        The ``.py`` file.

    Returns
    -------
    tvm.IRModule

    Raises
    ------
    ScriptError
        When the file is missing, is not valid Python, has no or several
        ``@I.ir_module`` classes, or TVM's parser rejects it.
    """
    import tvm
    from tvm.script import ir as script_ir, relax as script_relax, tirx as script_tir

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ScriptError(f"cannot read {path}: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise ScriptError(f"{path} is not UTF-8 text: {err.reason} at byte {err.start}") from None
    try:
        tree = ast.parse(text, filename=str(path))
    except SyntaxError as err:
        raise ScriptError(f"{path} is not valid Python: line {err.lineno}: {err.msg}") from None

    script_relax = _relax_as_printed(script_relax)
    modules = {"ir": script_ir, "relax": script_relax, "tirx": script_tir, "tir": script_tir}
    names = {"I": script_ir, "R": script_relax, "T": script_tir}
    classes = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == "tvm.script":
            for alias in node.names:
                if alias.name in modules:
                    names[alias.asname or alias.name] = modules[alias.name]
        elif isinstance(node, ast.ClassDef):
            classes.append(node)
    if len(classes) != 1:
        raise ScriptError(
            f"{path} must define exactly one @I.ir_module class, found {len(classes)}",
            hint="keep one module per file",
        )
    source = ast.get_source_segment(text, classes[0], padded=True)
    decorators = "".join(
        "@" + ast.get_source_segment(text, d) + "\n" for d in classes[0].decorator_list
    )
    try:
        mod = tvm.script.from_source(decorators + source, extra_vars=names)
    except Exception as err:  # TVM reports parse errors as DiagnosticError
        raise ScriptError(f"TVM could not parse {path}: {err}") from None
    if not isinstance(mod, tvm.IRModule):
        raise ScriptError(f"{path} does not define an IRModule (got {type(mod).__name__})")
    return mod


def _relax_as_printed(relax_script):
    """TVMScript's ``R`` that also reads what TVM prints.

    TVM prints ``R.DTensor`` and ``R.device_mesh``, but its parser knows them
    only as ``R.dist.DTensor`` and ``R.dist.device_mesh``; with these aliases a
    printed module (``mod.script()``, our stage dumps) loads back as it is.
    """
    import types

    namespace = types.ModuleType(relax_script.__name__)
    namespace.__dict__.update(relax_script.__dict__)
    for name in ("DTensor", "device_mesh"):
        if not hasattr(relax_script, name):
            setattr(namespace, name, getattr(relax_script.dist, name))
    return namespace
