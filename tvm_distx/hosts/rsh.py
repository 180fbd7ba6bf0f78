"""The one remote shell: how everything reaches another host.

Deploying, checking a deployed copy, ``mpiexec``'s process launcher and the
clean-up after a run all use one program, called as ssh is::

    PROGRAM [options] HOST COMMAND

It is ``rsh=`` (``--rsh`` on the command line), else the environment variable
``TVM_DISTX_RSH``, else ``ssh``; a string is split as a shell would
(``"ssh -p 2222"``). For ``mpiexec`` it is hydra's ``-launcher ssh
-launcher-exec PROGRAM``.

The command goes to the host as one string, which the host's shell runs
(``sh -c``, as ssh does): :func:`remote_argv` quotes each argument for it, so
paths with blanks or quotes arrive as they were.

When the program is ``ssh`` itself, :func:`run_on_hosts` adds ``-o
ConnectTimeout=<timeout> -o BatchMode=yes``: a host that does not answer fails
within the timeout, and ssh never stops to ask for a password (the ranks could
not either; set up keys, see the "Across machines" guide). Other programs get
no options.

A host "does not answer" when the program exits with 255 (ssh's status for
its own failures: no route, refused, unknown host, denied) or gives no reply
within the timeout; the error is one line naming the host and the last line
the program wrote on stderr.
"""

from __future__ import annotations

from dataclasses import dataclass
import logging
import math
import os
from pathlib import Path
import shlex
import signal
import subprocess
import threading
import time
from typing import BinaryIO, Callable, Mapping, Sequence

from tvm_distx.errors import ArgumentError, ArgumentTypeError, DeployError

__all__ = ["RSH_ENV", "DEFAULT_TIMEOUT", "remote_shell", "remote_argv", "connect_options",
           "RemoteResult", "run_on_hosts"]

logger = logging.getLogger(__name__)

#: The environment variable that names the remote shell when ``rsh=`` is not given.
RSH_ENV = "TVM_DISTX_RSH"
#: Seconds a host has to answer (to connect, or to make progress while fed).
DEFAULT_TIMEOUT = 20.0
#: ssh's exit status for its own failures (connection, authentication).
UNREACHABLE = 255


def remote_shell(rsh: str | Sequence[str] | None = None) -> tuple[str, ...]:
    """The remote shell's argv: ``rsh``, else ``$TVM_DISTX_RSH``, else ``("ssh",)``.

    Parameters
    ----------
    rsh : str or sequence of str, optional
        A program, with options (``"ssh -p 2222"``, split as a shell would), or
        its argv.

    Raises
    ------
    ArgumentError
        For an empty program, or a string a shell could not split.
    """
    where = "rsh="
    if rsh is None:
        rsh = os.environ.get(RSH_ENV) or "ssh"
        where = RSH_ENV
    if isinstance(rsh, str):
        try:
            argv = tuple(shlex.split(rsh))
        except ValueError as err:
            raise ArgumentError(f"{where} {rsh!r} cannot be split into words ({err})",
                                hint="quote the program as a shell would: \"ssh -p 2222\"") \
                from None
    elif isinstance(rsh, Sequence) and all(isinstance(a, str) for a in rsh):
        argv = tuple(rsh)
    else:
        raise ArgumentTypeError(f"{where} is a {type(rsh).__name__}, not a str or a list of str",
                                hint='rsh="ssh -p 2222" or rsh=["ssh", "-p", "2222"]')
    if not argv or not argv[0]:
        raise ArgumentError(f"{where} names no program", hint='rsh="ssh" (the default)',
                            cli_hint="--rsh ssh (the default)")
    return argv


def remote_argv(shell: Sequence[str], host: str, argv: Sequence[str]) -> list[str]:
    """``[*shell, host, COMMAND]``: ``argv`` quoted into one command for the host's shell."""
    return [*shell, host, " ".join(shlex.quote(str(a)) for a in argv)]


def connect_options(shell: Sequence[str], timeout: float | None) -> tuple[str, ...]:
    """``shell`` with ssh's connect timeout and batch mode, when the program is ``ssh``."""
    shell = tuple(shell)
    if Path(shell[0]).name != "ssh":
        return shell
    options = ("-o", "BatchMode=yes")
    if timeout is not None:
        options = ("-o", f"ConnectTimeout={max(1, math.ceil(timeout))}") + options
    return (shell[0], *options, *shell[1:])


@dataclass(frozen=True)
class RemoteResult:
    """What a command on one host gave.

    Attributes
    ----------
    host : str
    returncode : int or None
        Its exit status; None when it gave no reply within the timeout (it was
        killed).
    stdout, stderr : str
    timeout : float or None
        The timeout it ran under.
    """

    host: str
    returncode: int | None
    stdout: str
    stderr: str
    timeout: float | None = None

    @property
    def answered(self) -> bool:
        """Whether the host answered (the program neither timed out nor exited with 255)."""
        return self.returncode is not None and self.returncode != UNREACHABLE

    @property
    def last_error_line(self) -> str:
        """The last non-blank line of stderr ("" for none)."""
        lines = [line.strip() for line in self.stderr.splitlines() if line.strip()]
        return lines[-1] if lines else ""

    def unreachable(self, hint: str | None = None, cli_hint: str | None = None) -> DeployError:
        """The one-line error for a host that did not answer."""
        why = self.last_error_line
        if self.returncode is None:
            why = why or f"no reply within {self.timeout:g} s"
        else:
            why = why or f"the remote shell exited with {self.returncode} and said nothing"
        return DeployError(f"host {self.host} does not answer: {why}", host=self.host,
                           reason="unreachable",
                           hint=hint or f"check that {self.host} is up and that rsh= (or "
                           f"{RSH_ENV}) reaches it without a password (ssh keys)",
                           cli_hint=cli_hint or f"check that {self.host} is up and that --rsh "
                           f"(or {RSH_ENV}) reaches it without a password (ssh keys)")

    def check(self) -> "RemoteResult":
        """``self``; raises :meth:`unreachable` when the host did not answer."""
        if not self.answered:
            raise self.unreachable()
        return self


