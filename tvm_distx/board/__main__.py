"""``python3 -m tvm_distx.board``: a board bundle's commands (what its ``run.sh`` calls).

::

    ./run.sh run -i x.npy [-i NAME=w.npy] -o OUT [--function F] [--hostfile FILE]
    ./run.sh generate --ids 1 2 3 --max-new-tokens 16 [-o out.npy] [--hostfile FILE]

``run`` writes ``OUT/out<i>.npy`` per result, as ``tvm-distx run`` does;
``generate`` prints the prompt and the new tokens and writes them to ``-o`` as a
``(1, n)`` array, as ``tvm-distx generate`` does. ``job`` is what ``mpiexec`` starts
on each rank. Nothing here needs TVM: numpy and mpi4py (Debian's python3-numpy and
python3-mpi4py) are checked first, each missing one told in one line.
"""

from __future__ import annotations

import importlib.util
import sys

_NEEDS = (("numpy", "python3-numpy"), ("mpi4py", "python3-mpi4py"))


def _missing() -> str | None:
    for module, package in _NEEDS:
        if importlib.util.find_spec(module) is None:
            return (f"error: this machine's Python has no {module}\n"
                    f"hint: apt install {package} (the board needs python3-numpy, "
                    "python3-mpi4py and openmpi-bin)\n")
    return None


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit status (errors in one line, no traceback)."""
    missing = _missing()
    if missing is not None:
        sys.stderr.write(missing)
        return 2
    from tvm_distx.board.commands import main as run

    return run(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
