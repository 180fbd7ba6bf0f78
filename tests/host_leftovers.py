"""What a session across the test hosts could leave behind, for the fault tests (support module).

``nothing_left`` (a fixture; import it into the test module) snapshots, before the test, the
processes and session directories of every test host and of this machine, and asserts after it
that none were added: no rank, hydra proxy or session copy on any host, no ``mpiexec``, remote
shell or rank descending from this process here, and no ``tvm-distx-session-<this pid>-*``
directory in the temporary directory. Only what is new counts: sessions that fixtures keep
open, and other processes' sessions on this machine, are left out.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

#: Words of the command lines of a session's processes.
SESSION_WORDS = ("mpiexec", "mpi_rank", "hydra", "rsh", "tvm_distx")


def _ps() -> dict[int, tuple[int, str]]:
    """This machine's processes: pid -> (parent pid, command line)."""
    listing = subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True,
                             text=True).stdout
    found = {}
    for line in listing.splitlines():
        pid, ppid, args = (line.strip().split(None, 2) + [""])[:3]
        found[int(pid)] = (int(ppid), args)
    return found


def ours() -> set[str]:
    """mpiexec, its remote shells and ranks, here, that descend from this process."""
    table, me, found = _ps(), os.getpid(), set()
    for pid, (ppid, args) in table.items():
        up = ppid
        while up and up != me and up in table:
            up = table[up][0]
        if up == me and any(w in args for w in SESSION_WORDS):
            found.add(f"{pid} {args}")
    return found


def session_dirs() -> set[str]:
    """This process's session directories (other processes may run sessions meanwhile)."""
    mine = f"tvm-distx-session-{os.getpid()}-"
    return {p for p in os.listdir(tempfile.gettempdir()) if p.startswith(mine)}


def on_host(test_hosts, host: str) -> set[str]:
    """A session's processes on ``host`` and its copies in the host's /tmp."""
    left = {f"{pid} {cmd}" for pid, cmd in test_hosts.processes(host)
            if "tvm_distx" in cmd or "hydra" in cmd}
    copies = test_hosts.run(host, "ls /tmp").stdout.split()
    return left | {f"/tmp/{c}" for c in copies if c.startswith("tvm-distx-session-")}


def everything(test_hosts) -> dict[str, set[str]]:
    """{"here": processes, "dirs": session directories, host: its processes and copies}."""
    with ThreadPoolExecutor(len(test_hosts.names)) as pool:
        hosts = dict(zip(test_hosts.names,
                         pool.map(lambda h: on_host(test_hosts, h), test_hosts.names)))
    return {"here": ours(), "dirs": session_dirs(), **hosts}


def assert_nothing_new(test_hosts, before: dict[str, set[str]], within: float = 5.0) -> None:
    """Nothing that was not there ``before`` (waiting ``within`` s for the last exits)."""
    deadline = time.monotonic() + within
    while True:
        now = everything(test_hosts)
        new = {k: v - before[k] for k, v in now.items()}
        if not any(new.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert new == {k: set() for k in before}


@pytest.fixture
def nothing_left(test_hosts):
    """After the test, nothing new on any host nor here (see the module doc)."""
    before = everything(test_hosts)
    yield
    assert_nothing_new(test_hosts, before)
