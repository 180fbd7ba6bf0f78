"""Test hosts for the tests: ``scripts/testhosts`` from pytest (support module).

The session fixture ``test_hosts`` (registered for every test by ``tests/conftest.py``) brings
up three hosts once per session and down at its end; ``hosts_up(n)`` does the same for a
``with`` block. The hosts are network, UTS, mount, IPC and PID namespaces on this machine
(docs/testhosts.md), reached with the remote shell ``hosts.rsh``, which is called like ssh::

    def test_two_hosts(test_hosts):
        a, b = test_hosts.names[:2]
        assert test_hosts.run(a, "hostname").stdout.strip() == a
        launcher = ["-launcher", "ssh", "-launcher-exec", test_hosts.rsh]

Each session takes its own id (a lock file per id), so suites running side by side on one
machine get distinct names, subnets and bridges; a session that died without cleaning up is
cleaned by the next one. The hosts need root and ``ip netns``: without them the fixture fails
(it never skips).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from locations import REPO_ROOT

#: The script that makes and removes the hosts.
SCRIPT = REPO_ROOT / "scripts" / "testhosts"
#: The ids the test sessions take (users keep 0 and the small ones for themselves).
SESSION_IDS = range(100, 200)
#: One lock file per id, held while a session uses it.
LOCKS = Path("/run/lock")


def script(*args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run ``scripts/testhosts ARGS``; a failure fails the test with the script's message."""
    done = subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        pytest.fail(f"scripts/testhosts {shlex.join(args)} failed ({done.returncode}): "
                    f"{done.stderr.strip() or done.stdout.strip()}", pytrace=False)
    return done