class _Watched:
    """A pipe that records when it last took bytes (for a stall timeout)."""

    def __init__(self, pipe: BinaryIO) -> None:
        self.pipe = pipe
        self.last = time.monotonic()

    def write(self, data) -> int:
        written = self.pipe.write(data)
        self.last = time.monotonic()
        return written if written is not None else len(data)

    def flush(self) -> None:
        self.pipe.flush()


def _kill(proc: subprocess.Popen) -> None:
    """Kill ``proc`` and what it started (its own process group)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _run_one(argv: list[str], host: str, timeout: float | None,
             feed: Callable[[BinaryIO], None] | None, procs: list, errors: dict) -> RemoteResult:
    """Run one remote command; ``feed`` writes its stdin (the timeout then counts stalls)."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE if feed else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    procs.append(proc)
    out: dict[str, bytes] = {}
    readers = [threading.Thread(target=lambda n=n, s=s: out.__setitem__(n, s.read()), daemon=True)
               for n, s in (("stdout", proc.stdout), ("stderr", proc.stderr))]
    for r in readers:
        r.start()
    timed_out = threading.Event()
    start = time.monotonic()
    pipe = _Watched(proc.stdin) if feed else None

    def watchdog() -> None:
        while proc.poll() is None:
            since = pipe.last if pipe is not None else start
            if timeout is not None and time.monotonic() - since > timeout:
                timed_out.set()
                _kill(proc)
                return
            time.sleep(0.05)

    dog = threading.Thread(target=watchdog, daemon=True)
    dog.start()
    if feed is not None:
        try:
            feed(pipe)
        except (BrokenPipeError, ValueError):
            pass  # the remote side went away: its status and stderr say why
        except BaseException as err:  # a local failure (a checkpoint unreadable): stop the host
            errors[host] = err
            _kill(proc)
        finally:
            try:
                proc.stdin.close()
            except (BrokenPipeError, OSError):
                pass
            pipe.last = time.monotonic()  # the reply, from here on, has its own timeout
    proc.wait()
    dog.join()
    for r in readers:
        r.join()
    code = None if timed_out.is_set() else proc.returncode
    return RemoteResult(host, code, out.get("stdout", b"").decode(errors="replace"),
                        out.get("stderr", b"").decode(errors="replace"), timeout)


def run_on_hosts(commands: Mapping[str, Sequence[str]], *, rsh: str | Sequence[str] | None = None,
                 timeout: float | None = DEFAULT_TIMEOUT,
                 feeds: Mapping[str, Callable[[BinaryIO], None]] | None = None
                 ) -> dict[str, RemoteResult]:
    """Run a command on each host through the remote shell, all hosts at once.

    Parameters
    ----------
    commands : mapping of str to sequence of str
        Per host, the command's argv (quoted for the host's shell here).
    rsh : str or sequence of str, optional
        The remote shell (:func:`remote_shell`).
    timeout : float or None
        Seconds a host has to finish; for a fed command, seconds it may go
        without taking input, and then to finish once all input is sent.
    feeds : mapping of str to callable, optional
        Per host, a function that writes the command's stdin (a binary
        stream); the stream is closed after it returns.

    Returns
    -------
    dict of str to RemoteResult
        Per host, in the order of ``commands``. A host that did not answer is
        in it too (see :attr:`RemoteResult.answered`); nothing is raised for it.

    Raises
    ------
    Exception
        What a feed raised (on this side), after every host is done.
    """
    shell = connect_options(remote_shell(rsh), timeout)
    procs: list[subprocess.Popen] = []
    errors: dict[str, BaseException] = {}
    results: dict[str, RemoteResult] = {}

    def one(host: str) -> None:
        argv = remote_argv(shell, host, commands[host])
        logger.debug("on %s: %s", host, shlex.join(argv))
        try:
            results[host] = _run_one(argv, host, timeout, (feeds or {}).get(host), procs, errors)
        except OSError as err:  # the program itself cannot start
            errors[host] = ArgumentError(f"cannot start the remote shell {shell[0]!r}: "
                                         f"{err.strerror}",
                                         hint=f"install it, or name another with rsh= or "
                                         f"{RSH_ENV}", cli_hint=f"install it, or name another "
                                         f"with --rsh or {RSH_ENV}")
        except BaseException as err:  # noqa: BLE001 - re-raised below, in the caller's thread
            errors[host] = err

    threads = [threading.Thread(target=one, args=(h,), name=f"rsh-{h}", daemon=True)
               for h in commands]
    try:
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(0.1)
    finally:  # interrupted: no remote shell outlives the call
        for proc in procs:
            _kill(proc)
    for host in commands:
        if host in errors:
            raise errors[host]
    return {h: results[h] for h in commands}
