"""``./run.sh run|generate`` on a board: check the bundle, then start the board's own ``mpiexec``.

A board has Debian's Python, numpy and MPI (Open MPI, for python3-mpi4py) and no
TVM. The bundle's ``run.sh`` puts the bundle's copy of the runtime on
``PYTHONPATH`` and calls ``python3 -m tvm_distx.runtime.board COMMAND BUNDLE ...``, which
lands here (:func:`launch`):

1. the bundle is checked before any rank starts: its manifest, its plan, its
   library's architecture (a library for another CPU is one line), and, for the
   ranks that run on this machine, their weight files;
2. the hostfile (``--hostfile``, our ``host[:slots]`` format) is translated for
   the ``mpiexec`` found (Open MPI's ``host slots=N``; MPICH's ``-hosts``) and its
   slots must hold the bundle's ranks;
3. ``mpiexec`` runs ``python3 -m tvm_distx.runtime.board job ...`` on every rank
   (:mod:`tvm_distx.runtime.board.job`); its standard output (the results) passes through,
   its standard error is kept, and a failure is told in one line: the rank's own
   (``[tvm_distx] rank N on HOST: ...``) or, for a rank killed by a signal, which
   signal (an illegal instruction: a vector build on a CPU without vectors).
"""

from __future__ import annotations

import logging
import os
import re
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

__all__ = ["launch", "mpiexec_command"]

logger = logging.getLogger(__name__)

#: How Open MPI and MPICH say that a rank died of a signal.
_SIGNALED = (re.compile(r"exited on signal (\d+)"), re.compile(r"signal (\d+) \(([^)]*)\)"),
             re.compile(r"EXIT CODE:\s*(\d+)"))


def _flavor(mpiexec: str) -> str:
    """``"openmpi"`` or ``"mpich"``, from ``mpiexec --version``."""
    try:
        text = subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as err:
        raise LaunchError(f"{mpiexec} --version failed ({err})", reason="raised",
                          hint="install the board's MPI: apt install openmpi-bin") from None
    return "openmpi" if ("Open MPI" in text or "OpenRTE" in text or "prterun" in text) \
        else "mpich"


def mpiexec_command(mpiexec: str, num_ranks: int, hostfile: str | None,
                    workdir: Path) -> list[str]:
    """The ``mpiexec`` arguments that start ``num_ranks`` ranks, on the hostfile's hosts.

    Raises
    ------
    ArgumentError
        If the hostfile's slots do not hold exactly the bundle's ranks.
    """
    flavor = _flavor(mpiexec)
    command = [mpiexec, "-n", str(num_ranks)]
    if flavor == "openmpi":
        if os.geteuid() == 0:
            command.append("--allow-run-as-root")
        command += ["-x", "PYTHONPATH"]
    if hostfile is not None:
        placement = place_ranks(read_hostfile(hostfile), num_ranks)
        if flavor == "openmpi":
            translated = workdir / "hostfile"
            translated.write_text("".join(f"{h.name} slots={h.slots}\n"
                                          for h in placement.hosts))
            command += ["--hostfile", str(translated)]
        else:
            command += ["-hosts", placement.mpiexec_hosts()]
    elif flavor == "openmpi":
        command.append("--oversubscribe")  # more ranks than cores on one board is allowed
    return command


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
    with tempfile.TemporaryDirectory(prefix="tvm-distx-board-") as work:
        argv = mpiexec_command(found, manifest.num_ranks, hostfile, Path(work))
        argv += [sys.executable, "-m", "tvm_distx.runtime.board", "job", command,
                 str(Path(bundle).resolve()), *arguments]
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
    raise LaunchError(_died(text, done.returncode), reason="killed",
                      hint=None if verbose else "./run.sh --verbose ... shows every rank's "
                      "output")


def _died(text: str, status: int) -> str:
    """One line for a job whose rank died without a word: the signal, if MPI names one."""
    number = None
    for pattern in _SIGNALED:
        found = pattern.search(text)
        if found:
            number = int(found.group(1))
            break
    if number is not None and number > 128:  # MPICH: the exit code of a signalled process
        number -= 128
    if number is not None and 0 < number < 64:
        name = signal.Signals(number).name if number in signal.valid_signals() else str(number)
        why = " (the kernels use instructions this CPU lacks: an RVV build on a CPU " \
              "without the vector extension?)" if number == signal.SIGILL else ""
        return f"a rank died of signal {number} ({name}, {signal.strsignal(number)}){why}"
    return f"the ranks' mpiexec failed with exit status {status} and no rank said why"
