"""How much memory a host has for its ranks, and whether the kernel killed one for memory.

A host's memory is, in this order:

1. ``mem=SIZE`` on its hostfile line (``node0:2 mem=16G``, :func:`parse_size`), as the
   user gives it;
2. else the limit of the memory cgroup its remote shell runs in, if one is set: cgroup v1
   ``memory.stat``'s ``hierarchical_memory_limit`` (the smallest limit of the cgroup and
   its parents; ``memory.limit_in_bytes`` where the kernel has no such line) of the
   shell's own cgroup, read from ``/proc/self/cgroup``, or cgroup v2's smallest
   ``memory.max`` from the shell's cgroup up; no larger than what the host has free;
3. else ``MemAvailable`` of ``/proc/meminfo``.

This host is read directly; another host by one ``sh`` command over the remote shell
(:data:`PROBE`, no Python needed), all hosts at once. The same probe reports the host's
count of processes the kernel killed for memory (the cgroup's ``oom_kill`` count, or
``/proc/vmstat``'s when no cgroup limit is set): asked again after a rank died of
SIGKILL, a count that grew says it was the kernel, out of memory (:func:`oom_kills`).
"""

from __future__ import annotations

from dataclasses import dataclass
import logging
from pathlib import Path
import re
import subprocess
from typing import Sequence

from tvm_distx.errors import ArgumentError
from tvm_distx.hosts.rsh import run_on_hosts

__all__ = ["parse_size", "format_size", "HostMemory", "read_memory", "local_memory",
           "oom_kills", "PROBE"]

logger = logging.getLogger(__name__)

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(?:ib?|b)?", re.IGNORECASE)
#: A cgroup v1 limit at or above this is "no limit" (the kernel's is 2**63 rounded to pages).
_NO_LIMIT = 1 << 60


def parse_size(text: str) -> int:
    """Bytes from ``"800M"``, ``"16G"``, ``"1.5g"``, ``"4096"``: binary units (K is 1024).

    Raises
    ------
    ArgumentError
        For anything else, or a size of 0.
    """
    match = _SIZE.fullmatch(text.strip()) if isinstance(text, str) else None
    if match is None or float(match.group(1)) * _UNITS[match.group(2).lower()] < 1:
        raise ArgumentError(f"{text!r} is not a memory size",
                            hint="write bytes, or a number with K, M, G or T (binary units): "
                            "mem=800M, mem=16G")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_size(size: int) -> str:
    """``"800 MiB"``, ``"1.5 GiB"``, ``"512 B"``: at most one decimal."""
    for unit, name in ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if size >= unit:
            value = size / unit
            return f"{value:.0f} {name}" if value >= 100 or value == int(value) \
                else f"{value:.1f} {name}"
    return f"{size} B"


@dataclass(frozen=True)
class HostMemory:
    """What a host has for its ranks.

    Attributes
    ----------
    host : str
    bytes : int
        The memory its ranks may use.
    source : str
        Where the figure comes from: ``"mem="`` (the hostfile), ``"cgroup"`` (its memory
        cgroup's limit) or ``"available"`` (MemAvailable).
    oom_kills : int or None
        The kernel's count of processes killed for memory there (in the cgroup, or the
        whole host's), when it was read.
    """

    host: str
    bytes: int
    source: str
    oom_kills: int | None = None

    def describe(self) -> str:
        """``"800 MiB (its memory cgroup's limit)"``, ``"15.6 GiB available"``..."""
        size = format_size(self.bytes)
        return {"mem=": f"{size} (mem= of its hostfile line)",
                "cgroup": f"{size} (its memory cgroup's limit)"}.get(self.source,
                                                                    f"{size} available")


#: The ``sh`` that reads a host's memory: ``limit N``, ``available N``, ``oom_kills N`` lines.
PROBE = r"""
cg=$(sed -n 's/^[0-9]*:memory:\(.*\)$/\1/p' /proc/self/cgroup 2>/dev/null | head -n 1)
v1=/sys/fs/cgroup/memory$cg
if [ -n "$cg" ] && [ -r "$v1/memory.limit_in_bytes" ]; then
  lim=$(sed -n 's/^hierarchical_memory_limit //p' "$v1/memory.stat" 2>/dev/null)
  [ -n "$lim" ] || lim=$(cat "$v1/memory.limit_in_bytes")
  echo "limit $lim"
  sed -n 's/^oom_kill \([0-9]*\)$/cgroup_oom_kills \1/p' "$v1/memory.oom_control" 2>/dev/null
else
  cg2=$(sed -n 's/^0::\(.*\)$/\1/p' /proc/self/cgroup 2>/dev/null | head -n 1)
  d=/sys/fs/cgroup$cg2
  if [ -n "$cg2" ] && [ -r "$d/memory.max" ]; then
    sed -n 's/^oom_kill \([0-9]*\)$/cgroup_oom_kills \1/p' "$d/memory.events" 2>/dev/null
    while [ -r "$d/memory.max" ]; do
      echo "limit $(cat "$d/memory.max")"
      [ "$d" = /sys/fs/cgroup ] && break
      d=$(dirname "$d")
    done
  fi
fi
sed -n 's/^MemAvailable: *\([0-9]*\) kB$/available \1/p' /proc/meminfo
sed -n 's/^oom_kill \([0-9]*\)$/oom_kills \1/p' /proc/vmstat
"""


