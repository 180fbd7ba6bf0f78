"""Reading TVMScript modules from files."""

from __future__ import annotations

import ast
import os
from pathlib import Path
import re
import types

import tvm
from tvm.script import ir as script_ir, relax as script_relax, tirx as script_tir

from tvm_distx.errors import ScriptError, ShardingError, MeshError, PlacementSyntaxError
from tvm_distx.layout import Placement
from tvm_distx.layout.mesh import DeviceMesh, MeshReference, unknown_mesh_error

__all__ = ["load_module", "ScriptError"]


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
    MeshError, UnknownMeshError
        When a literal mesh reference (``device_mesh="mesh[3]"``, the mesh of an
        ``R.dist.DTensor``) is malformed or names no mesh of the module's literal
        ``I.module_global_infos``.
    PlacementSyntaxError, PlacementRankError, ShardDimError, IndivisibleShardError
        When the literal placement of an ``R.dist.DTensor`` does not fit its mesh
        or shape.
    """

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

    relax_parser = _relax_as_printed(script_relax)
    modules = {"ir": script_ir, "relax": relax_parser, "tirx": script_tir, "tir": script_tir}
    names = {"I": script_ir, "R": relax_parser, "T": script_tir}
    classes = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == "tvm.script":
            for alias in node.names:
                if alias.name in modules:
                    names[alias.asname or alias.name] = modules[alias.name]
        elif isinstance(node, ast.ClassDef):
            classes.append(node)
    scripts = [c for c in classes if any(_is_ir_module(d) for d in c.decorator_list)]
    if len(scripts) > 1:
        raise ScriptError(
            f"{path} must define exactly one @I.ir_module class, found {len(scripts)} "
            f"({', '.join(c.name for c in scripts)})",
            hint="keep one module per file",
        )
    if not scripts and len(classes) != 1:  # one undecorated class: TVM's parser says why
        raise _no_module_error(path, tree, classes)
    classes = scripts or classes
    # TVM's parser takes "mesh[-1]" as the last mesh, and reports an unknown mesh or a
    # placement that does not fit its DTensor as a C++ check: look at the literals first
    _check_mesh_literals(classes[0])
    source = ast.get_source_segment(text, classes[0], padded=True)
    decorators = "".join(
        "@" + ast.get_source_segment(text, d) + "\n" for d in classes[0].decorator_list
    )
    try:
        mod = tvm.script.from_source(decorators + source, extra_vars=names)
    except Exception as err:  # TVM reports parse errors as DiagnosticError
        raise ScriptError(f"TVM could not parse {path}: {err}", hint=_parse_hint(str(err))) \
            from None
    if not isinstance(mod, tvm.IRModule):
        raise ScriptError(f"{path} does not define an IRModule (got {type(mod).__name__})")
    return mod


def _is_ir_module(decorator: ast.expr) -> bool:
    """Whether a class decorator is ``@I.ir_module`` (``@tvm.script.ir_module``, called or not)."""
    if isinstance(decorator, ast.Call):
        decorator = decorator.func
    return (isinstance(decorator, ast.Attribute) and decorator.attr == "ir_module") or \
        (isinstance(decorator, ast.Name) and decorator.id == "ir_module")


def _no_module_error(path: Path, tree: ast.Module, classes: list[ast.ClassDef]) -> ScriptError:
    """The error for a file with no ``@I.ir_module`` class: a PyTorch file is named as one."""
    torch = any(isinstance(node, ast.Import) and any(a.name.split(".")[0] == "torch"
                                                     for a in node.names)
                or isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0]
                == "torch" for node in ast.walk(tree))
    modules = [c for c in classes
               if any(ast.unparse(b).split(".")[-1] == "Module" for b in c.bases)]
    if not (torch and modules):
        return ScriptError(
            f"{path} defines no @I.ir_module class (it has {len(classes)} other classes)"
            if classes else f"{path} defines no @I.ir_module class",
            hint="a module file holds one class decorated @I.ir_module, as mod.script() "
            "prints it", cli_hint="a module file holds one class decorated @I.ir_module "
            "(from tvm.script import ir as I), as tvm-distx annotate -o writes it")
    # the model: a module no other module of the file builds (the last one, if several)
    used = {n.id for c in modules for n in ast.walk(c) if isinstance(n, ast.Name)} | \
        {n.attr for c in modules for n in ast.walk(c) if isinstance(n, ast.Attribute)}
    top = [c.name for c in modules if c.name not in used] or [modules[-1].name]
    model = top[-1]
    script = f"{path.stem}_tvm.py"
    return ScriptError(
        f"{path} is a PyTorch file ({len(modules)} torch.nn.Module classes: "
        f"{', '.join(c.name for c in modules)}), not a TVMScript module",
        hint=f"import the model with tvm_distx.from_torch({model}(), (example_input,)), "
        "which returns the Relax module and its weights",
        cli_hint=f"the command line reads TVMScript: in Python, mod, weights = "
        f"tvm_distx.from_torch({model}(), (example_input,)); open('{script}', 'w')"
        f".write(mod.script()); numpy.savez('weights.npz', **weights); then tvm-distx plan "
        f"{script} --preset tensor-parallel --mesh 2")


#: What some of TVM's parse errors mean for DistIR modules: (text in TVM's message, hint).
_PARSE_HINTS = (
    ("FInferType attribute registered to op: relax.dist.redistribute",
     "R.dist.redistribute takes a DTensor: give its operand an R.dist.DTensor type, or "
     "use R.dist.annotate_sharding on a plain tensor"),
)


def _parse_hint(message: str) -> str | None:
    return next((hint for text, hint in _PARSE_HINTS if text in message), None)


def _relax_as_printed(relax_script):
    """TVMScript's ``R`` that also reads what TVM prints.

    TVM prints ``R.DTensor`` and ``R.device_mesh``, but its parser knows them
    only as ``R.dist.DTensor`` and ``R.dist.device_mesh``; with these aliases a
    printed module (``mod.script()``, our stage dumps) loads back as it is.
    """

    namespace = types.ModuleType(relax_script.__name__)
    namespace.__dict__.update(relax_script.__dict__)
    for name in ("DTensor", "device_mesh"):
        if not hasattr(relax_script, name):
            setattr(namespace, name, getattr(relax_script.dist, name))
    return namespace


# ---------------------------------------------------------------------- literal checks
_REF = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*\[\s*(-?[0-9]+)\s*\]\s*$")


def _literal(node):
    """The value of a literal expression (numbers, strings, tuples, lists), else None."""
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


def _attr_name(func) -> str | None:
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)


def _global_meshes(cls: ast.ClassDef):
    """``{key: [DeviceMesh or None, ...]}`` from a literal ``I.module_global_infos``.

    Returns None when the module's global infos are not all literal (nothing is
    checked then), and an empty dict when the module declares none.
    """

    calls = [n.value for n in cls.body if isinstance(n, ast.Expr)
             and isinstance(n.value, ast.Call) and _attr_name(n.value.func) == "module_global_infos"]
    if not calls:
        return {}
    if len(calls) != 1 or len(calls[0].args) != 1 or not isinstance(calls[0].args[0], ast.Dict):
        return None
    found = {}
    for key, value in zip(calls[0].args[0].keys, calls[0].args[0].values):
        name = _literal(key) if key is not None else None
        if not isinstance(name, str) or not isinstance(value, (ast.List, ast.Tuple)):
            return None
        meshes = []
        for index, item in enumerate(value.elts):
            mesh = None
            if (isinstance(item, ast.Call) and _attr_name(item.func) == "device_mesh"
                    and item.args):
                shape = _literal(item.args[0])
                bounds = item.args[1] if len(item.args) > 1 else None
                span = ([_literal(a) for a in bounds.args]
                        if isinstance(bounds, ast.Call) and _attr_name(bounds.func) == "Range"
                        else None)
                if (isinstance(shape, tuple) and all(isinstance(n, int) for n in shape)
                        and span and len(span) == 2 and all(isinstance(n, int) for n in span)):
                    try:
                        mesh = DeviceMesh(shape, range(*span), f"{name}[{index}]")
                    except ShardingError:
                        mesh = None  # TVM's parser, or a later stage, reports it
            meshes.append(mesh)
        found[name] = meshes
    return found


def _check_mesh_literals(cls: ast.ClassDef | None) -> None:
    """Check every literal mesh reference and DTensor placement of a module class."""
    meshes = _global_meshes(cls) if cls is not None else None
    if meshes is None:
        return
    names = [f"{k}[{i}]" for k, v in meshes.items() for i in range(len(v))]
    available = ", ".join(names)

    def resolve(text, function, var):
        match = _REF.match(text)
        if match is None:
            raise MeshError(f'a mesh reference looks like "mesh[0]", got {text!r}',
                            function=function, var=var,
                            hint=f"name one of the module's meshes: {available or 'none'}")
        key, index = match.group(1), int(match.group(2))
        if index < 0:
            raise MeshError(f'mesh reference "{text}" has a negative index',
                            function=function, var=var,
                            hint=f"count meshes from 0: {available or 'the module has none'}")
        if key not in meshes or index >= len(meshes[key]):
            raise unknown_mesh_error(MeshReference(key, index), names, function=function, var=var)
        return meshes[key][index]

    def check_call(call: ast.Call, function, var) -> None:
        name = _attr_name(call.func)
        keywords = {k.arg: k.value for k in call.keywords if k.arg}
        if name == "DTensor":
            args = list(call.args) + [None] * 4
            shape_node = args[0] if args[0] is not None else keywords.get("shape")
            mesh_node = args[2] if args[2] is not None else keywords.get("device_mesh")
            placement_node = args[3] if args[3] is not None else keywords.get("placement")
        elif name in ("annotate_sharding", "redistribute"):
            args = list(call.args) + [None] * 3
            shape_node = None
            mesh_node = args[1] if args[1] is not None else keywords.get("device_mesh")
            placement_node = args[2] if args[2] is not None else keywords.get("placement")
        else:
            return
        ref = _literal(mesh_node) if mesh_node is not None else None
        if not isinstance(ref, str):
            return
        mesh = resolve(ref, function, var)
        text = _literal(placement_node) if placement_node is not None else None
        if mesh is None or not isinstance(text, str):
            return
        try:
            placement = Placement.parse(text)
        except PlacementSyntaxError as err:  # say where it was written
            raise PlacementSyntaxError(err.message, function=function, var=var,
                                       placement=text, hint=err.hint) from None
        # annotate_sharding and redistribute: the operand's shape is checked by propagation
        shape = _literal(shape_node) if shape_node is not None else None
        if isinstance(shape, (tuple, list)):
            shape = tuple(n if isinstance(n, int) else None for n in shape)
        else:
            shape = None
        placement.validate(mesh, shape, function=function, var=var)

    def calls(tree):
        return [n for n in ast.walk(tree) if isinstance(n, ast.Call)] if tree is not None else []

    for node in cls.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for arg in node.args.args:
            for call in calls(arg):
                check_call(call, node.name, arg.arg)
        for stmt in ast.walk(node):  # the body before the result type: its variables are named
            if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                var = next((t.id for t in targets if isinstance(t, ast.Name)), None)
                for sub in (stmt.value, getattr(stmt, "annotation", None)):
                    for call in calls(sub):
                        check_call(call, node.name, var)
        for call in calls(node.returns):
            check_call(call, node.name, None)
