"""Hosts as users write them, and which ranks run on each.

A hostfile is MPICH's: one ``host[:slots]`` per line, ``#`` starting a comment
anywhere on a line, blank lines ignored; Open MPI's ``host slots=N`` is read too::

    # two ranks on node0, one on node1
    node0:2
    node1      # slots default to 1

A line may give the host's memory after a blank, ``mem=SIZE`` (``800M``, ``16G``:
binary units, :func:`~tvm_distx.hosts.memory.parse_size`): ``node0:2 mem=16G``,
``node1 slots=2 mem=8G``. Without it, the host's memory is read over the remote
shell before a launch (:mod:`tvm_distx.hosts.memory`).

The one-line form is the same list with commas: ``"node0:2,node1"``, ``"node0:2
mem=16G,node1"`` (the command line's ``--hosts``, ``HOSTS=`` of a bundle's ``run.sh``).

Ranks are placed in hostfile order, filling each host's slots: above, ranks 0
and 1 run on node0 and rank 2 on node1 (:func:`place_ranks`). The slots must
add up to the program's rank count exactly.

A host listed on consecutive lines is one host with the slots of all those
lines (``node0`` twice is ``node0:2``), as MPICH's hydra reads it. A host listed
again after another host is refused: hydra would place ranks round-robin over
such a list, interleaving a host's ranks with another's, while a deployed copy
holds one block of ranks per host; write the host once with all its slots.

Everything here is plain data: no TVM, no process.
"""

from __future__ import annotations

from dataclasses import dataclass
import os
from pathlib import Path
import re
from typing import Iterable, Sequence

from tvm_distx.errors import ArgumentError, ArgumentIndexError, ArgumentKeyError, ArgumentTypeError
from tvm_distx.hosts.memory import format_size, parse_size

__all__ = ["Host", "read_hostfile", "parse_hosts", "hosts_from", "RankPlacement", "place_ranks"]

#: A host name: a DNS name or address, optionally user@ (no ':', ',', blanks; no leading '-').
_NAME = re.compile(r"[A-Za-z0-9_.@][A-Za-z0-9_.@-]*")


@dataclass(frozen=True)
class Host:
    """One host and how many ranks it runs.

    Parameters
    ----------
    name : str
        The host as the remote shell and ``mpiexec`` reach it (``node0``,
        ``10.0.0.5``).
    slots : int
        How many ranks run on it (at least 1).
    mem : int, optional
        The bytes of memory its ranks may use (``mem=`` of its line); None: read
        from the host before a launch.

    Raises
    ------
    ArgumentError
        For an empty name, a name with a ``:``, ``,``, blank or a leading ``-``,
        slots below 1, or a memory below 1 byte.
    """

    name: str
    slots: int = 1
    mem: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ArgumentTypeError(f"a host name is a str, got {type(self.name).__name__}",
                                    hint='Host("node0", slots=2)')
        if isinstance(self.slots, bool) or not isinstance(self.slots, int):
            raise ArgumentTypeError(f"host {self.name!r}: slots is an int, got "
                                    f"{type(self.slots).__name__}", hint='Host("node0", slots=2)')
        if not _NAME.fullmatch(self.name):
            raise ArgumentError(f"{self.name!r} is not a host name",
                                hint="a host is a name or address, without blanks, ',' or ':' "
                                "and not starting with '-'; slots go after a ':' (node0:2)")
        if self.slots < 1:
            raise ArgumentError(f"host {self.name} has {self.slots} slots",
                                hint="give each host at least 1 slot, or leave it out")
        if self.mem is not None and (isinstance(self.mem, bool) or not isinstance(self.mem, int)
                                     or self.mem < 1):
            raise ArgumentError(f"host {self.name}: mem is a positive number of bytes, got "
                                f"{self.mem!r}", hint='Host("node0", slots=2, mem=16 << 30)')

    def __str__(self) -> str:
        return f"{self.name}:{self.slots}"

    def describe(self) -> str:
        """``node0:2 mem=16 GiB`` (the slots, and the memory when given)."""
        return str(self) + (f" mem={format_size(self.mem)}" if self.mem is not None else "")


#: The forms of a hostfile line, in the hint of an error.
_FORMS = "host[:slots] [mem=SIZE] or host slots=N [mem=SIZE], for example node0:2 mem=16G"


