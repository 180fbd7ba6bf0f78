"""``tvm-distx deploy``: copy each host what its ranks of a bundle need.

``BUNDLE (--hostfile FILE | --hosts a:2,b) --dest DIR [--rsh PROGRAM] [--python PATH]``
places the bundle's ranks on the hosts (in order, filling each host's slots),
streams each host its copy over the remote shell and has the host check it
(:func:`tvm_distx.hosts.deploy`). ``--split-only OUT`` writes ``OUT/<host>/``
here instead (:func:`tvm_distx.hosts.split`). Errors are those of
:mod:`tvm_distx.cli.main`: one line with a hint in flags.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
import sys

from tvm_distx.cli.hosts import add_host_arguments
from tvm_distx.cli.inputs import EXIT_OK, _progress
from tvm_distx.errors import ArgumentError

__all__ = ["deploy", "add_parser"]

logger = logging.getLogger(__name__)


def add_parser(sub) -> argparse.ArgumentParser:
    """The ``deploy`` subcommand's parser, added to ``sub``."""
    p = sub.add_parser("deploy", help="copy each host only what its ranks of a bundle need, "
                       "over the remote shell, and check it there")
    p.add_argument("bundle", type=Path, help="a bundle directory, here")
    add_host_arguments(p, launch=False)
    p.add_argument("--dest", default=None, metavar="DIR",
                   help="the copy's directory on every host (an absolute path)")
    p.add_argument("--python", default=None, metavar="PATH",
                   help="the Python with tvm-distx on the hosts (default: this one's path)")
    p.add_argument("--shared-fs", action="store_true",
                   help="the checkpoint of a bundle's linked weights is at the same path on "
                   "every host: do not copy its blocks")
    p.add_argument("--split-only", type=Path, default=None, metavar="OUT",
                   help="write each host's copy here as OUT/<host>/ instead of sending it")
    p.set_defaults(handler=deploy)
    return p


def deploy(args: argparse.Namespace) -> int:
    """``tvm-distx deploy``: each host its copy, checked on the host (or split locally)."""
    from tvm_distx.bundle.manifest import read_manifest
    from tvm_distx.hosts import deploy as send, hosts_from, place_ranks, split

    if args.hostfile is None and args.hosts is None:
        raise ArgumentError("deploy needs the hosts", hint="give --hostfile FILE or --hosts a:2,b")
    if args.hostfile is not None and args.hosts is not None:
        raise ArgumentError("--hostfile and --hosts both give the hosts",
                            hint="give one of them: --hostfile FILE, or --hosts a:2,b")
    if args.dest is None and args.split_only is None:
        raise ArgumentError("deploy needs --dest DIR, the copy's directory on every host",
                            hint="give --dest /path/on/the/hosts, or --split-only OUT to write "
                            "the copies here")
    hosts = hosts_from(hosts=args.hosts, hostfile=args.hostfile)
    manifest = read_manifest(args.bundle)
    placement = place_ranks(hosts, manifest.num_ranks)
    if args.split_only is not None:
        with _progress(f"writing {len(placement.hosts)} hosts' copies to {args.split_only}"):
            reports = split(args.bundle, placement, args.split_only, shared_fs=args.shared_fs)
    else:
        with _progress(f"deploying to {placement.mpiexec_hosts()}"):
            reports = send(args.bundle, placement, args.dest, rsh=args.rsh, python=args.python,
                           shared_fs=args.shared_fs)
    for r in reports.values():
        sys.stdout.write(f"{r.host}: ranks {','.join(map(str, r.ranks))}: {r.files} files, "
                         f"{r.bytes / 2**20:.1f} MiB at {r.dest} (checked)\n")
    return EXIT_OK
