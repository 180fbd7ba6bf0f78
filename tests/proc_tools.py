"""The process table as the leftover checks of the fault tests read it (Linux ``/proc``)."""

from __future__ import annotations

import os
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
