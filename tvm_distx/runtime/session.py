"""Persistent sessions: launch the ranks once, call them many times.

:func:`tvm_distx.runtime.launcher.launch` starts ``mpiexec``, loads every
weight and exits for each call: about a second before any compute, paid again
for every token a model generates. A session pays it once::

    with MPISession("bundle/") as session:         # mpiexec -n N ... once
        first = session.run(x)                      # milliseconds of overhead
        second = session.run(y)                     # the same processes, weights loaded

Each rank (:mod:`tvm_distx.runtime.session_worker`) checks the bundle, loads
its library and creates its virtual machine once, and loads its stored
weights the first time a function needs them. Calls and results move over a
Unix socket to rank 0 and over MPI between the ranks, never through files.
Inputs are checked against the function before they are sent
(:func:`tvm_distx.runtime.launcher.bind_inputs`), so a bad call leaves the
session usable.

Failures end the session and raise :class:`tvm_distx.LaunchError` naming the
rank: a rank that raises (its traceback), a rank that dies (``mpiexec``'s
report), a call that outlives its ``timeout``. Ctrl-C and any other exception
in the caller close the session too. Closing ends ``mpiexec`` and everything
it started (its own process group), removes the session directory and the
shared-memory segments MPICH left behind; a closed session refuses calls.
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Mapping, Sequence

from tvm_distx.errors import ArgumentError, LaunchError
from tvm_distx.runtime.launcher import (_BAD_EXIT, _remove_new_segments, _segments, _stop,
                                        mpiexec_path)
from tvm_distx.runtime.rank_env import rank_environment
from tvm_distx.runtime.session_base import Call, RankProcess, Session
from tvm_distx.runtime.session_worker import receive_message, send_message

__all__ = ["MPISession", "RankProcess"]

logger = logging.getLogger(__name__)


class MPISession(Session):
    """A bundle's ranks under ``mpiexec``, launched once and called many times.

    Parameters
    ----------
    bundle : path
        A directory written by :meth:`tvm_distx.DistExecutable.export`.
    num_ranks : int, optional
        Must equal the bundle's rank count when given.
    timeout : float
        Seconds the ranks may take to start, and each call by default.
    hosts : sequence of str, optional
        Hosts for ``mpiexec -hosts``, this host first: rank 0 talks to this
        process over a local socket; the ranks on other hosts reach it over MPI.
    mpiexec : str, optional
        The ``mpiexec`` executable (default: the ``mpich`` wheel's).
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
    tvm_distx.runtime.session_base.Session : :meth:`run`, :meth:`close` and the
        attributes every session has.
    """

    backend = "mpi"

    def __init__(self, bundle: str | os.PathLike, *, num_ranks: int | None = None,
                 timeout: float = 300.0, hosts: Sequence[str] | None = None,
                 mpiexec: str | None = None, env: Mapping[str, str] | None = None) -> None:
        super().__init__(bundle, num_ranks=num_ranks, timeout=timeout)
        if hosts and hosts[0] not in _this_host():
            raise ArgumentError(
                f"rank 0 would run on {hosts[0]}, but it talks to this process over a "
                f"local socket, so it must run here ({socket.gethostname()})",
                hint=f"list this host first: hosts=['{socket.gethostname()}', ...]")
        self._conn: socket.socket | None = None
        self._dir = Path(tempfile.mkdtemp(prefix="tvm-distx-session-"))
        self._log = self._dir / "mpiexec.log"
        self._segments = _segments()
        address = str(self._dir / "control.sock")
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(address)
        server.listen(1)
        command = [mpiexec or mpiexec_path(), "-n", str(self.manifest.num_ranks)]
        if hosts:
            command += ["-hosts", ",".join(hosts)]
        command += [sys.executable, "-m", "tvm_distx.runtime.session_worker",
                    str(self.manifest.root.resolve()), address, str(self._dir)]
        logger.info("session: launching %s", " ".join(command))
        started = time.monotonic()
        with open(self._log, "wb") as log:
            self._proc = subprocess.Popen(command, env=rank_environment(os.environ, env),
                                          stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)
        self._closed = False
        try:
            self._conn = self._accept(server, started + timeout)
            reply = self._receive(started + timeout, "starting")
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
        send_message(self._conn, ("run", *call))
        reply = self._receive(time.monotonic() + timeout, f"running '{call.function}'")
        return reply[1], reply[2]

    def close(self) -> None:
        """Stop the ranks and clean up; a second call does nothing."""
        if self._closed:
            return
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
        if failed:
            _remove_new_segments(self._segments)
        shutil.rmtree(self._dir, ignore_errors=True)

    def _accept(self, server: socket.socket, deadline: float) -> socket.socket:
        while True:
            ready, _, _ = select.select([server], [], [], 0.2)
            if ready:
                return server.accept()[0]
            self._check_alive("starting")
            if time.monotonic() > deadline:
                raise LaunchError(f"the session's ranks did not start within {self.timeout} s",
                                  hint="raise timeout=, or look for a rank stuck loading")

    def _receive(self, deadline: float, doing: str):
        while True:
            ready, _, _ = select.select([self._conn], [], [], 0.2)
            if ready:
                reply = receive_message(self._conn)
                if reply is None:
                    self._proc.wait(timeout=30)
                    raise self._failure(doing)
                return reply
            self._check_alive(doing)
            if time.monotonic() > deadline:
                raise LaunchError(f"the session timed out {doing}",
                                  hint="raise timeout=, or look for a rank that never reached "
                                  "a collective the others wait in")

    def _check_alive(self, doing: str) -> None:
        if self._proc.poll() is not None:
            raise self._failure(doing)

    def _failure(self, doing: str) -> LaunchError:
        """The error that names the rank that ended the session."""
        for rank in range(self.manifest.num_ranks):
            error = self._dir / f"rank{rank}.error"
            if error.is_file():
                text = error.read_text(errors="replace").strip().splitlines()
                return LaunchError(f"rank {rank} failed {doing}: {text[-1] if text else ''}",
                                   hint="the session is closed; its traceback was:\n"
                                   + "\n".join(text[-12:]))
        log = self._log.read_text(errors="replace") if self._log.is_file() else ""
        pids = {p.pid: p.rank for p in self.ranks}
        for match in _BAD_EXIT.finditer(log):
            pid, code = int(match.group(1)), int(match.group(2))
            if pid in pids and code not in (0,):
                return LaunchError(f"rank {pids[pid]} died {doing} (exit code {code})",
                                   hint="the session is closed; open a new one")
        for pid, rank in pids.items():
            if not _alive(pid):
                return LaunchError(f"rank {rank} died {doing}",
                                   hint="the session is closed; open a new one")
        return LaunchError(f"the session's ranks stopped {doing} (mpiexec exit code "
                           f"{self._proc.returncode})", hint="the session is closed; its log "
                           "ended with:\n" + "\n".join(log.strip().splitlines()[-8:]))


def _this_host() -> set[str]:
    """The names this host answers to."""
    names = {"localhost", "127.0.0.1", socket.gethostname(), socket.getfqdn()}
    return names | {name.split(".")[0] for name in names}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