def _parse_probe(host: str, text: str) -> HostMemory | None:
    """The probe's reply as a HostMemory (None when it holds no figure)."""
    limits, available, kills, cgroup_kills = [], None, None, None
    for line in text.splitlines():
        key, _, value = line.strip().partition(" ")
        if not value.strip().isdigit():
            continue  # cgroup v2's "max": no limit
        number = int(value)
        if key == "limit" and number < _NO_LIMIT:
            limits.append(number)
        elif key == "available":
            available = number * 1024
        elif key == "oom_kills":
            kills = number
        elif key == "cgroup_oom_kills":
            cgroup_kills = number
    if limits and (available is None or min(limits) <= available):
        return HostMemory(host, min(limits), "cgroup",
                          cgroup_kills if cgroup_kills is not None else kills)
    if available is not None:
        return HostMemory(host, available, "available", kills)
    return None


def local_memory(host: str = "localhost") -> HostMemory:
    """This host's memory, read directly (the probe's rules, on this process's cgroup)."""
    lines = []
    try:
        cgroups = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        cgroups = []
    v1 = next((c.split(":", 2)[2] for c in cgroups if c.split(":")[1:2] == ["memory"]), None)
    v2 = next((c.split(":", 2)[2] for c in cgroups if c.startswith("0::")), None)
    base = Path("/sys/fs/cgroup/memory" + (v1 or ""))
    if v1 is not None and (base / "memory.limit_in_bytes").is_file():
        stat = _read(base / "memory.stat")
        found = re.search(r"^hierarchical_memory_limit (\d+)$", stat, re.M)
        lines.append(f"limit {found.group(1) if found else _read(base / 'memory.limit_in_bytes')}")
        lines += [f"cgroup_oom_kills {n}" for n in
                  re.findall(r"^oom_kill (\d+)$", _read(base / "memory.oom_control"), re.M)]
    elif v2 is not None and (Path("/sys/fs/cgroup" + v2) / "memory.max").is_file():
        here = Path("/sys/fs/cgroup" + v2)
        lines += [f"cgroup_oom_kills {n}" for n in
                  re.findall(r"^oom_kill (\d+)$", _read(here / "memory.events"), re.M)]
        while (here / "memory.max").is_file():
            lines.append(f"limit {_read(here / 'memory.max').strip()}")
            if here == Path("/sys/fs/cgroup"):
                break
            here = here.parent
    lines += [f"available {n}" for n in
              re.findall(r"^MemAvailable:\s*(\d+) kB$", _read(Path("/proc/meminfo")), re.M)]
    lines += [f"oom_kills {n}" for n in
              re.findall(r"^oom_kill (\d+)$", _read(Path("/proc/vmstat")), re.M)]
    found = _parse_probe(host, "\n".join(lines))
    return found if found is not None else HostMemory(host, 0, "available")


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def read_memory(hosts: Sequence, *, local: Sequence[str] = (), rsh=None,
                timeout: float = 20.0) -> dict[str, HostMemory]:
    """Each host's memory: its ``mem=``, else this host's (for names in ``local``) read
    directly, else read over the remote shell, all hosts at once (a host with ``mem=``
    too, for its count of processes killed for memory).

    Parameters
    ----------
    hosts : sequence of Host
        The hosts (:class:`~tvm_distx.hosts.hostfile.Host`), in order.
    local : sequence of str
        The names that are this host.
    rsh : str or sequence of str, optional
        The remote shell (:func:`~tvm_distx.hosts.rsh.remote_shell`).

    Raises
    ------
    DeployError
        For a host that does not answer, naming it.
    """
    out: dict[str, HostMemory] = {}
    ask = [h.name for h in hosts if h.name not in local]
    replies = run_on_hosts({h: ["sh", "-c", PROBE] for h in ask}, rsh=rsh,
                           timeout=timeout) if ask else {}
    for host in hosts:
        if host.name in local:
            found = local_memory(host.name)
        else:
            reply = replies[host.name].check()
            found = _parse_probe(host.name, reply.stdout)
            if found is None and host.mem is None:
                logger.warning("host %s: cannot read its memory (%s)", host.name,
                               reply.last_error_line or "no figure in /proc/meminfo")
                continue
        if host.mem is not None:  # the user's figure; the kernel's count of kills still read
            found = HostMemory(host.name, host.mem, "mem=", found.oom_kills if found else None)
        out[host.name] = found
    return out


def oom_kills(hosts: Sequence[str], *, local: Sequence[str] = (), rsh=None,
              timeout: float = 5.0) -> dict[str, HostMemory]:
    """Each host's memory and count of processes killed for memory, as it is now.

    A host that does not answer is left out (nothing is raised: this runs while a
    failure is being reported).
    """
    out = {h: local_memory(h) for h in hosts if h in local}
    ask = [h for h in hosts if h not in local]
    try:
        replies = run_on_hosts({h: ["sh", "-c", PROBE] for h in ask}, rsh=rsh,
                               timeout=timeout) if ask else {}
    except (OSError, ArgumentError, subprocess.SubprocessError) as err:
        logger.warning("cannot ask %s for their memory: %s", ", ".join(ask), err)
        return out
    for host, reply in replies.items():
        found = _parse_probe(host, reply.stdout) if reply.answered else None
        if found is not None:
            out[host] = found
    return out
