"""The process table as the leftover checks of the fault tests read it (Linux ``/proc``)."""

from __future__ import annotations

import os
import signal
from pathlib import Path


def parents() -> dict[int, int]:
    """Every process of this host that can be read, mapped to its parent's id."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:  # gone meanwhile
            continue
        # the command name, in parentheses, may hold spaces: the fields follow the last ")"
        found[int(pid)] = int(stat.rsplit(")", 1)[1].split()[1])
    return found


def children() -> set[int]:
    """The processes this process started that still exist."""
    return {pid for pid, parent in parents().items() if parent == os.getpid()}


def with_default_ctrl_c() -> None:
    """``preexec_fn`` for a child that a test interrupts with SIGINT, as a user's Ctrl-C would.

    A suite started as a background job of a shell inherits SIGINT ignored, and so would
    the child; a user's terminal never starts the command that way.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)
