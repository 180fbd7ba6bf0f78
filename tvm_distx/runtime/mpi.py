"""The MPI backend's driver: a bundle's ranks under ``mpiexec``, launched once, called many times.

::

    with MPISession("bundle/") as session:         # mpiexec -n N ... once
        first = session.run(x)                      # milliseconds of overhead
        second = session.run(y)                     # the same processes, weights loaded

A one-shot run (:meth:`tvm_distx.DistExecutable.run`,
:func:`tvm_distx.runtime.backends.launch`, ``tvm-distx run``) is a session
opened, called once and closed. Each rank (:mod:`tvm_distx.runtime.mpi_rank`)
checks the bundle, loads its library and creates its virtual machine once, and
loads its stored weights the first time a function needs them. A call's inputs
are checked against the function (:func:`tvm_distx.runtime.base.bind_inputs`)
and cut into each rank's shards here; they move over a Unix socket to rank 0
and over MPI to the other ranks, never through files, and so do the results.
``mpiexec`` is the ``mpich`` wheel's (or ``mpiexec=``); ``hosts=["node0",
"node1"]`` becomes ``mpiexec -hosts node0,node1``, this host first (rank 0
talks to this process over the local socket), with the bundle at the same path
on every host.

Failures end the session and raise :class:`tvm_distx.LaunchError` naming the
rank:

* a rank raises: it writes its traceback and aborts the job
  (``reason="raised"``, the traceback in ``details``);
* a rank is killed: ``mpiexec`` tears the others down. Which rank died first
  comes from a watcher thread holding a ``pidfd`` of every rank on this host
  (``mpiexec`` names whichever process it noticed, often one it killed itself
  in the teardown); its exit status comes from ``mpiexec``'s report when that
  names it (``reason="killed"``);
* a call (or the start) outlives its ``timeout``: the ranks that had not
  finished are named with what they were doing, and the one that never reached
  the collective its peers wait in is blamed (``reason="timeout"``).

Ctrl-C and any other exception in the caller close the session too. Closing
ends ``mpiexec`` and everything it started (its own process group), removes
the session directory and, after a failure, the shared-memory segments MPICH
left behind; a closed session refuses calls.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from tvm_distx.errors import ArgumentError, LaunchError
from tvm_distx.runtime.base import Call, RankProcess, Session
from tvm_distx.runtime.rank_env import rank_environment

__all__ = ["MPISession", "mpiexec_path", "send_message", "receive_message"]

logger = logging.getLogger(__name__)

#: The module every rank runs (``python -m``).
RANK_MODULE = "tvm_distx.runtime.mpi_rank"

#: How ``mpiexec`` (MPICH's hydra) reports a process that died: its PID, then its exit code.
_BAD_EXIT = re.compile(r"PID\s+(\d+)\s+RUNNING AT\s+\S+\s*\n[=\s]*EXIT CODE:\s*(\d+)")

#: Where MPICH keeps its intra-node shared memory. A job that dies leaves its
#: segments behind; a failed session removes the ones that appeared while it ran.
SHM_DIR = Path("/dev/shm")
SHM_PATTERN = "mpich_shm_*"

_HEADER = struct.Struct("!Q")
_HINT = "the session is closed; open a new one"


def send_message(conn: socket.socket, message) -> None:
    """Send one length-prefixed pickle."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    conn.sendall(_HEADER.pack(len(data)) + data)


def receive_message(conn: socket.socket):
    """Receive one length-prefixed pickle; ``None`` when the peer has closed."""
    header = _read(conn, _HEADER.size)
    if header is None:
        return None
    data = _read(conn, _HEADER.unpack(header)[0])
    return None if data is None else pickle.loads(data)


