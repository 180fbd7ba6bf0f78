"""The host flags of ``run``, ``generate`` and ``deploy``: one set of names, one meaning.

``--hostfile FILE`` (one ``host[:slots]`` per line, ``#`` comments) or its
one-line form ``--hosts a:2,b`` place the ranks in that order, filling each
host's slots; ``--rsh PROGRAM`` is the remote shell, called as ``ssh`` is
(default ``$TVM_DISTX_RSH``, else ``ssh``). ``run`` and ``generate`` also take
where the bundle is on the hosts: ``--dest DIR`` (a copy ``tvm-distx deploy``
made, checked before launch) or ``--shared-fs`` (the same path on every host);
with neither, the session copies each host its share and removes it after.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tvm_distx.errors import ArgumentError

__all__ = ["add_host_arguments", "session_options"]

#: The help of ``--rsh``, shared by every subcommand that reaches other hosts.
RSH_HELP = ("the remote shell, called as ssh is: PROGRAM [options] HOST COMMAND (default "
            "$TVM_DISTX_RSH, else ssh); also mpiexec's launcher")


def add_host_arguments(p: argparse.ArgumentParser, *, launch: bool = True) -> None:
    """Add the host flags; ``launch`` adds ``--dest`` and ``--shared-fs``."""
    p.add_argument("--hostfile", type=Path, default=None, metavar="FILE",
                   help="the hosts, one host[:slots] [mem=SIZE] per line (# comments; Open "
                   "MPI's host slots=N too); ranks fill each host's slots in order; rank 0 may "
                   "be on any host; mem= is the host's memory (16G), else it is read from the "
                   "host, and checked against its ranks' before launch")
    p.add_argument("--hosts", default=None, metavar="HOST[:SLOTS],...",
                   help="the hosts on one line instead of --hostfile: a:2,b or 'a:2 mem=16G,b'")
    p.add_argument("--rsh", default=None, metavar="PROGRAM", help=RSH_HELP)
    if launch:
        p.add_argument("--dest", default=None, metavar="DIR",
                       help="where tvm-distx deploy put the bundle on every host (checked "
                       "before launch); without it and --shared-fs, each host gets its share "
                       "for this run only")
        p.add_argument("--shared-fs", action="store_true",
                       help="the bundle (and a checkpoint its weights link to) is at the same "
                       "path on every host: copy nothing")


def session_options(args: argparse.Namespace) -> dict:
    """The session options the host flags give (empty for a run on this host alone).

    Raises
    ------
    ArgumentError
        For ``--hostfile`` with ``--hosts``, or ``--dest``/``--shared-fs``/``--rsh``
        without hosts.
    """
    if args.hostfile is not None and args.hosts is not None:
        raise ArgumentError("--hostfile and --hosts both give the hosts",
                            hint="give one of them: --hostfile FILE, or --hosts a:2,b")
    options: dict = {}
    if args.hostfile is not None:
        options["hostfile"] = args.hostfile
    elif args.hosts is not None:
        options["hosts"] = args.hosts
    dest, shared = getattr(args, "dest", None), getattr(args, "shared_fs", False)
    given = [flag for flag, value in (("--rsh", args.rsh), ("--dest", dest),
                                      ("--shared-fs", shared or None)) if value is not None]
    if given and not options:
        raise ArgumentError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} "
                            "only to ranks on other hosts",
                            hint="give the hosts too: --hostfile FILE or --hosts a:2,b")
    if dest is not None and shared:
        raise ArgumentError("--dest and --shared-fs both say where the bundle is",
                            hint="--dest DIR for a deployed copy, or --shared-fs for the "
                            "bundle's own path on every host")
    if dest is not None:
        options["dest"] = dest
    if shared:
        options["shared_fs"] = True
    if args.rsh is not None:
        options["rsh"] = args.rsh
    return options