@dataclass
class NamespaceHosts:
    """Hosts that ``scripts/testhosts up`` made, as the tests use them.

    Attributes
    ----------
    id : int
        The id (``--id``): the hosts' subnet is ``10.231.<id>.0/24``.
    names : tuple of str
        The hosts' names (and hostnames), e.g. ``("k100t1", "k100t2", "k100t3")``.
    rsh : str
        The remote shell, called like ssh: ``[rsh, host, command]``, or for mpiexec
        ``-launcher ssh -launcher-exec <rsh>``.
    deploy_root : str
        A directory that each host has on its own (empty on this machine).
    shared : Path
        A directory that this machine and every host see alike (the hosts' /tmp, and so
        pytest's ``tmp_path``, is private to each).
    caller : str
        This machine's hostname, which the hosts resolve to ``caller_address``.
    caller_address : str
        This machine's address on the hosts' bridge.
    addresses : dict
        Each host's address.
    """

    __test__ = False  # not a test class

    id: int
    names: tuple[str, ...]
    rsh: str
    deploy_root: str
    shared: Path
    caller: str
    caller_address: str
    addresses: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, k: int) -> NamespaceHosts:
        """The hosts of id ``k``, from ``scripts/testhosts env``."""
        values = dict(shlex.split(line)[0].split("=", 1)
                      for line in script("env", f"--id={k}").stdout.splitlines())
        return cls(id=k, names=tuple(values["TESTHOSTS_NAMES"].split(",")),
                   rsh=values["TESTHOSTS_RSH"], deploy_root=values["TESTHOSTS_DEPLOY"],
                   shared=Path(values["TESTHOSTS_SHARED"]), caller=values["TESTHOSTS_CALLER"],
                   caller_address=values["TESTHOSTS_CALLER_ADDR"],
                   addresses=dict(pair.split("=", 1)
                                  for pair in values["TESTHOSTS_ADDRS"].split(",")))

    def run(self, host: str, command: str | Sequence[str], *, check: bool = True,
            input: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
        """Run ``command`` on ``host`` through the remote shell (text output captured).

        A string is a shell command; a sequence is quoted word by word. With ``check``, a
        non-zero exit status fails the test with the command's stderr.
        """
        line = command if isinstance(command, str) else shlex.join(command)
        done = subprocess.run([self.rsh, host, line], capture_output=True, text=True,
                              input=input, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"on {host}: {line!r} exited {done.returncode}: "
                                 f"{done.stderr.strip()}")
        return done

    def processes(self, host: str) -> list[tuple[int, str]]:
        """The processes of ``host`` other than its init: (pid on this machine, command line)."""
        found = []
        for line in script("ps", host).stdout.splitlines():
            pid, _, command = line.partition(" ")
            found.append((int(pid), command))
        return found

    def link(self, host: str, up: bool) -> None:
        """Plug (``up=True``) or unplug ``host``'s network cable."""
        script("link", host, "up" if up else "down")

    def kill(self, host: str) -> None:
        """Kill every process of ``host`` (its init, and so the host, stays)."""
        script("kill", host)

    def hostfile(self, path: str | os.PathLike, slots: Sequence[int] | None = None,
                 hosts: Sequence[str] | None = None) -> Path:
        """Write an MPICH hostfile (``host:slots`` per line) of ``hosts`` (default all)."""
        names = list(hosts or self.names)
        counts = list(slots or [1] * len(names))
        if len(counts) != len(names):
            raise AssertionError(f"{len(counts)} slot counts for {len(names)} hosts")
        path = Path(path)
        path.write_text("".join(f"{n}:{c}\n" for n, c in zip(names, counts)))
        return path

    def launcher(self) -> list[str]:
        """mpiexec's options that start its proxies on these hosts (hydra's ssh launcher)."""
        return ["-launcher", "ssh", "-launcher-exec", self.rsh]


@contextlib.contextmanager
def free_id() -> Iterator[int]:
    """An id that no other session uses, reserved for the ``with`` block (a lock file).

    Ids whose session died without ``down`` are cleaned on the way.
    """
    k, lock = _take_id()
    try:
        yield k
    finally:
        os.close(lock)


def _take_id() -> tuple[int, int]:
    """(id, fd of its lock): the first free id; ids whose session died are cleaned first."""
    LOCKS.mkdir(parents=True, exist_ok=True)
    for k in SESSION_IDS:
        if Path(f"/run/tvm-distx-testhosts/{k}").exists():
            lock = _lock(k)
            if lock is not None:  # hosts without a session: it died before its `down`
                script("down", f"--id={k}")
                os.close(lock)
    for k in SESSION_IDS:
        lock = _lock(k)
        if lock is not None:
            return k, lock
    pytest.fail(f"every test-host id in {SESSION_IDS} is taken by a running session")


def _lock(k: int) -> int | None:
    """The fd of id ``k``'s lock file, locked; None when another session holds it."""
    fd = os.open(LOCKS / f"tvm-distx-testhosts-{k}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def python_paths() -> list[str]:
    """The Python that runs the tests (its virtual environment and its base installation): the
    hosts see them at the same paths, wherever they are (``testhosts up --share``)."""
    return list(dict.fromkeys([sys.prefix, sys.base_prefix]))


@contextlib.contextmanager
def hosts_up(n: int = 3, root: Path | None = None,
             mem: str | None = None) -> Iterator[NamespaceHosts]:
    """``n`` test hosts for the ``with`` block: down at its end, at exit, on Ctrl-C, on error.

    With ``mem`` (``"200M"``), each host and all its remote shell starts is under a memory
    cgroup of that limit (``testhosts up --mem``).

    With ``root`` (a board's root file system, ``scripts/rvv-board``), the hosts are emulated
    RISC-V boards: the remote shell runs commands inside the board. The hosts see the
    checkout and the Python that runs the tests at the same paths (:func:`python_paths`).
    """
    if os.geteuid() != 0:
        pytest.fail("the test hosts need root (network namespaces): run the suite as root",
                    pytrace=False)
    with free_id() as k:
        def down() -> None:  # at exit, if the with block never ends (a fixture's teardown)
            script("down", f"--id={k}", check=False)

        atexit.register(down)
        try:
            script("down", f"--id={k}")  # whatever an earlier run crashed out of
            script("up", str(n), f"--id={k}", *(["--root", str(root)] if root else []),
                   *([f"--mem={mem}"] if mem else []),
                   *[f"--share={path}" for path in python_paths()])
            yield NamespaceHosts.of(k)
        finally:
            atexit.unregister(down)
            script("down", f"--id={k}")


@pytest.fixture(scope="session", name="test_hosts")
def test_hosts_fixture() -> Iterator[NamespaceHosts]:
    """Three test hosts for the whole session (:class:`NamespaceHosts`)."""
    with hosts_up(3) as hosts:
        yield hosts
