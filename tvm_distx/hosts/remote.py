"""What runs on a host to check its deployed copy: ``python -m tvm_distx.hosts.remote``.

::

    python -m tvm_distx.hosts.remote verify DEST --host H --ranks 0,1 --bundle SHA
    python -m tvm_distx.hosts.remote check DEST --host H --ranks 0,1 --bundle SHA

``verify`` (the end of a deploy) checks every file of the copy at ``DEST`` for
this host's ranks against the manifest there (the library's architecture and
sha256, each weight file's sha256, shapes and dtypes:
:func:`~tvm_distx.bundle.manifest.check_library` and
:func:`~tvm_distx.bundle.manifest.check_weights`), then writes the deployment
record ``DEST/deployment.json``::

    {"format": "tvm-distx-deployment", "version": 1, "host": "H", "ranks": [0, 1],
     "bundle": "<sha256 of the source manifest.json>",
     "files": {"manifest.json": 4711, "lib.so": 123456, ...}}

``files`` gives each file of the copy and its size. A copy that fails the check
has no record. So a record means: these files, of this bundle, for these ranks,
were whole when they were deployed.

``check`` (before each launch, quick) reads the record: it must name exactly
the ranks ``--ranks`` and the bundle ``--bundle``, and every file it lists must
be there with its size. No file is read.

Each prints one JSON line on stdout, ``{"ok": true, ...}`` or ``{"ok": false,
"error": "...", "file": "..."}``, and exits with 0 or 1 (2 for bad usage). It
imports neither TVM nor the compiler: a host needs only Python, numpy,
safetensors and tvm-distx.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
import sys
from typing import Sequence

from tvm_distx.bundle.generation import GENERATION_FILE
from tvm_distx.bundle.manifest import MANIFEST, check_library, check_weights, read_manifest
from tvm_distx.errors import BundleError, DeployError

__all__ = ["RECORD", "RECORD_FORMAT", "RECORD_VERSION", "LAUNCHER", "verify_copy", "check_copy",
           "main"]

#: The deployment record, in the deploy directory.
RECORD = "deployment.json"
RECORD_FORMAT = "tvm-distx-deployment"
RECORD_VERSION = 1
#: A bundle's launch script, deployed when the bundle has one.
LAUNCHER = "run.sh"


def verify_copy(dest: Path, host: str, ranks: list[int], bundle: str) -> dict:
    """Check the copy at ``dest`` for ``ranks`` whole, then write its record (see above).

    Returns ``{"files": n, "bytes": total}``.

    Raises
    ------
    DeployError
        With the reason (one line) and the file, when a check fails.
    """
    record = dest / RECORD
    record.unlink(missing_ok=True)  # no record for a copy that fails
    try:
        manifest = read_manifest(dest)
        if any(r >= manifest.num_ranks for r in ranks):
            raise DeployError(f"{dest / MANIFEST} has {manifest.num_ranks} ranks, not ranks "
                              f"{_ranks_text(ranks)}", file=str(dest / MANIFEST))
        check_library(manifest)
        check_weights(manifest, ranks)
    except BundleError as err:
        raise DeployError(err.message) from None
    files = [MANIFEST, manifest.library, *manifest.program_files,
             *([LAUNCHER] if (dest / LAUNCHER).is_file() else []),
             *([GENERATION_FILE] if (dest / GENERATION_FILE).is_file() else []),
             *sorted({w.file for w in manifest.weight_files if w.rank in ranks})]
    missing = [f for f in files if not (dest / f).is_file()]
    if missing:
        raise DeployError(f"{dest / missing[0]} is missing", file=str(dest / missing[0]))
    sizes = {f: (dest / f).stat().st_size for f in files}
    data = {"format": RECORD_FORMAT, "version": RECORD_VERSION, "host": host, "ranks": ranks,
            "bundle": bundle, "files": sizes}
    partial = record.with_name(RECORD + ".partial")
    partial.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(partial, record)
    return {"files": len(sizes), "bytes": sum(sizes.values())}


def check_copy(dest: Path, host: str, ranks: list[int], bundle: str) -> dict:
    """The quick check of the copy at ``dest`` by its record (see above).

    Returns ``{"files": n}``.

    Raises
    ------
    DeployError
        With the reason (one line) and the file, when a check fails.
    """
    path = dest / RECORD
    if not dest.is_dir():
        raise DeployError(f"{dest} is missing: nothing was deployed there", file=str(dest))
    if not path.is_file():
        raise DeployError(f"{path} is missing: the copy at {dest} was not deployed, or its "
                          "deploy did not finish", file=str(path))
    try:
        data = json.loads(path.read_text())
        ok = (isinstance(data, dict) and data.get("format") == RECORD_FORMAT
              and data.get("version") == RECORD_VERSION and isinstance(data.get("files"), dict))
    except (OSError, ValueError):
        ok = False
    if not ok:
        raise DeployError(f"{path} is not a deployment record of this tvm-distx", file=str(path))
    held = data.get("ranks")
    if held != ranks:
        other = data.get("host")
        raise DeployError(f"{path} records ranks {_ranks_text(held)}"
                          + (f" (deployed for host {other})" if other != host else "")
                          + f", but the hosts give this host ranks {_ranks_text(ranks)}",
                          file=str(path))
    if data.get("bundle") != bundle:
        raise DeployError(f"{dest} holds another bundle ({path} records bundle "
                          f"{str(data.get('bundle'))[:12]}, this one is {bundle[:12]})",
                          file=str(path))
    for name, size in data["files"].items():
        file = dest / name
        if not file.is_file():
            raise DeployError(f"{file} is missing", file=str(file))
        if file.stat().st_size != size:
            raise DeployError(f"{file} has {file.stat().st_size} bytes, the deployed one had "
                              f"{size}", file=str(file))
    return {"files": len(data["files"])}


def _ranks_text(ranks) -> str:
    if isinstance(ranks, list) and ranks and all(isinstance(r, int) for r in ranks):
        return ",".join(map(str, ranks))
    return "none" if ranks == [] else repr(ranks)


def _ranks(text: str) -> list[int]:
    try:
        return [int(r) for r in text.split(",") if r != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of ranks: {text!r}") \
            from None


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``check`` or ``verify``; print one JSON line; return the exit status."""
    parser = argparse.ArgumentParser(prog="python -m tvm_distx.hosts.remote",
                                     description="check a bundle's deployed copy on this host")
    parser.add_argument("command", choices=["check", "verify"])
    parser.add_argument("dest", type=Path, help="the deploy directory")
    parser.add_argument("--host", required=True, help="this host's name in the placement")
    parser.add_argument("--ranks", type=_ranks, required=True, help="its ranks: 0,1")
    parser.add_argument("--bundle", required=True,
                        help="the sha256 of the source bundle's manifest.json")
    args = parser.parse_args(argv)
    run = verify_copy if args.command == "verify" else check_copy
    try:
        reply = {"ok": True, "host": args.host, "ranks": args.ranks,
                 **run(args.dest, args.host, args.ranks, args.bundle)}
    except DeployError as err:
        reply = {"ok": False, "error": err.message, "file": err.file}
    except OSError as err:
        reply = {"ok": False, "error": f"{err.filename}: {err.strerror}", "file": err.filename}
    sys.stdout.write(json.dumps(reply) + "\n")
    return 0 if reply["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
