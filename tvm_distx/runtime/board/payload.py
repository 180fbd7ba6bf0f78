"""What a board bundle carries to run with no TVM: the runtime's own Python, and ``run.sh``.

A RISC-V board has Debian's python3, python3-numpy, python3-mpi4py and openmpi-bin,
and nothing of tvm-distx. A bundle built for it (``target="rvv"``) therefore holds,
beside the library, the plan, the weights and the manifest:

``python/tvm_distx/...``
    The modules the board's commands import (:func:`runtime_modules`: every module of
    ``tvm_distx`` that :mod:`tvm_distx.runtime.board.__main__` reaches through its imports,
    found by reading their source), copied as they are. None of them imports TVM
    at its top; :func:`runtime_modules` refuses one that does.
``run.sh``
    ``./run.sh run|generate ...``: puts ``python/`` on ``PYTHONPATH`` and calls
    ``python3 -m tvm_distx.runtime.board`` (:mod:`tvm_distx.runtime.board.commands`).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import logging
import shutil
from pathlib import Path

from tvm_distx.errors import InternalError

__all__ = ["ENTRY", "runtime_modules", "write_board_runtime", "BOARD_SCRIPT"]

logger = logging.getLogger(__name__)

#: The module a board runs (``python3 -m``), whose imports make the board's runtime.
ENTRY = "tvm_distx.runtime.board.__main__"
_FORBIDDEN = ("tvm", "tvm_ffi")

BOARD_SCRIPT = """#!/bin/sh
# tvm-distx bundle for {target} boards: {n} ranks. The board needs python3, python3-numpy,
# python3-mpi4py and openmpi-bin (Debian's packages); no TVM, no tvm-distx installed.
#   ./run.sh run -i x.npy [-i NAME=w.npy] -o OUT         one call; results OUT/out<i>.npy
#   ./run.sh generate --ids 1 2 3 --max-new-tokens 16 -o out.npy   (a generation bundle)
#   add --hostfile FILE (one 'host[:slots]' per line) to spread the ranks over boards;
#   the bundle must then sit at this same path on every board (tvm-distx deploy).
HERE="$(cd "$(dirname "$0")" && pwd)"
if ! command -v python3 >/dev/null 2>&1; then
    echo "error: this machine has no python3" >&2
    echo "hint: apt install python3-minimal python3-numpy python3-mpi4py openmpi-bin" >&2
    exit 2
fi
# numpy and mpi4py are looked for, not imported (an import takes seconds under emulation)
python3 -c "import importlib.util as u, sys
for module, package in (('numpy', 'python3-numpy'), ('mpi4py', 'python3-mpi4py')):
    if u.find_spec(module) is None:
        sys.exit('error: this machine has no ' + module + ' for python3' + chr(10) + 'hint: apt '
                 'install ' + package + ' (a board needs python3-numpy, python3-mpi4py and '
                 'openmpi-bin)')" || exit 2
if [ $# -lt 1 ]; then
    echo "usage: ./run.sh run|generate ... (./run.sh run --help)" >&2
    exit 2
fi
COMMAND="$1"
shift
PYTHONPATH="$HERE/python${{PYTHONPATH:+:$PYTHONPATH}}"
export PYTHONPATH
exec python3 -m tvm_distx.runtime.board "$COMMAND" "$HERE" "$@"
"""


def _source(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise InternalError(f"the board's runtime imports {module}, which is not found")
    return Path(spec.origin)


def _imports(module: str, path: Path) -> tuple[set[str], set[str]]:
    """The ``tvm_distx`` modules ``module`` imports anywhere, and the others it imports at top."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    ours, top = set(), set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for name in names:
            if name.split(".")[0] == "tvm_distx":
                if importlib.util.find_spec(name.rpartition(".")[0] or name) is not None:
                    try:
                        if importlib.util.find_spec(name) is not None:
                            ours.add(name)
                    except ModuleNotFoundError:
                        pass
            elif node in tree.body:
                top.add(name.split(".")[0])
    return ours, top


@functools.lru_cache(maxsize=None)
def runtime_modules() -> tuple[str, ...]:
    """Every ``tvm_distx`` module the board's entry reaches, with their packages, sorted.

    Raises
    ------
    InternalError
        If one of them imports TVM at its top (the board has none).
    """
    seen: set[str] = set()
    todo = [ENTRY]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # its packages
        ours, top = _imports(module, _source(module))
        forbidden = top.intersection(_FORBIDDEN)
        if forbidden:
            raise InternalError(f"{module} imports {', '.join(sorted(forbidden))} at its top, "
                                "and the board's runtime must not")
        todo += sorted(ours)
    return tuple(sorted(seen))


def write_board_runtime(root: Path, num_ranks: int, target: str) -> None:
    """Write ``python/`` (the runtime's modules) and the board's ``run.sh`` into a bundle."""
    python = root / "python"
    if python.exists():
        shutil.rmtree(python)
    for module in runtime_modules():
        source = _source(module)
        relative = Path(*module.split("."))
        target_path = python / (relative / "__init__.py" if source.name == "__init__.py"
                                else relative.with_suffix(".py"))
        target_path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target_path)
    script = root / "run.sh"
    script.write_text(BOARD_SCRIPT.format(n=num_ranks, target=target))
    script.chmod(0o755)
    logger.info("board runtime: %d modules in %s", len(runtime_modules()), python)
