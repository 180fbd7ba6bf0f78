"""Starting rank processes: the launcher's command line, and how it tells of a rank's death.

Every backend whose ranks are processes started by a launcher (the MPI sessions,
:mod:`tvm_distx.runtime.mpi`, and a board's ``./run.sh``,
:mod:`tvm_distx.runtime.board.launch`) builds its command here and reads here what the
launcher printed when a rank died:

* :class:`Launcher` is one launcher: :meth:`Launcher.command` turns a rank count, the
  hosts' placement (:class:`~tvm_distx.hosts.hostfile.RankPlacement`), the environment
  variables the ranks need and the remote shell into its argument vector, followed by
  the program every rank runs; :meth:`Launcher.deaths` finds the deaths its report
  names (:class:`RankDeath`);
* :class:`Hydra` is MPICH's ``mpiexec`` (the ``mpich`` wheel's), :class:`OpenMPI` Open
  MPI's (Debian's, on boards); :func:`launcher_for` tells which one an ``mpiexec`` is,
  from its ``--version``;
* :func:`rank_deaths` reads a launcher's output for the deaths any of them reports.

Adding a launcher (Slurm's ``srun``, say) is one more :class:`Launcher` subclass in
:data:`LAUNCHERS`. A board runs this module with no TVM: it imports none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import functools
import os
from pathlib import Path
import re
import signal
import subprocess
from typing import ClassVar, Sequence

from tvm_distx.errors import InternalError, LaunchError
from tvm_distx.hosts.hostfile import RankPlacement

__all__ = ["Launcher", "Hydra", "OpenMPI", "LAUNCHERS", "RankDeath", "launcher_for",
           "rank_deaths"]


@dataclass(frozen=True)
class RankDeath:
    """A rank process that died, as its launcher reported it.

    Attributes
    ----------
    rank : int or None
        Its rank, when the report names it.
    pid : int or None
        Its process id (on its host), when the report names it.
    host : str or None
        Its host, when the report names it.
    status : int or None
        The exit status the launcher reported (hydra's ``EXIT CODE``, Open MPI's
        ``Exit code``); None when it reported a signal only.
    signal : int or None
        The signal that killed it: the one reported, or the one its status stands for
        (hydra reports a killed process's signal as its status; a shell in between
        makes it 128 + the signal).
    """

    rank: int | None = None
    pid: int | None = None
    host: str | None = None
    status: int | None = None
    signal: int | None = None

    def signal_name(self) -> str:
        """``"SIGKILL"``, or ``"no signal"``."""
        if self.signal is None or self.signal not in signal.valid_signals():
            return "no signal"
        return signal.Signals(self.signal).name

    def describe(self) -> str:
        """``"status 9 (SIGKILL)"`` or, with no status reported, ``"signal 4 (SIGILL)"``."""
        if self.status is not None:
            return f"status {self.status} ({self.signal_name()})"
        return f"signal {self.signal} ({self.signal_name()})"

    def is_of(self, rank: int | None, pid: int | None, host: str | None) -> bool:
        """Whether this death is that rank's (by rank, else by process id and host)."""
        if self.rank is not None and rank is not None:
            return self.rank == rank
        return pid is not None and self.pid == pid and (
            host is None or self.host is None or _same_host(self.host, host))


def _signal_of_status(status: int) -> int | None:
    """The signal an exit status reported for a killed process stands for, if any."""
    number = status - 128 if status > 128 else status
    return number if 0 < number < 65 else None


class Launcher:
    """One launcher of rank processes: its command line and its reports of dead ranks.

    A subclass sets :attr:`name` and :attr:`marks` and writes :meth:`_options` (what
    goes between the rank count and the program) and :meth:`deaths`.
    """

    #: The launcher's name (the key of :data:`LAUNCHERS`).
    name: ClassVar[str] = ""
    #: Words its ``--version`` prints, which tell it from the others.
    marks: ClassVar[tuple[str, ...]] = ()

    def command(self, executable: str, num_ranks: int, program: Sequence[str], *,
                placement: RankPlacement | None = None, env: Sequence[str] = (),
                remote_shell: str | None = None, workdir: Path | None = None) -> list[str]:
        """The argument vector that starts ``num_ranks`` ranks of ``program``.

        Parameters
        ----------
        executable : str
            The launcher's program (an ``mpiexec``).
        num_ranks : int
            The ranks to start.
        program : sequence of str
            What every rank runs (``python -m MODULE ARGS...``).
        placement : RankPlacement, optional
            The hosts, in rank order, each with its slots; None: every rank on this host.
        env : sequence of str
            Environment variables (of the launcher's own environment) the ranks need, for
            launchers that do not pass theirs whole.
        remote_shell : str, optional
            The program that reaches another host (called like ``ssh``).
        workdir : pathlib.Path, optional
            A directory for the files a launcher needs (Open MPI's hostfile).
        """
        return [executable, "-n", str(num_ranks),
                *self._options(num_ranks, placement, list(env), remote_shell, workdir),
                *program]

    def _options(self, num_ranks: int, placement: RankPlacement | None, env: list[str],
                 remote_shell: str | None, workdir: Path | None) -> list[str]:
        raise NotImplementedError

    def deaths(self, text: str) -> list[RankDeath]:
        """The dead ranks the launcher's output ``text`` names, in its order."""
        raise NotImplementedError