def _parse_entry(text: str, where: str) -> Host:
    """``host[:slots] [slots=N] [mem=SIZE]`` as a Host; errors name ``where`` and the text."""
    first, *options = text.split()
    name, sep, slots = first.partition(":")
    count, mem = None, None
    if sep:
        try:
            count = int(slots)
        except ValueError:
            raise ArgumentError(f"{where}: {text!r}: the slots after ':' are not a number",
                                hint=f"write {_FORMS}") from None
    for option in options:
        key, eq, value = option.partition("=")
        key = key.lower()
        if not eq or key not in ("slots", "mem") or (key == "slots" and count is not None) \
                or (key == "mem" and mem is not None):
            said = "gives the slots twice" if key == "slots" and eq and count is not None \
                else "gives mem= twice" if key == "mem" and eq and mem is not None \
                else f"{option!r} is neither slots=N nor mem=SIZE"
            raise ArgumentError(f"{where}: {text!r}: {said}", hint=f"write {_FORMS}")
        if key == "slots":
            try:
                count = int(value)
            except ValueError:
                raise ArgumentError(f"{where}: {text!r}: slots={value} is not a number",
                                    hint=f"write {_FORMS}") from None
        else:
            try:
                mem = parse_size(value)
            except ArgumentError:
                raise ArgumentError(f"{where}: {text!r}: mem={value} is not a memory size",
                                    hint="write bytes, or a number with K, M, G or T (binary "
                                    "units): mem=800M, mem=16G") from None
    try:
        return Host(name, 1 if count is None else count, mem)
    except ArgumentError as err:
        said = err.message if err.message.startswith(repr(text)) else f"{text!r}: {err.message}"
        raise ArgumentError(f"{where}: {said}", hint=err.hint) from None


def _merged(entries: Iterable[tuple[Host, str]]) -> tuple[Host, ...]:
    """Consecutive entries of one host merged; a host listed again later refused."""
    hosts: list[Host] = []
    first: dict[str, str] = {}
    for host, where in entries:
        if hosts and hosts[-1].name == host.name:
            mems = {m for m in (hosts[-1].mem, host.mem) if m is not None}
            if len(mems) > 1:
                raise ArgumentError(f"{where}: host {host.name} is given two memories "
                                    f"({', '.join(map(format_size, sorted(mems)))})",
                                    hint="give its mem= once, on one of its lines")
            hosts[-1] = Host(host.name, hosts[-1].slots + host.slots, next(iter(mems), None))
            continue
        if host.name in first:
            raise ArgumentError(
                f"{where}: host {host.name} is listed again, after other hosts (first at "
                f"{first[host.name]})",
                hint=f"list each host once, with all its slots ({host.name}:N): ranks are "
                "placed in order, filling each host's slots")
        first[host.name] = where
        hosts.append(host)
    return tuple(hosts)


def read_hostfile(path: str | os.PathLike) -> tuple[Host, ...]:
    """The hosts of an MPICH-style hostfile (see the module documentation).

    Raises
    ------
    ArgumentError
        If the file cannot be read, holds no host, or a line is not
        ``host[:slots] [mem=SIZE]`` or ``host slots=N [mem=SIZE]`` (the error names
        ``file:line`` and the text).
    """
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) else "it is not a text file"
        raise ArgumentError(f"cannot read the hostfile {path}: {reason}",
                            hint="give a text file with one host[:slots] [mem=SIZE] per line") \
            from None
    entries = []
    for number, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        where = f"{path}:{number}"
        entries.append((_parse_entry(text, where), where))
    hosts = _merged(entries)
    if not hosts:
        raise ArgumentError(f"the hostfile {path} names no host",
                            hint="write one host[:slots] per line")
    return hosts


def parse_hosts(spec: str | Sequence[str | Host]) -> tuple[Host, ...]:
    """Hosts from ``"a:2,b"`` or ``["a:2", "b"]`` (or :class:`Host` objects).

    Raises
    ------
    ArgumentError
        For an empty list or an entry that is not ``host[:slots]``.
    """
    if isinstance(spec, str):
        items: list = [s.strip() for s in spec.split(",")]
        if any(not s for s in items):
            raise ArgumentError(f"hosts {spec!r} have an empty entry",
                                hint="write hosts as a:2,b (host[:slots] [mem=SIZE], "
                                "comma-separated)")
    elif isinstance(spec, Sequence):
        items = list(spec)
    else:
        raise ArgumentTypeError(f"hosts are a str or a list, got {type(spec).__name__}",
                                hint='hosts=["node0:2", "node1"] or hosts="node0:2,node1"')
    entries = []
    for index, item in enumerate(items):
        where = f"host {index}"
        if isinstance(item, Host):
            entries.append((item, where))
        elif isinstance(item, str):
            entries.append((_parse_entry(item.strip(), where), where))
        else:
            raise ArgumentTypeError(f"{where} is a {type(item).__name__}, not a str",
                                    hint='hosts=["node0:2", "node1"]')
    hosts = _merged(entries)
    if not hosts:
        raise ArgumentError("the list of hosts is empty", hint='hosts=["node0:2", "node1"]')
    return hosts


