"""``./run.sh run|generate`` on a board: check the bundle, then start the board's own ``mpiexec``.

A board has Debian's Python, numpy and MPI (Open MPI, for python3-mpi4py) and no
TVM. The bundle's ``run.sh`` puts the bundle's copy of the runtime on
``PYTHONPATH`` and calls ``python3 -m tvm_distx.runtime.board COMMAND BUNDLE ...``, which
lands here (:func:`launch`):

1. the bundle is checked before any rank starts: its manifest, its plan, its
   library's architecture (a library for another CPU is one line), and, for the
   ranks that run on this machine, their weight files;
2. the hostfile (``--hostfile``, our ``host[:slots]`` format) places the ranks, its
   slots holding the bundle's; the ``mpiexec`` found (Open MPI or MPICH) gets it in
   its own terms (:mod:`tvm_distx.runtime.launcher`);
3. ``mpiexec`` runs ``python3 -m tvm_distx.runtime.board job ...`` on every rank
   (:mod:`tvm_distx.runtime.board.job`); its standard output (the results) passes through,
   its standard error is kept, and a failure is told in one line: the rank's own
   (``[tvm_distx] rank N on HOST: ...``) or, for a rank killed by a signal, which
   signal (an illegal instruction: a vector build on a CPU without vectors).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from tvm_distx.runtime.board.job import MARK
from tvm_distx.runtime.board.program import read_plan
from tvm_distx.bundle.manifest import check_library, check_weights, read_manifest
from tvm_distx.errors import LaunchError
from tvm_distx.hosts.hostfile import place_ranks, read_hostfile
from tvm_distx.runtime.launcher import RankDeath, launcher_for, rank_deaths

__all__ = ["launch"]

logger = logging.getLogger(__name__)


def launch(command: str, bundle: str, arguments: Sequence[str], *, hostfile: str | None = None,
           mpiexec: str | None = None, verbose: bool = False) -> int:
    """Check ``bundle``, run ``command`` (``run`` or ``generate``) on its ranks; the exit status.

    ``arguments`` are the command's own, passed to every rank's job.

    Raises
    ------
    BundleError, ArgumentError, LaunchError
        In one line, before any rank starts or after the job failed.
    """
    manifest = read_manifest(bundle)
    read_plan(manifest)
    check_library(manifest)
    placement = None
    if hostfile is None:
        check_weights(manifest)  # every rank runs here
    else:
        here = {os.uname().nodename, "localhost"}
        placement = place_ranks(read_hostfile(hostfile), manifest.num_ranks)
        local = [r for r in range(manifest.num_ranks) if placement.host_of(r) in here]
        check_weights(manifest, local)
    found = mpiexec or shutil.which("mpiexec")
    if found is None:
        raise LaunchError("this machine has no mpiexec", reason="raised",
                          hint="install the board's MPI: apt install openmpi-bin python3-mpi4py")
    launcher = launcher_for(found)
    with tempfile.TemporaryDirectory(prefix="tvm-distx-board-") as work:
        argv = launcher.command(
            found, manifest.num_ranks, [sys.executable, "-m", "tvm_distx.runtime.board", "job",
                                        command, str(Path(bundle).resolve()), *arguments],
            placement=placement, env=("PYTHONPATH",), workdir=Path(work))
        logger.info("board: %s", " ".join(argv))
        errors = Path(work) / "stderr"
        with open(errors, "wb") as sink:
            done = subprocess.run(argv, stderr=sink)
        text = errors.read_text(errors="replace")
    if verbose or (done.returncode == 0 and os.environ.get("TVM_DISTX_VERBOSE")):
        sys.stderr.write(text)
    if done.returncode == 0:
        if not verbose:  # the job's own lines (its timings), not MPI's
            sys.stderr.write("".join(line[len(MARK):] + "\n" for line in text.splitlines()
                                     if line.startswith(MARK)))
        return 0
    mine = [line[len(MARK):] for line in text.splitlines() if line.startswith(MARK)]
    if mine:  # a rank's own line, with its own hint
        raise LaunchError(mine[0], reason="raised" if done.returncode == 2 else "exited")
    raise LaunchError(_died(rank_deaths(text, launcher), done.returncode), reason="killed",
                      hint=None if verbose else "./run.sh --verbose ... shows every rank's "
                      "output")


def _died(deaths: list[RankDeath], status: int) -> str:
    """One line for a job whose rank died without a word: the signal, if MPI names one."""
    number = next((d.signal for d in deaths if d.signal is not None), None)
    if number is not None:
        name = signal.Signals(number).name if number in signal.valid_signals() else str(number)
        why = " (the kernels use instructions this CPU lacks: an RVV build on a CPU " \
              "without the vector extension?)" if number == signal.SIGILL else ""
        return f"a rank died of signal {number} ({name}, {signal.strsignal(number)}){why}"
    return f"the ranks' mpiexec failed with exit status {status} and no rank said why"