def _read(conn: socket.socket, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = conn.recv(min(left, 1 << 22))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


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
    hosts : sequence of str, optional
        Hosts for ``mpiexec -hosts``, this host first: rank 0 talks to this
        process over a local socket; the ranks on other hosts reach it over MPI.
    mpiexec : str, optional
        The ``mpiexec`` executable (default: :func:`mpiexec_path`).
    env : mapping, optional
        Extra environment variables for the ranks.

    Raises
    ------
    BundleError
        For a bundle that cannot run here (before anything starts).
    LaunchError
        If the ranks do not start.

    See Also
    --------
    tvm_distx.runtime.base.Session : :meth:`run`, :meth:`close` and the
        attributes every session has.
    """

    backend = "mpi"

    def __init__(self, bundle, *, num_ranks: int | None = None, timeout: float = 300.0,
                 hosts: Sequence[str] | None = None, mpiexec: str | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        super().__init__(bundle, num_ranks=num_ranks, timeout=timeout)
        if hosts and hosts[0] not in _this_host():
            raise ArgumentError(
                f"rank 0 would run on {hosts[0]}, but it talks to this process over a "
                f"local socket, so it must run here ({socket.gethostname()})",
                hint=f"list this host first: hosts=['{socket.gethostname()}', ...]")
        world = self.manifest.num_ranks
        self._conn: socket.socket | None = None
        self._dir = Path(tempfile.mkdtemp(prefix="tvm-distx-session-"))
        self._log = self._dir / "mpiexec.log"
        self._segments = _segments()
        address = str(self._dir / "control.sock")
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(address)
        server.listen(1)
        command = [mpiexec or mpiexec_path(), "-n", str(world)]
        if hosts:
            command += ["-hosts", ",".join(hosts)]
        command += [sys.executable, "-m", RANK_MODULE, str(self.manifest.root.resolve()),
                    str(self._dir), address]
        logger.info("session: launching %s", " ".join(command))
        started = time.monotonic()
        try:
            with open(self._log, "wb") as log:
                self._proc = subprocess.Popen(command, env=rank_environment(os.environ, env),
                                              stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True)
        except BaseException:  # no mpiexec started: nothing to stop
            server.close()
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        self._watch = _DeathWatch(self._dir, world)
        self._watch.start()
        self._closed = False
        try:
            self._conn = self._accept(server, started + timeout)
            reply = self._receive(started + timeout, "starting", timeout)
            self.ranks = tuple(RankProcess(r) for r in reply[1])
        except BaseException:
            self._shut(failed=True)
            raise
        finally:
            server.close()
        logger.info("session: %d ranks ready in %.2f s", len(self.ranks),
                    time.monotonic() - started)

    # -- calls
    def _call(self, call: Call, timeout: float):
        send_message(self._conn, ("run", self._messages(call)))
        reply = self._receive(time.monotonic() + timeout, f"running '{call.function}'", timeout)
        return ({r: blocks for r, (blocks, _) in enumerate(reply[1])},
                {r: loaded for r, (_, loaded) in enumerate(reply[1])})

    def close(self) -> None:
        """Stop the ranks and clean up; a second call does nothing."""
        if self._closed:
            return
        self._watch.result()  # the ranks exit now: not deaths
        try:
            send_message(self._conn, ("close",))
            self._proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self._shut(failed=self._proc.returncode != 0)

    # -- internals
    def _stop(self, failed: bool) -> None:
        if self._conn is not None:
            self._conn.close()
        _stop(self._proc)
        self._watch.result()
        if failed:
            _remove_new_segments(self._segments)
        shutil.rmtree(self._dir, ignore_errors=True)

    def _accept(self, server: socket.socket, deadline: float) -> socket.socket:
        while True:
            ready, _, _ = select.select([server], [], [], 0.1)
            if ready:
                return server.accept()[0]
            self._check_alive("starting")
            if time.monotonic() > deadline:
                raise self._timed_out("starting", self.timeout)

    def _receive(self, deadline: float, doing: str, timeout: float):
        while True:
            ready, _, _ = select.select([self._conn], [], [], 0.1)
            if ready:
                reply = receive_message(self._conn)
                if reply is None:
                    try:
                        self._proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        pass
                    raise self._failure(doing)
                return reply
            self._check_alive(doing)
            if time.monotonic() > deadline:
                raise self._timed_out(doing, timeout)

    def _check_alive(self, doing: str) -> None:
        if self._proc.poll() is not None:
            raise self._failure(doing)

    def _timed_out(self, doing: str, timeout: float) -> LaunchError:
        """The error of a start or a call that outlived ``timeout``, blaming the straggler."""
        unfinished = _unfinished(self._dir, self.manifest.num_ranks)
        straggler = _straggler(unfinished)
        blame = (f"rank {straggler} never reached the collective its peers wait in; "
                 if straggler is not None else "")
        return LaunchError(
            f"the session timed out {doing} after {timeout:g} s; {blame}ranks not done: "
            + ", ".join(f"{r} ({state}, {calls} collectives)" for r, state, calls in unfinished),
            rank=straggler, reason="timeout",
            hint="the session is closed; a rank is stuck (often in a collective some rank never "
            "reached); raise timeout= if the program is just slow")

    def _failure(self, doing: str) -> LaunchError:
        """The error that names the rank that ended the session."""
        num_ranks = self.manifest.num_ranks
        raised = [(r, self._dir / f"rank{r}" / "error.txt") for r in range(num_ranks)]
        raised = [(r, p) for r, p in raised if p.is_file()]
        if raised:
            rank, path = min(raised, key=lambda item: item[1].stat().st_mtime)
            text = path.read_text(errors="replace")
            last = text.strip().splitlines()[-1] if text.strip() else "an error"
            return LaunchError(f"rank {rank} failed {doing}: {last}", rank=rank, reason="raised",
                               details=text, hint=_HINT)
        log = self._log.read_text(errors="replace") if self._log.is_file() else ""
        statuses = {int(m.group(1)): int(m.group(2)) for m in _BAD_EXIT.finditer(log)}
        died = self._watch.result()
        if died is None:  # no watcher's word (ranks on other hosts): mpiexec's report
            pids = _pids(self._dir, num_ranks)
            died = next(((pids[pid], pid) for pid in statuses if pid in pids), None)
        if died is None:
            return LaunchError(f"the session's ranks stopped {doing} (mpiexec exited with code "
                               f"{self._proc.returncode})", reason="exited",
                               details=_tail(log), hint=_HINT)
        rank, pid = died
        status = statuses.get(pid)
        if status is None:
            how = "died without reporting an error (killed, or it exited early)"
        else:
            try:
                name = signal.Signals(status).name
            except ValueError:
                name = "no signal"
            how = f"died with status {status} ({name})"
        return LaunchError(f"rank {rank} (pid {pid}) {how} {doing}", rank=rank,
                           reason="killed", details=_tail(log), hint=_HINT)


class _DeathWatch(threading.Thread):
    """Notes the first rank of this host whose process ends without having finished.

    Every rank writes ``<pid> <host>`` to its ``pid`` file as it starts; the
    watcher opens a ``pidfd`` for each one on this host and waits on them all
    with ``select``, so the first exit is seen as it happens, before
    ``mpiexec``'s teardown ends the others. A rank that ends after writing
    ``done`` or its ``error.txt`` finished (or reported its own failure).
    """

    _POLL = 0.02  # seconds between looks for new pid files

    def __init__(self, folder: Path, num_ranks: int) -> None:
        super().__init__(name="tvm-distx-death-watch", daemon=True)
        self.folder, self.num_ranks = folder, num_ranks
        self.first: tuple[int, int] | None = None
        self._done = threading.Event()
        self._wake = os.pipe()

    def result(self) -> tuple[int, int] | None:
        """Stop watching (once); the (rank, pid) that died first, or None."""
        if not self._done.is_set():
            self._done.set()
            if self.is_alive():
                os.write(self._wake[1], b"x")
        if self.is_alive():
            self.join()
        wake, self._wake = self._wake, ()
        for fd in wake:
            os.close(fd)
        return self.first

    def _finished(self, rank: int) -> bool:
        folder = self.folder / f"rank{rank}"
        status = folder / "status"
        return (folder / "error.txt").exists() or (
            status.is_file() and status.read_text().strip() == "done")

    def run(self) -> None:
        host, watched, fds = socket.gethostname(), set(), {}
        try:
            while self.first is None and not self._done.is_set():
                for rank in set(range(self.num_ranks)) - watched:
                    try:
                        pid_text, _, where = (self.folder / f"rank{rank}" / "pid").read_text(
                        ).partition(" ")
                        pid = int(pid_text)
                    except (OSError, ValueError):  # not started, or half written
                        continue
                    if not where.strip():  # half written
                        continue
                    watched.add(rank)
                    if where.strip() != host:
                        continue  # another host: its processes are not ours to see
                    try:
                        fds[os.pidfd_open(pid)] = (rank, pid)
                    except ProcessLookupError:  # already gone
                        if not self._finished(rank):
                            self.first = (rank, pid)
                    except OSError:  # no pidfd on this kernel: mpiexec's word only
                        return
                # every rank seen: wait for an exit or the wake-up, else look again soon
                wait = None if len(watched) == self.num_ranks else self._POLL
                ready = select.select([*fds, self._wake[0]], [], [], wait)[0]
                for fd in ready:
                    if fd == self._wake[0]:
                        continue
                    rank, pid = fds.pop(fd)
                    os.close(fd)
                    if self.first is None and not self._finished(rank):
                        self.first = (rank, pid)
        finally:
            for fd in fds:
                os.close(fd)


def _pids(folder: Path, num_ranks: int) -> dict[int, int]:
    """pid -> rank, for the ranks that wrote their pid file."""
    pids = {}
    for rank in range(num_ranks):
        path = folder / f"rank{rank}" / "pid"
        try:
            pids[int(path.read_text().split()[0])] = rank
        except (OSError, ValueError, IndexError):
            continue
    return pids


def _unfinished(folder: Path, num_ranks: int) -> list[tuple[int, str, int]]:
    """The ranks busy at a timeout: (rank, last status, collectives entered in the call)."""
    out = []
    for rank in range(num_ranks):
        mine = folder / f"rank{rank}"
        status = mine / "status"
        state = status.read_text().strip() if status.is_file() else "not started"
        progress = mine / "progress"
        calls = int(np.fromfile(progress, dtype=np.int64)[0]) \
            if progress.is_file() and progress.stat().st_size >= 8 else 0
        if state not in ("ready", "done"):
            out.append((rank, state, calls))
    return out


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