def hosts_from(hosts: str | Sequence[str | Host] | None = None,
               hostfile: str | os.PathLike | None = None) -> tuple[Host, ...] | None:
    """The hosts given as ``hosts=`` or ``hostfile=`` (None when neither is given).

    Raises
    ------
    ArgumentError
        If both are given, or either is malformed.
    """
    if hosts is not None and hostfile is not None:
        raise ArgumentError("both hosts= and hostfile= are given",
                            hint="give the hosts once: hosts=[...] or hostfile=PATH",
                            cli_hint="give the hosts once: --hosts a:2,b or --hostfile FILE")
    if hostfile is not None:
        return read_hostfile(hostfile)
    if hosts is not None:
        return parse_hosts(hosts)
    return None


@dataclass(frozen=True)
class RankPlacement:
    """Which ranks run on which host: in host order, each host's slots filled in turn.

    Build it with :func:`place_ranks`, which checks the slots against the rank
    count. Frozen and hashable, so it can key a cache.

    Attributes
    ----------
    hosts : tuple of Host
        The hosts, in order, each with as many slots as ranks it runs.
    """

    hosts: tuple[Host, ...]

    @property
    def num_ranks(self) -> int:
        """The rank count: the sum of the slots."""
        return sum(h.slots for h in self.hosts)

    @property
    def names(self) -> tuple[str, ...]:
        """The host names, in order."""
        return tuple(h.name for h in self.hosts)

    @property
    def by_host(self) -> dict[str, tuple[int, ...]]:
        """``{host: its ranks}``, in host order."""
        out, first = {}, 0
        for h in self.hosts:
            out[h.name] = tuple(range(first, first + h.slots))
            first += h.slots
        return out

    def host_of(self, rank: int) -> str:
        """The host that runs ``rank``.

        Raises
        ------
        ArgumentIndexError
            For a rank outside ``0 .. num_ranks - 1``.
        """
        first = 0
        if isinstance(rank, int) and rank >= 0:
            for h in self.hosts:
                if rank < first + h.slots:
                    return h.name
                first += h.slots
        raise ArgumentIndexError(f"rank {rank} is not one of the {self.num_ranks} ranks "
                                 f"placed on {', '.join(self.names)}")

    def ranks_of(self, host: str) -> tuple[int, ...]:
        """The ranks that run on ``host``.

        Raises
        ------
        ArgumentKeyError
            For a host the placement does not have.
        """
        ranks = self.by_host.get(host)
        if ranks is None:
            raise ArgumentKeyError(f"host {host} is not one of {', '.join(self.names)}")
        return ranks

    def mpiexec_hosts(self) -> str:
        """The hosts for ``mpiexec -hosts``: ``"a:2,b:1"``."""
        return ",".join(str(h) for h in self.hosts)


def _suggest(hosts: tuple[Host, ...], num_ranks: int) -> tuple[Host, ...]:
    """The hosts with their slots changed (at the end) to add up to ``num_ranks``."""
    out, left = [], num_ranks
    for index, h in enumerate(hosts):
        if left <= 0:
            break
        last = index == len(hosts) - 1
        out.append(Host(h.name, left if last else min(h.slots, left)))
        left -= out[-1].slots
    return tuple(out)


def place_ranks(hosts: str | Sequence[str | Host], num_ranks: int) -> RankPlacement:
    """Place ``num_ranks`` ranks on ``hosts``, in order, filling each host's slots.

    Parameters
    ----------
    hosts : str, sequence of str or Host
        As :func:`parse_hosts` takes them (or :func:`read_hostfile` gives them).
    num_ranks : int
        The program's rank count.

    Raises
    ------
    ArgumentError
        If the slots do not add up to ``num_ranks`` exactly; the message names
        both counts and the hint a list of hosts that fits.
    """
    hosts = parse_hosts(hosts)
    slots = sum(h.slots for h in hosts)
    if slots != num_ranks:
        fit = _suggest(hosts, num_ranks)
        more = "more" if slots > num_ranks else "fewer"
        raise ArgumentError(
            f"the hosts have {slots} slots ({', '.join(map(str, hosts))}), {more} than the "
            f"{num_ranks} ranks of the bundle",
            hint=f"give the hosts {num_ranks} slots in all, for example hosts="
            f"{[str(h) for h in fit]!r}",
            cli_hint=f"give the hosts {num_ranks} slots in all, for example --hosts "
            f"{','.join(map(str, fit))} (or host:slots lines in the --hostfile)")
    return RankPlacement(hosts)
