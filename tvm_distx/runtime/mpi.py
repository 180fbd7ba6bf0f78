"""The MPI backend's driver: a bundle's ranks under ``mpiexec``, launched once, called many times.

::

    with MPISession("bundle/") as session:         # mpiexec -n N ... once
        first = session.run(x)                      # milliseconds of overhead
        second = session.run(y)                     # the same processes, weights loaded

    # the same, with ranks on three machines (rank 0 need not be this one)
    MPISession("bundle/", hostfile="hosts.txt", dest="/srv/model")

A one-shot run (:meth:`tvm_distx.DistExecutable.run`,
:func:`tvm_distx.runtime.backends.launch`, ``tvm-distx run``) is a session
opened, called once and closed. Each rank (:mod:`tvm_distx.runtime.mpi_rank`)
checks the bundle, loads its library and creates its virtual machine once, and
loads its stored weights the first time a function needs them. A call's inputs
are checked against the function (:func:`tvm_distx.runtime.base.bind_inputs`)
and cut into each rank's shards here; each rank's move over TCP to that rank,
never through files, and so do its results.

Hosts
-----
``hosts=["a:2", "b"]`` or ``hostfile="hosts.txt"`` (``host[:slots]`` per line,
see :mod:`tvm_distx.hosts`) places the ranks in that order, filling each
host's slots; the slots must add up to the bundle's rank count. ``mpiexec``
(the ``mpich`` wheel's, or ``mpiexec=``) starts the ranks on other hosts
through the remote shell (``rsh=``, ``TVM_DISTX_RSH``, else ``ssh``; hydra's
``-launcher ssh -launcher-exec PROGRAM``). The ranks read the bundle at
``dest`` on their host, where ``tvm-distx deploy`` put each host's share
(:func:`tvm_distx.hosts.deploy`); without ``dest``, at this bundle's own path
(a filesystem every host shares). Before anything starts, every other host is
asked, over the remote shell, whether it has its ranks' files of this very
bundle (:func:`tvm_distx.hosts.check_deployed`): a host that does not answer,
or lacks a file, fails the session in one line naming the host and the file.

Every rank keeps one authenticated TCP connection to this process
(:mod:`tvm_distx.runtime.control`), wherever it runs: over it each rank says
who it is and, every second, what it is doing, and receives its calls.

Failures
--------
Failures end the session and raise :class:`tvm_distx.LaunchError` naming the
rank (and its host, when the session spans hosts):

* a rank raises: it sends its traceback and aborts the job
  (``reason="raised"``, the traceback in ``details``);
* a rank is killed: its connection closes, the first to close names it; its
  exit status comes from ``mpiexec``'s report (``reason="killed"``);
* a rank falls silent for :data:`~tvm_distx.runtime.control.LOST` seconds (its
  host or its host's network is down; ``reason="lost"``);
* a call (or the start) outlives its ``timeout``: the ranks that had not
  finished are named with what they were doing, and the one that never reached
  the collective its peers wait in is blamed (``reason="timeout"``).

Ctrl-C and any other exception in the caller close the session too. Closing
ends ``mpiexec`` and everything it started (its own process group), asks every
other host to end this session's ranks (over the remote shell), removes the
session directory and, after a failure, the shared-memory segments MPICH left
behind on this host; a closed session refuses calls. A rank that hears nothing
from this process for ``LOST`` seconds exits by itself.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Mapping, Sequence

from tvm_distx.errors import LaunchError
from tvm_distx.hosts import (RankPlacement, check_deployed, deploy, hosts_from, place_ranks,
                             remote_shell, run_on_hosts)
from tvm_distx.runtime import control
from tvm_distx.runtime.base import Call, RankProcess, Session
from tvm_distx.runtime.launcher import launcher_for, rank_deaths
from tvm_distx.runtime.memory import RANK_RUNTIME_BYTES, check_host_memory, oom_death
from tvm_distx.runtime.rank_env import rank_environment

__all__ = ["MPISession", "mpiexec_path", "DRIVER_ADDRESS_ENV"]

logger = logging.getLogger(__name__)

#: The module every rank runs (``python -m``).
RANK_MODULE = "tvm_distx.runtime.mpi_rank"

#: Overrides the address other hosts reach this process at (default: this host's name,
#: the one ``mpiexec``'s own proxies connect back to).
DRIVER_ADDRESS_ENV = "TVM_DISTX_DRIVER_ADDRESS"

#: How hydra's proxy on a host reports that it failed (it could not reach ``mpiexec``, say).
_PROXY_SAYS = re.compile(r"^\[proxy:\d+@(\S+)\] \S+ \([^)]*\): (.*)$", re.MULTILINE)
#: What a rank writes to its stderr when it fails before it could tell the driver.
_RANK_SAYS = re.compile(r"^\[tvm_distx\] rank (\d+)(?: on (\S+))?: (.*)$", re.MULTILINE)

#: Where MPICH keeps its intra-node shared memory. A job that dies leaves its
#: segments behind; a failed session removes the ones that appeared while it ran.
SHM_DIR = Path("/dev/shm")
SHM_PATTERN = "mpich_shm_*"

_HINT = "the session is closed; open a new one"


def mpiexec_path() -> str:
    """The ``mpiexec`` to use: the one next to this Python (the ``mpich`` wheel's), else PATH's.

    Raises
    ------
    LaunchError
        If there is none.
    """
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.is_file():
        return str(beside)
    found = shutil.which("mpiexec")
    if found is None:
        raise LaunchError("no mpiexec found",
                          hint='install the "mpich" wheel (pip install mpich) in this environment')
    return found


class MPISession(Session):
    """A bundle's ranks under ``mpiexec``, launched once and called many times.

    Parameters
    ----------
    bundle : path or tvm_distx.bundle.manifest.Manifest
        A directory written by :meth:`tvm_distx.DistExecutable.export`.
    num_ranks : int, optional
        Must equal the bundle's rank count when given.
    timeout : float
        Seconds the ranks may take to start, and each call by default.
    hosts : str or sequence of str, optional
        ``["a:2", "b"]`` or ``"a:2,b"``: the hosts, in rank order, each with
        its slots (1 by default). Rank 0 may run on any of them.
    hostfile : path, optional
        The same as a file, one ``host[:slots]`` per line (``#`` comments).
    rsh : str or sequence of str, optional
        The remote shell, called like ``ssh`` (default: ``TVM_DISTX_RSH``,
        else ``ssh``).
    dest : path, optional
        Where the bundle was deployed on the hosts (``tvm-distx deploy``,
        :func:`tvm_distx.hosts.deploy`); each host's copy is checked, never
        copied again.
    shared_fs : bool
        The checkpoint the bundle's weights link to (``CausalLM.from_pretrained``)
        sits at the same path on every host, and so does the bundle if every
        host has it there: then nothing is copied; else only the bundle's
        library, manifest and stored weights are, the checkpoint never.

        With neither, a session across hosts copies each host its share into
        a directory of its own there (``/tmp/tvm-distx-session-...``), and
        removes it when it closes.
    mpiexec : str, optional
        The ``mpiexec`` executable (default: :func:`mpiexec_path`).
    env : mapping, optional
        Extra environment variables for the ranks.

    Raises
    ------
    ArgumentError
        For hosts whose slots do not add up to the bundle's ranks.
    BundleError
        For a bundle that cannot run here (before anything starts).
    LaunchError
        If a host lacks its files or does not answer, or the ranks do not start.

    See Also
    --------
    tvm_distx.runtime.base.Session : :meth:`run`, :meth:`close` and the
        attributes every session has.
    """

    backend = "mpi"
    #: the module each rank runs (``python -m``)
    rank_module = RANK_MODULE
    #: what one rank process costs before its weights (the memory check before a launch)
    runtime_bytes = RANK_RUNTIME_BYTES

    def __init__(self, bundle, *, num_ranks: int | None = None, timeout: float = 300.0,
                 hosts: str | Sequence[str] | None = None,
                 hostfile: str | os.PathLike | None = None,
                 rsh: str | Sequence[str] | None = None, dest: str | os.PathLike | None = None,
                 shared_fs: bool = False, mpiexec: str | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        listed = hosts_from(hosts=hosts, hostfile=hostfile)
        remote = bool(listed) and any(h.name not in _this_host() for h in listed)
        super().__init__(bundle, num_ranks=num_ranks, timeout=timeout, check_here=not remote)
        world = self.manifest.num_ranks
        self.placement: RankPlacement | None = place_ranks(listed, world) if listed else None
        self._remote = [h for h in self.placement.names if h not in _this_host()] \
            if remote else []
        self._shell = remote_shell(rsh) if remote else None
        # every host has the memory for its ranks, or nothing starts (nor is copied)
        self._memory = check_host_memory(
            self.manifest, self.placement, rsh=self._shell, runtime_bytes=self.runtime_bytes,
            local=[h for h in self.placement.names if h in _this_host()] if listed else ())
        self._tag = f"tvm-distx-session-{os.getpid()}-{os.urandom(4).hex()}"
        self._copies: str | None = None  # the copy this session deployed, removed at close
        started = time.monotonic()
        executable = mpiexec or mpiexec_path()
        self._launcher = launcher_for(executable)  # before anything is copied or started
        root = self._bundle_on_hosts(dest, shared_fs) if remote else (
            Path(dest) if dest is not None else self.manifest.root.resolve())
        self._dir = Path(tempfile.mkdtemp(prefix=f"{self._tag}-"))
        self._log = self._dir / "mpiexec.log"
        self._segments = _segments()
        self._proc = None
        key = control.new_key()
        self._links = control.RankLinks(world, key, bind="" if self._remote else "127.0.0.1")
        address = f"{_driver_address(bool(self._remote))}:{self._links.port}"
        command = self._launcher.command(
            executable, world, [sys.executable, "-m", self.rank_module, str(root), address,
                                self._tag],
            placement=self.placement, env=(control.KEY_ENV, "GLIBC_TUNABLES", *(env or {})),
            remote_shell=self._remote_shell() if self._remote else None, workdir=self._dir)
        logger.info("session: launching %s", " ".join(command))
        environment = {**rank_environment(os.environ, env), control.KEY_ENV: key.hex()}
        try:
            with open(self._log, "wb") as log:
                self._proc = subprocess.Popen(command, env=environment, stdout=log,
                                              stderr=subprocess.STDOUT, start_new_session=True)
        except BaseException:  # no mpiexec started: nothing to stop
            self._links.close()
            shutil.rmtree(self._dir, ignore_errors=True)
            self._remove_copies()
            raise
        self._closed = False
        try:
            reply = self._receive(started + timeout, "starting", timeout)
            self.ranks = tuple(RankProcess(r) for r in reply[1])
        except BaseException:
            self._shut(failed=True)
            raise
        logger.info("session: %d ranks ready in %.2f s", len(self.ranks),
                    time.monotonic() - started)

    # -- calls
    def _call(self, call: Call, timeout: float):
        for rank, message in enumerate(self._messages(call)):
            self._links.send(rank, ("run", message))
        deadline, doing = time.monotonic() + timeout, f"running '{call.function}'"
        replies = {}
        while len(replies) < self.manifest.num_ranks:
            _, rank, reply = self._receive(deadline, doing, timeout)
            replies[rank] = reply
        return ({r: blocks for r, (blocks, _) in replies.items()},
                {r: loaded for r, (_, loaded) in replies.items()})

    def close(self) -> None:
        """Stop the ranks and clean up; a second call does nothing."""
        if self._closed:
            return
        for rank in range(self.manifest.num_ranks):
            self._links.send(rank, ("close",))
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self._shut(failed=self._proc.returncode != 0)

    # -- internals
    def _bundle_on_hosts(self, dest, shared_fs: bool) -> Path:
        """Where the ranks find the bundle on their hosts, checked (or copied) before launch."""
        if dest is not None:
            check_deployed(self.manifest, self.placement, dest, rsh=self._shell)
            return Path(dest)
        root = self.manifest.root.resolve()
        if shared_fs:  # is the bundle itself there too, or only what it links to?
            probe = ["test", "-f", str(root / "manifest.json")]
            results = run_on_hosts({h: probe for h in self._remote}, rsh=self._shell)
            for host in self._remote:
                results[host].check()
            if all(results[h].returncode == 0 for h in self._remote):
                return root
        # each host its share, for this session: the linked blocks too, unless shared
        copies = f"/tmp/{self._tag}"
        self._copies = copies
        try:
            deploy(root, self.placement, copies, rsh=self._shell, shared_fs=shared_fs)
        except BaseException:
            self._remove_copies()
            raise
        return Path(copies)

    def _remove_copies(self, *, ranks_too: bool = False) -> None:
        """Remove this session's copies from the hosts; ``ranks_too``: end its ranks there first.

        One command per host, all hosts at once: after a failure, the ranks of a
        host cut off from ``mpiexec`` may still run (they exit by themselves
        once they hear nothing from this process).
        """
        steps = []
        if ranks_too:
            module = self.rank_module
            pattern = f"[{module[0]}]{module[1:]} .* {self._tag}"
            steps.append(f"pkill -KILL -f {shlex.quote(pattern)}")
        if self._copies is not None:
            steps.append(f"rm -rf {shlex.quote(self._copies)}")
        if steps and self._remote:
            hosts = self.placement.names if self._copies is not None else self._remote
            run_on_hosts({h: ["sh", "-c", "; ".join(steps)] for h in hosts}, rsh=self._shell,
                         timeout=10)
        self._copies = None

    def _remote_shell(self) -> str:
        """The program the launcher reaches other hosts with: the remote shell (a wrapper
        with its options)."""
        if len(self._shell) == 1:
            return self._shell[0]
        wrapper = self._dir / "rsh"
        wrapper.write_text("#!/bin/sh\nexec " + shlex.join(self._shell) + ' "$@"\n')
        wrapper.chmod(0o700)
        return str(wrapper)

    def _stop(self, failed: bool) -> None:
        self._links.close()
        if self._proc is not None:
            _stop(self._proc)
        self._remove_copies(ranks_too=failed)
        if failed:
            _remove_new_segments(self._segments)
        shutil.rmtree(self._dir, ignore_errors=True)

    def _receive(self, deadline: float, doing: str, timeout: float):
        """Rank 0's next reply, or the error of whatever ended the session first."""
        while True:
            try:
                reply = self._links.replies.get(timeout=0.1)
            except queue.Empty:
                reply = None
            if self._links.failure is not None:
                raise self._failure(doing)
            if reply is not None:
                return reply
            if self._proc.poll() is not None:
                time.sleep(0.2)  # a connection that closed with it may not be read yet
                raise self._failure(doing)
            if time.monotonic() > deadline:
                raise self._timed_out(doing, timeout)

    def _where(self, rank: int) -> str:
        """``rank 1`` or, in a session across hosts, ``rank 1 on node2``."""
        host = self._host(rank)
        return f"rank {rank} on {host}" if self._remote and host else f"rank {rank}"

    def _timed_out(self, doing: str, timeout: float) -> LaunchError:
        """The error of a start or a call that outlived ``timeout``, blaming the straggler."""
        unfinished = []
        for rank in range(self.manifest.num_ranks):
            info = self._links.ranks.get(rank)
            state, calls = (info.status, info.collectives) if info else ("not started", 0)
            if state not in ("ready", "done"):
                unfinished.append((rank, state, calls))
        straggler = _straggler(unfinished)
        blame = (f"{self._where(straggler)} never reached the collective its peers wait in; "
                 if straggler is not None else "")
        return LaunchError(
            f"the session timed out {doing} after {timeout:g} s; {blame}ranks not done: "
            + ", ".join(f"{r} ({state}, {calls} collectives)" for r, state, calls in unfinished),
            rank=straggler, reason="timeout", host=self._host(straggler),
            hint="the session is closed; a rank is stuck (often in a collective some rank never "
            "reached); raise timeout= if the program is just slow")

    def _host(self, rank: int | None) -> str | None:
        """The host ``rank`` runs on: as it said, else as placed (None when unknown)."""
        if rank is None:
            return None
        info = self._links.ranks.get(rank)
        if info is not None:
            return info.host
        return self.placement.host_of(rank) if self.placement is not None else None

    def _host_name(self, rank: int) -> str:
        """The name ``rank``'s host has in the placement (``localhost`` without one)."""
        return self.placement.host_of(rank) if self.placement is not None else "localhost"

    def _oom(self, rank: int | None, host: str | None, details: str) -> LaunchError | None:
        """The error of ``rank`` on ``host`` killed by the kernel for memory, if it was."""
        if self.placement is None:
            host = "localhost"  # every rank is on this host
        if host is None:
            return None
        if host not in self._memory:  # hydra names the host as it resolved it
            host = next((h for h in self._memory if h.split(".")[0] == host.split(".")[0]),
                        None)
            if host is None:
                return None
        local = [host] if self.placement is None or host in _this_host() else []
        return oom_death(rank, host, self._memory, local=local, rsh=self._shell,
                         details=details)

    def _failure(self, doing: str) -> LaunchError:
        """The error that names the rank that ended the session."""
        failure = self._links.failure
        if failure is not None and failure.kind == "died" and self._proc.poll() is None:
            try:  # mpiexec reports the exit status once its teardown is over
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        log = self._log.read_text(errors="replace") if self._log.is_file() else ""
        if failure is not None and failure.kind == "raised":
            return LaunchError(f"{self._where(failure.rank)} failed {doing}: {failure.summary}",
                               rank=failure.rank, reason="raised", details=failure.text,
                               hint=_HINT,
                               host=self._host(failure.rank))
        if failure is not None and failure.kind == "lost":
            hosts = sorted({self._host(r) for r in self._links.silent()})
            return LaunchError(
                f"lost {self._where(failure.rank)}: nothing heard from it for "
                f"{failure.text} s {doing} (its host or the network to it is down"
                + (f"; silent: {', '.join(h for h in hosts if h)}" if len(hosts) > 1 else "")
                + ")", rank=failure.rank, reason="lost", host=self._host(failure.rank),
                details=_tail(log), hint=_HINT)
        if failure is not None:  # died: its connection closed first
            info = self._links.ranks[failure.rank]
            death = next((d for d in rank_deaths(log, self._launcher)
                          if d.is_of(failure.rank, info.pid, info.host)), None)
            if death is None or death.signal == signal.SIGKILL:  # the kernel, out of memory?
                oom = self._oom(failure.rank, self._host_name(failure.rank), _tail(log))
                if oom is not None:
                    return oom
            how = ("died without reporting an error (killed, or it exited early)"
                   if death is None else f"died with {death.describe()}")
            return LaunchError(f"{self._where(failure.rank)} (pid {info.pid}) {how} {doing}",
                               rank=failure.rank,
                               reason="killed", details=_tail(log), hint=_HINT, host=info.host)
        for death in rank_deaths(log, self._launcher):  # killed before it reached this process
            if death.signal == signal.SIGKILL:
                host = self._host_name(death.rank) if death.rank is not None else death.host
                oom = self._oom(death.rank, host, _tail(log))
                if oom is not None:
                    return oom
        said = _RANK_SAYS.search(log)  # a rank that failed before it reached this process
        if said is not None:
            rank = int(said.group(1))
            return LaunchError(f"{self._where(rank)} failed {doing}: {said.group(3)}", rank=rank,
                               reason="raised", details=_tail(log), hint=_HINT,
                               host=said.group(2) or self._host(rank))
        proxy = _PROXY_SAYS.search(log)  # a host whose proxy failed: it never ran its ranks
        if proxy is not None:
            host = proxy.group(1)
            return LaunchError(f"host {host} failed {doing}: {proxy.group(2)}",
                               reason="unreachable", host=host, details=_tail(log),
                               hint=f"{host} must reach this host by the name mpiexec gives it "
                               f"({socket.gethostname()}): check its network and firewall")
        return LaunchError(f"the session's ranks stopped {doing} (mpiexec exited with code "
                           f"{self._proc.returncode})", reason="exited", details=_tail(log),
                           hint=_HINT)


def _straggler(unfinished: list[tuple[int, str, int]]) -> int | None:
    """The one rank that entered fewer collectives than the others, if there is one."""
    if len(unfinished) < 2:
        return unfinished[0][0] if unfinished else None
    fewest = min(calls for _, _, calls in unfinished)
    behind = [rank for rank, _, calls in unfinished if calls == fewest]
    return behind[0] if len(behind) == 1 else None


def _segments() -> set[Path]:
    return set(SHM_DIR.glob(SHM_PATTERN)) if SHM_DIR.is_dir() else set()


def _remove_new_segments(before: set[Path]) -> None:
    for path in _segments() - before:
        logger.info("removing %s, left by the failed job", path)
        path.unlink(missing_ok=True)


def _stop(proc: subprocess.Popen) -> None:
    """End ``mpiexec`` and everything it started (its own process group)."""
    if proc.poll() is None:
        for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
    try:  # ranks that escaped mpiexec's teardown share its process group
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _this_host() -> set[str]:
    """The names this host answers to."""
    names = {"localhost", "127.0.0.1", socket.gethostname(), socket.getfqdn()}
    return names | {name.split(".")[0] for name in names}


def _driver_address(remote: bool) -> str:
    """The address the ranks reach this process at."""
    if not remote:
        return "127.0.0.1"
    return os.environ.get(DRIVER_ADDRESS_ENV) or socket.gethostname()
