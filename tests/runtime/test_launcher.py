"""The one builder of launcher commands and the one reader of rank deaths (MPICH, Open MPI).

The argument vectors are compared whole; the reports are MPICH 5's hydra output as this
machine's ``mpiexec`` prints it, and Open MPI 4's and 5's as Debian's print theirs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tvm_distx.hosts.hostfile import Host, place_ranks
from tvm_distx.runtime.launcher import (Hydra, OpenMPI, RankDeath, launcher_for,
                                        rank_deaths)
from tvm_distx.runtime.mpi import mpiexec_path

PROGRAM = ["python3", "-m", "tvm_distx.runtime.board", "job", "run", "/srv/b"]


def test_hydra_places_ranks_with_hosts_and_reaches_them_with_the_remote_shell():
    placement = place_ranks([Host("a", 2), Host("b", 1)], 3)
    assert Hydra().command("mpiexec", 3, PROGRAM, env=("PYTHONPATH",)) == \
        ["mpiexec", "-n", "3", *PROGRAM]
    assert Hydra().command("mpiexec", 3, PROGRAM, placement=placement,
                           remote_shell="/tmp/s/rsh") == \
        ["mpiexec", "-n", "3", "-hosts", "a:2,b:1", "-launcher", "ssh", "-launcher-exec",
         "/tmp/s/rsh", *PROGRAM]


def test_open_mpi_gets_a_hostfile_the_variables_and_root_only_when_root(tmp_path):
    placement = place_ranks([Host("a", 2), Host("b", 1)], 3)
    assert OpenMPI(as_root=True).command("mpirun", 3, PROGRAM, placement=placement,
                                         env=("PYTHONPATH", "KEY"), workdir=tmp_path) == \
        ["mpirun", "-n", "3", "--allow-run-as-root", "-x", "PYTHONPATH", "-x", "KEY",
         "--hostfile", str(tmp_path / "hostfile"), *PROGRAM]
    assert (tmp_path / "hostfile").read_text() == "a slots=2\nb slots=1\n"
    assert OpenMPI(as_root=False).command("mpirun", 2, PROGRAM, remote_shell="rsh") == \
        ["mpirun", "-n", "2", "--oversubscribe", "--mca", "plm_rsh_agent", "rsh", *PROGRAM]


HYDRA_KILLED = """
===================================================================================
=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES
=   PID 9503 RUNNING AT vm
=   EXIT CODE: 9
=   CLEANING UP REMAINING PROCESSES
=   YOU CAN IGNORE THE BELOW CLEANUP MESSAGES
===================================================================================
YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)
This typically refers to a problem with your application.
Please see the FAQ page for debugging suggestions
"""

#: hydra with the rank named, for a rank run through a shell (128 + SIGILL)
HYDRA_THROUGH_A_SHELL = """
===================================================================================
=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES
=   RANK 1 PID 311 RUNNING AT board2.lan
=   EXIT CODE: 132
=   CLEANING UP REMAINING PROCESSES
===================================================================================
"""

OPEN_MPI_4_SIGNAL = """\
--------------------------------------------------------------------------
Primary job  terminated normally, but 1 process returned
a non-zero exit code. Per user-direction, the job has been aborted.
--------------------------------------------------------------------------
--------------------------------------------------------------------------
mpiexec noticed that process rank 1 with PID 0 on node board1 exited on signal 4 (Illegal instruction).
--------------------------------------------------------------------------
"""

OPEN_MPI_5_SIGNAL = """\
--------------------------------------------------------------------------
prterun noticed that process rank 0 with PID 4242 on node board1 exited on
signal 11 (Segmentation fault).
--------------------------------------------------------------------------
"""

OPEN_MPI_EXIT = """\
--------------------------------------------------------------------------
mpiexec detected that one or more processes exited with non-zero status, thus causing
the job to be terminated. The first process to do so was:

  Process name: [[31337,1],1]
  Exit code:    3
--------------------------------------------------------------------------
"""


@pytest.mark.parametrize("text, launcher, want", [
    (HYDRA_KILLED, Hydra(), [RankDeath(None, 9503, "vm", 9, signal.SIGKILL)]),
    (HYDRA_THROUGH_A_SHELL, Hydra(), [RankDeath(1, 311, "board2.lan", 132, signal.SIGILL)]),
    (OPEN_MPI_4_SIGNAL, OpenMPI(), [RankDeath(1, 0, "board1", None, signal.SIGILL)]),
    (OPEN_MPI_5_SIGNAL, OpenMPI(), [RankDeath(0, 4242, "board1", None, signal.SIGSEGV)]),
    (OPEN_MPI_EXIT, OpenMPI(), [RankDeath(1, status=3)]),
    ("[tvm_distx] rank 1 on vm: out of memory\n", Hydra(), []),
])
def test_each_launchers_report_of_a_death_is_read_and_any_launcher_reads_it(text, launcher,
                                                                           want):
    assert launcher.deaths(text) == want
    assert rank_deaths(text) == want  # no other launcher reads something else into it


def test_a_death_says_its_status_and_signal_and_knows_its_rank():
    killed, = rank_deaths(HYDRA_KILLED)
    assert killed.describe() == "status 9 (SIGKILL)"
    assert killed.is_of(1, 9503, "vm.example.org") and not killed.is_of(1, 9504, "vm")
    shell, = rank_deaths(HYDRA_THROUGH_A_SHELL)
    assert shell.describe() == "status 132 (SIGILL)" and not shell.is_of(0, 311, "board2")
    assert rank_deaths(OPEN_MPI_5_SIGNAL)[0].describe() == "signal 11 (SIGSEGV)"
    assert rank_deaths(OPEN_MPI_EXIT)[0].describe() == "status 3 (no signal)"


def test_the_launcher_is_told_by_its_version(tmp_path):
    assert isinstance(launcher_for(mpiexec_path()), Hydra)  # the mpich wheel's
    fake = tmp_path / "mpirun"
    fake.write_text("#!/bin/sh\necho 'mpirun (Open MPI) 4.1.4'\n")
    fake.chmod(0o755)
    found = launcher_for(str(fake))
    assert isinstance(found, OpenMPI) and found.as_root == (os.geteuid() == 0)


def test_hydra_really_reports_a_killed_rank_so():
    """This machine's ``mpiexec`` on a rank that kills itself: read back as SIGKILL."""
    rank = ("import os, signal, time\n"
            "if os.environ.get('PMI_RANK') == '1':\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n"
            "time.sleep(1)\n")
    command = Hydra().command(mpiexec_path(), 2, [sys.executable, "-c", rank])
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    deaths = rank_deaths(done.stdout + done.stderr, Hydra())
    assert [d.signal for d in deaths] == [signal.SIGKILL], done.stdout + done.stderr
