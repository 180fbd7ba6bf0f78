"""``python3 -m tvm_distx.runtime.board``: a board bundle's commands (what its ``run.sh`` calls).

::

    ./run.sh run -i x.npy [-i NAME=w.npy] -o OUT [--function F] [--hostfile FILE]
    ./run.sh generate --ids 1 2 3 --max-new-tokens 16 [-o out.npy] [--hostfile FILE]

``run`` writes ``OUT/out<i>.npy`` per result, as ``tvm-distx run`` does;
``generate`` prints the prompt and the new tokens and writes them to ``-o`` as a
``(1, n)`` array, as ``tvm-distx generate`` does. ``job`` is what ``mpiexec`` starts
on each rank (:mod:`tvm_distx.runtime.board.commands`). Nothing here needs TVM; ``run.sh``
checks for numpy and mpi4py (Debian's python3-numpy and python3-mpi4py) first.
"""

import sys

from tvm_distx.runtime.board.commands import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