class Hydra(Launcher):
    """MPICH's ``mpiexec`` (hydra): it passes its whole environment to the ranks."""

    name = "mpich"
    marks = ("HYDRA",)
    #: ``=   PID 9503 RUNNING AT vm`` then ``=   EXIT CODE: 9`` (``RANK 1`` may lead).
    _DIED = re.compile(r"(?:RANK\s+(\d+)\s+)?PID\s+(\d+)\s+RUNNING AT\s+(\S+)\s*\n"
                       r"[=\s]*(?:EXIT CODE|KILLED BY SIGNAL):\s*(\d+)")

    def _options(self, num_ranks, placement, env, remote_shell, workdir) -> list[str]:
        options = []
        if placement is not None:
            options += ["-hosts", placement.mpiexec_hosts()]
        if remote_shell is not None:
            options += ["-launcher", "ssh", "-launcher-exec", remote_shell]
        return options

    def deaths(self, text: str) -> list[RankDeath]:
        found = []
        for match in self._DIED.finditer(text):
            rank, pid, host, status = match.groups()
            found.append(RankDeath(int(rank) if rank else None, int(pid), host, int(status),
                                   _signal_of_status(int(status))))
        return found


@dataclass(frozen=True)
class OpenMPI(Launcher):
    """Open MPI's ``mpiexec`` (``mpirun``, ``prterun``).

    Parameters
    ----------
    as_root : bool
        This process is root, which Open MPI refuses unless told
        (``--allow-run-as-root``); by default, whether it is.
    """

    name: ClassVar[str] = "openmpi"
    marks: ClassVar[tuple[str, ...]] = ("Open MPI", "OpenRTE", "prterun")
    as_root: bool = field(default_factory=lambda: os.geteuid() == 0)
    #: ``... noticed that process rank 1 with PID 4242 on node b1 exited on signal 4 (...)``
    _SIGNALED: ClassVar[re.Pattern] = re.compile(
        r"process\s+rank\s+(\d+)\s+with\s+PID\s+(\d+)\s+on\s+node\s+(\S+)\s+exited\s+on\s+"
        r"signal\s+(\d+)")
    #: ``Process name: [[4242,1],1]`` then ``Exit code:    3``
    _EXITED: ClassVar[re.Pattern] = re.compile(
        r"Process name:\s*\[\[\d+,\d+\],(\d+)\]\s*\n\s*Exit code:\s*(\d+)")

    def _options(self, num_ranks, placement, env, remote_shell, workdir) -> list[str]:
        options = ["--allow-run-as-root"] if self.as_root else []
        for name in env:
            options += ["-x", name]
        if placement is not None:
            if workdir is None:
                raise InternalError("Open MPI's hosts go in a hostfile: give the launcher "
                                    "a workdir")
            hostfile = Path(workdir) / "hostfile"
            hostfile.write_text("".join(f"{h.name} slots={h.slots}\n" for h in placement.hosts))
            options += ["--hostfile", str(hostfile)]
        else:
            options.append("--oversubscribe")  # more ranks than cores on one host is allowed
        if remote_shell is not None:
            options += ["--mca", "plm_rsh_agent", remote_shell]
        return options

    def deaths(self, text: str) -> list[RankDeath]:
        found = [(m.start(), RankDeath(int(m.group(1)), int(m.group(2)), m.group(3),
                                       signal=int(m.group(4))))
                 for m in self._SIGNALED.finditer(text)]
        found += [(m.start(), RankDeath(int(m.group(1)), status=int(m.group(2))))
                  for m in self._EXITED.finditer(text)]
        return [death for _, death in sorted(found, key=lambda pair: pair[0])]


#: Every launcher, by name; the first is the one assumed when ``--version`` names none.
LAUNCHERS: dict[str, type[Launcher]] = {kind.name: kind for kind in (Hydra, OpenMPI)}


@functools.lru_cache(maxsize=8)
def launcher_for(executable: str) -> Launcher:
    """The launcher ``executable`` is, from what its ``--version`` prints.

    Raises
    ------
    LaunchError
        If it cannot be run.
    """
    try:
        text = subprocess.run([executable, "--version"], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as err:
        raise LaunchError(f"{executable} --version failed ({err})", reason="raised",
                          hint="install MPI: the mpich wheel (pip install mpich), or on a "
                          "board apt install openmpi-bin") from None
    for kind in LAUNCHERS.values():
        if any(mark in text for mark in kind.marks):
            return kind()
    return next(iter(LAUNCHERS.values()))()


def rank_deaths(text: str, launcher: Launcher | None = None) -> list[RankDeath]:
    """The dead ranks a launcher's output names: ``launcher``'s, or any known launcher's."""
    kinds = [launcher] if launcher is not None else [kind() for kind in LAUNCHERS.values()]
    return [death for kind in kinds for death in kind.deaths(text)]


def _same_host(a: str, b: str) -> bool:
    return a == b or a.split(".")[0] == b.split(".")[0]
