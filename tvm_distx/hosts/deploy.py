"""Deploying a bundle: each host gets what its ranks need, and nothing else.

::

    placement = place_ranks(read_hostfile("hosts.txt"), manifest.num_ranks)
    deploy("bundle/", placement, "/srv/llama")      # over the remote shell, checked there
    check_deployed(manifest, placement, "/srv/llama")   # before each launch: quick
    split("bundle/", placement, "out/")              # out/<host>/, locally

Each host's copy at ``dest`` holds the bundle's ``manifest.json``, its library, its program
files (the plan, the board runtime and a board bundle's ``python/``), a generation bundle's
``generation.json``, its ``run.sh`` (when the bundle has one) and the weight files of the ranks the
placement gives that host; no other rank's weights. It goes through the remote
shell (:mod:`tvm_distx.hosts.rsh`) as a tar stream written straight into
``RSH HOST 'mkdir -p DEST && cd DEST && tar -x'``: no copy of the bundle is
made on this side, and all hosts are fed at once.

Deploy owns these names in ``dest``: ``manifest.json``, the library, ``run.sh``,
``weights/`` (replaced as a whole) and ``deployment.json``. Other files there
are left alone.

Once a host has its files, the host itself checks them against the manifest
(``python -m tvm_distx.hosts.remote verify``: the library's sha256 and
architecture, each weight file's sha256, shapes and dtypes) and then writes
its deployment record, ``dest/deployment.json``: the host, its ranks, the
sha256 of the source bundle's ``manifest.json`` and each file's size
(:mod:`tvm_distx.hosts.remote`). :func:`check_deployed` compares the records
with a placement before a launch, reading no file but the record.

Weights linked to a checkpoint (``weight_links``, the bundles of
``CausalLM.from_pretrained`` sessions) are read by the ranks themselves from
the checkpoint's path. Unless that path is on a filesystem every host shares
(``shared_fs=True``), deploy reads each host's ranks' blocks and streams them
as ``weights/rank<r>.safetensors`` (with the rank's stored weights, if it has
some), one tensor in memory at a time; that host's manifest lists these files
instead of its ranks' links. The record's bundle is still the source
manifest's sha256.
"""

from __future__ import annotations

from dataclasses import dataclass
import hashlib
import io
import json
import logging
import os
from pathlib import Path, PurePosixPath
import shlex
import shutil
import sys
import tarfile
import time
from typing import BinaryIO, Callable, Iterator, Sequence

import numpy as np

from tvm_distx.bundle.manifest import (_SAFETENSORS_DTYPES, MANIFEST, Manifest, WeightLink,
                                       read_manifest)
from tvm_distx.sources.formats import numpy_dtype
from tvm_distx.errors import ArgumentError, ArgumentTypeError, BundleError, DeployError
from tvm_distx.hosts.hostfile import RankPlacement, place_ranks
from tvm_distx.bundle.generation import GENERATION_FILE
from tvm_distx.hosts.remote import LAUNCHER, RECORD, verify_copy
from tvm_distx.hosts.rsh import DEFAULT_TIMEOUT, RemoteResult, run_on_hosts

__all__ = ["HostReport", "deploy", "split", "check_deployed", "bundle_sha256"]

logger = logging.getLogger(__name__)

_CHUNK = 1 << 20
#: numpy's dtype names, as safetensors names them.
_ST_DTYPES = {numpy: st for st, numpy in _SAFETENSORS_DTYPES.items()}
#: What a host runs to take a tar stream into its deploy directory ($0).
_RECEIVE = ('mkdir -p "$0" && cd "$0" && rm -rf deployment.json weights '
            '&& exec tar -x -f - -o')


@dataclass(frozen=True)
class HostReport:
    """One host's deployed copy.

    Attributes
    ----------
    host : str
    ranks : tuple of int
    dest : str
        The copy's directory on the host.
    files : int
        The files copied (manifest, library, run.sh, weights).
    bytes : int
        Their total size.
    """

    host: str
    ranks: tuple[int, ...]
    dest: str
    files: int
    bytes: int


def bundle_sha256(bundle: str | os.PathLike | Manifest) -> str:
    """The sha256 of a bundle's ``manifest.json`` bytes: the bundle's identity in records."""
    root = bundle.root if isinstance(bundle, Manifest) else Path(bundle)
    try:
        return hashlib.sha256((root / MANIFEST).read_bytes()).hexdigest()
    except OSError as err:
        raise BundleError(f"cannot read {root / MANIFEST}: {err.strerror}",
                          hint="give a bundle directory (tvm_distx.compile(...).export(dir))",
                          cli_hint="give a bundle directory (tvm-distx compile ... -o DIR)") \
            from None


# ------------------------------------------------------------------ what a host gets
@dataclass
class _Member:
    """One file of a host's copy: its name in the copy, size, mode, and its bytes, lazily."""

    name: str
    size: int
    mode: int
    chunks: Callable[[], Iterator[bytes]]


def _file_chunks(path: Path, offset: int = 0, size: int | None = None):
    def chunks() -> Iterator[bytes]:
        left = path.stat().st_size - offset if size is None else size
        with open(path, "rb") as f:
            f.seek(offset)
            while left > 0:
                block = f.read(min(_CHUNK, left))
                if not block:
                    raise BundleError(f"{path} shrank while it was being deployed",
                                      hint="deploy again once nothing writes the bundle")
                left -= len(block)
                yield block
    return chunks


def _file_member(root: Path, name: str, mode: int = 0o644) -> _Member:
    path = root / name
    return _Member(name, path.stat().st_size, mode, _file_chunks(path))


def _safetensors_table(path: Path) -> tuple[dict, int]:
    """A safetensors file's header (``{name: info}``) and where its data starts."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header, 8 + size


def _materialized(manifest: Manifest, rank: int, digest: dict) -> tuple[_Member, dict]:
    """Rank ``rank``'s stored and linked weights as one safetensors member, and its entry.

    The member streams one tensor at a time and leaves the file's sha256 in
    ``digest["sha256"]`` once read to the end.
    """
    tensors = []  # (name, safetensors dtype, shape, nbytes, chunks)
    weights = []
    for entry in manifest.raw.get("weight_files", []):
        if int(entry["rank"]) != rank:
            continue
        path = manifest.root / entry["file"]
        header, start = _safetensors_table(path)
        for w in entry["weights"]:
            info = header[w["name"]]
            a, b = info["data_offsets"]
            tensors.append((w["name"], info["dtype"], list(info["shape"]), b - a,
                            _file_chunks(path, start + a, b - a)))
            weights.append(dict(w))
    for link in manifest.weight_links:
        if link.rank != rank:
            continue
        dtype = numpy_dtype(link.dtype)
        if dtype.name not in _ST_DTYPES:
            raise BundleError(f"weight '{link.name}' of rank {rank} is linked as {dtype}, which "
                              "a bundle cannot store", hint="export the bundle again")
        tensors.append((link.name, _ST_DTYPES[dtype.name], list(link.shape),
                        int(np.prod(link.shape, dtype=np.int64)) * dtype.itemsize,
                        _link_chunks(link, dtype)))
        weights.append({"name": link.name, "shape": list(link.shape), "dtype": dtype.name})
    header, offset = {}, 0
    for name, st_dtype, shape, nbytes, _ in tensors:
        header[name] = {"dtype": st_dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    prefix = len(text).to_bytes(8, "little") + text

    def chunks() -> Iterator[bytes]:
        sha = hashlib.sha256(prefix)
        yield prefix
        for *_, tensor_chunks in tensors:
            for block in tensor_chunks():
                sha.update(block)
                yield block
        digest["sha256"] = sha.hexdigest()

    name = f"weights/rank{rank}.safetensors"
    return (_Member(name, len(prefix) + offset, 0o644, chunks),
            {"rank": rank, "file": name, "weights": weights})


def _link_chunks(link: WeightLink, dtype: np.dtype):
    def chunks() -> Iterator[bytes]:
        block = np.ascontiguousarray(link.lazy().read(), dtype=dtype.newbyteorder("<"))
        if block.shape != link.shape:
            raise BundleError(f"weight '{link.name}' of rank {link.rank}: the checkpoint "
                              f"{link.checkpoint} gave a block of shape {list(block.shape)}, not "
                              f"{list(link.shape)}", hint="the checkpoint changed since the "
                              "bundle was made; make it again")
        data = memoryview(block.reshape(-1)).cast("B")
        for at in range(0, len(data), _CHUNK):
            yield bytes(data[at:at + _CHUNK])
    return chunks


def _members(manifest: Manifest, ranks: Sequence[int], shared_fs: bool) -> Iterator[_Member]:
    """A host's files, the manifest last (its weight files' sha256 are known only then)."""
    root = manifest.root
    yield _file_member(root, manifest.library)
    for name in manifest.program_files:
        yield _file_member(root, name)
    if (root / GENERATION_FILE).is_file():  # a generation bundle's cache layout and tokens
        yield _file_member(root, GENERATION_FILE)
    if (root / LAUNCHER).is_file():
        yield _file_member(root, LAUNCHER, 0o755)
    linked = sorted({link.rank for link in manifest.weight_links if link.rank in ranks})
    if shared_fs:
        linked = []
    stored = sorted({w.file for w in manifest.weight_files
                     if w.rank in ranks and w.rank not in linked})
    for name in stored:
        yield _file_member(root, name)
    if not linked:
        yield _file_member(root, MANIFEST)
        return
    data = json.loads((root / MANIFEST).read_text())
    entries = []
    for rank in linked:
        digest: dict = {}
        member, entry = _materialized(manifest, rank, digest)
        yield member
        entries.append({**entry, "sha256": digest["sha256"]})
    data["weight_files"] = [e for e in data.get("weight_files", [])
                            if int(e["rank"]) not in linked] + entries
    data["weight_files"].sort(key=lambda e: int(e["rank"]))
    data["weight_links"] = [w for w in data.get("weight_links", [])
                            if int(w["rank"]) not in linked]
    if not data["weight_links"]:
        del data["weight_links"]
    text = (json.dumps(data, indent=1) + "\n").encode()
    yield _Member(MANIFEST, len(text), 0o644, lambda: iter([text]))


class _Reader(io.RawIOBase):
    """A member's chunks as a file object (what tarfile copies from)."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self.chunks = chunks
        self.block, self.at = b"", 0

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        parts, want = [], size
        while want != 0:
            if self.at == len(self.block):
                self.block, self.at = next(self.chunks, None), 0
                if self.block is None:
                    self.block = b""
                    break
            take = len(self.block) - self.at if want < 0 else min(want, len(self.block) - self.at)
            parts.append(self.block[self.at:self.at + take])
            self.at += take
            want = want - take if want > 0 else want
        return b"".join(parts)

    def finish(self, member: _Member) -> None:
        """Run the chunks to their end (which records a digest); refuse bytes beyond the size."""
        if self.at < len(self.block) or any(len(block) for block in self.chunks):
            raise BundleError(f"{member.name} grew while it was being deployed",
                              hint="deploy again once nothing writes the bundle")


def _send(members: Iterator[_Member], stream: BinaryIO, totals: dict) -> None:
    """Write the members as one tar stream (tarfile's stream mode: nothing seeks, nothing waits)."""
    with tarfile.open(fileobj=stream, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        tar.copybufsize = _CHUNK
        for member in members:
            info = tarfile.TarInfo(member.name)
            info.size, info.mode, info.mtime = member.size, member.mode, int(time.time())
            reader = _Reader(member.chunks())
            tar.addfile(info, reader)
            reader.finish(member)
            totals["files"] = totals.get("files", 0) + 1
            totals["bytes"] = totals.get("bytes", 0) + member.size


def _write_local(members: Iterator[_Member], out: Path) -> None:
    """Write the members as files under ``out`` (the copy :func:`split` makes)."""
    for member in members:
        path = out / member.name
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        with open(partial, "wb") as f:
            for block in member.chunks():
                f.write(block)
        partial.chmod(member.mode)
        os.replace(partial, path)


# ------------------------------------------------------------------ checks and arguments
def _placed(manifest: Manifest, placement: RankPlacement) -> RankPlacement:
    if not isinstance(placement, RankPlacement):
        raise ArgumentTypeError(f"placement is a {type(placement).__name__}, not a RankPlacement",
                                hint="placement=tvm_distx.hosts.place_ranks(hosts, num_ranks)")
    return place_ranks(placement.hosts, manifest.num_ranks)  # the same slots, or the error


def _remote_dest(dest: str | os.PathLike) -> str:
    text = os.fspath(dest)
    if not PurePosixPath(text).is_absolute():
        raise ArgumentError(f"the deploy directory {text!r} is not an absolute path",
                            hint="give dest as an absolute path: it names a directory on "
                            "each host, and every rank is started there",
                            cli_hint="give --dest an absolute path: it names a directory on "
                            "each host")
    return text


def _python(python: str | Sequence[str] | None) -> list[str]:
    if python is None:
        return [sys.executable]
    return shlex.split(python) if isinstance(python, str) else list(python)


def _redeploy_hints(root: Path, placement: RankPlacement, dest: str) -> dict:
    return {"hint": f"deploy the bundle again: tvm_distx.hosts.deploy({str(root)!r}, "
                    f"placement, {dest!r})",
            "cli_hint": f"deploy the bundle again: tvm-distx deploy {shlex.quote(str(root))} "
                        f"--hosts {placement.mpiexec_hosts()} --dest {shlex.quote(dest)}"}


def _reply(result: RemoteResult, hints: dict) -> dict:
    """The JSON reply of ``python -m tvm_distx.hosts.remote`` on a host, or the error."""
    result.check()
    for line in reversed(result.stdout.splitlines()):
        try:
            reply = json.loads(line)
        except ValueError:
            continue
        if isinstance(reply, dict) and "ok" in reply:
            if reply["ok"]:
                return reply
            raise DeployError(f"host {result.host}: {reply.get('error')}", host=result.host,
                              file=reply.get("file"), reason="files", **hints)
    raise DeployError(f"host {result.host}: `python -m tvm_distx.hosts.remote` failed (exit "
                      f"{result.returncode}): {result.last_error_line or 'no output'}",
                      host=result.host,
                      hint="install tvm-distx on every host, with the same Python path as "
                      "here, or give that Python with python=",
                      cli_hint="install tvm-distx on every host, with the same Python path as "
                      "here, or give that Python with --python")


def _remote_command(python: list[str], command: str, dest: str, host: str,
                    ranks: Sequence[int], sha: str, manifest: Manifest) -> list[str]:
    """``python -m tvm_distx.hosts.remote ...`` on a host; with a board bundle's own modules
    on ``PYTHONPATH`` (a board has no tvm-distx installed)."""
    own = [] if manifest.board_python is None else \
        ["env", f"PYTHONPATH={dest}/{manifest.board_python}"]
    return [*own, *python, "-m", "tvm_distx.hosts.remote", command, dest, "--host", host,
            "--ranks", ",".join(map(str, ranks)), "--bundle", sha]


# ------------------------------------------------------------------ the entry points
def deploy(bundle: str | os.PathLike, placement: RankPlacement, dest: str | os.PathLike, *,
           rsh: str | Sequence[str] | None = None, python: str | Sequence[str] | None = None,
           shared_fs: bool = False, timeout: float = DEFAULT_TIMEOUT) -> dict[str, HostReport]:
    """Copy each host what its ranks need, over the remote shell, and check it there.

    Parameters
    ----------
    bundle : path
        The bundle directory, here.
    placement : RankPlacement
        Which ranks run on which host (:func:`~tvm_distx.hosts.hostfile.place_ranks`).
    dest : path
        The copy's directory on every host (absolute; created).
    rsh : str or sequence of str, optional
        The remote shell (:func:`~tvm_distx.hosts.rsh.remote_shell`).
    python : str or sequence of str, optional
        The Python on the hosts, with tvm-distx installed; by default this
        process's interpreter path (``sys.executable``).
    shared_fs : bool
        The checkpoint of linked weights is at the same path on every host:
        the links are kept instead of copying the blocks.
    timeout : float
        Seconds a host has to answer, and to take more data while it is fed.

    Returns
    -------
    dict of str to HostReport
        Per host, in placement order.

    Raises
    ------
    ArgumentError
        If the placement's slots differ from the bundle's rank count, or
        ``dest`` is not absolute.
    BundleError
        If the bundle is unusable here.
    DeployError
        If a host does not answer, cannot take the copy, or its copy fails the
        check on the host (one line naming the host, and the file).
    """
    manifest = read_manifest(bundle)
    placement = _placed(manifest, placement)
    dest = _remote_dest(dest)
    sha = bundle_sha256(manifest)
    by_host = placement.by_host
    totals = {h: {} for h in by_host}
    feeds = {h: (lambda stream, h=h: _send(_members(manifest, by_host[h], shared_fs), stream,
                                           totals[h])) for h in by_host}
    logger.info("deploying %s to %s on %s", manifest.root, dest, placement.mpiexec_hosts())
    copied = run_on_hosts({h: ["sh", "-c", _RECEIVE, dest] for h in by_host}, rsh=rsh,
                          timeout=timeout, feeds=feeds)
    for host, result in copied.items():
        result.check()
        if result.returncode != 0:
            raise DeployError(f"host {host}: copying to {dest} failed (exit {result.returncode}): "
                              f"{result.last_error_line or 'no output'}", host=host, file=dest,
                              hint="give dest a directory the remote user may write, on a "
                              "filesystem with room for the host's weights",
                              cli_hint="give --dest a directory the remote user may write, on "
                              "a filesystem with room for the host's weights")
    hints = {"hint": f"the copy on the host differs from the bundle at {manifest.root}: check "
                     "that nothing changes the bundle, then deploy again",
             "cli_hint": None}
    # reading the weights back for their sha256 takes time: at least 20 MB/s per host
    slowest = max(t.get("bytes", 0) for t in totals.values())
    verified = run_on_hosts({h: _remote_command(_python(python), "verify", dest, h, ranks, sha,
                                             manifest)
                             for h, ranks in by_host.items()}, rsh=rsh,
                            timeout=timeout + slowest / 20e6)
    for result in verified.values():
        _reply(result, hints)
    reports = {h: HostReport(h, ranks, dest, totals[h].get("files", 0), totals[h].get("bytes", 0))
               for h, ranks in by_host.items()}
    for r in reports.values():
        logger.info("%s: ranks %s, %d files, %d bytes, verified", r.host,
                    ",".join(map(str, r.ranks)), r.files, r.bytes)
    return reports


def split(bundle: str | os.PathLike, placement: RankPlacement, out: str | os.PathLike, *,
          shared_fs: bool = False) -> dict[str, HostReport]:
    """Write each host's copy locally, as ``out/<host>/`` (what :func:`deploy` would send).

    Each copy is checked and gets its deployment record, as on a host; copy
    ``out/<host>/`` to ``dest`` on the host (keeping its files' sizes) and
    :func:`check_deployed` accepts it.

    Raises
    ------
    ArgumentError
        If the placement's slots differ from the bundle's rank count.
    BundleError
        If the bundle is unusable.
    DeployError
        If a written copy fails its check.
    """
    manifest = read_manifest(bundle)
    placement = _placed(manifest, placement)
    sha = bundle_sha256(manifest)
    out = Path(out)
    reports = {}
    for host, ranks in placement.by_host.items():
        copy = out / host
        copy.mkdir(parents=True, exist_ok=True)
        (copy / RECORD).unlink(missing_ok=True)
        shutil.rmtree(copy / "weights", ignore_errors=True)
        _write_local(_members(manifest, ranks, shared_fs), copy)
        try:
            done = verify_copy(copy, host, list(ranks), sha)
        except DeployError as err:
            raise DeployError(f"host {host}: {err.message}", host=host, file=err.file,
                              hint="check that nothing changes the bundle, then split again") \
                from None
        reports[host] = HostReport(host, ranks, str(copy), done["files"], done["bytes"])
    return reports


def check_deployed(manifest: Manifest | str | os.PathLike, placement: RankPlacement,
                   dest: str | os.PathLike, *, rsh: str | Sequence[str] | None = None,
                   python: str | Sequence[str] | None = None,
                   timeout: float = DEFAULT_TIMEOUT) -> None:
    """Check, before a launch, that each host holds the copy its ranks need (all hosts at once).

    On each host, ``python -m tvm_distx.hosts.remote check`` reads the deployment
    record at ``dest``: it must name exactly the ranks ``placement`` gives that
    host and this bundle (the sha256 of ``manifest``'s ``manifest.json``), and
    every file of the copy must be there with its size. Nothing is hashed: the
    ranks check their own files when they load them.

    Parameters
    ----------
    manifest : Manifest or path
        The bundle, here (a :class:`~tvm_distx.bundle.manifest.Manifest` or its
        directory).
    placement : RankPlacement
    dest : path
        The copy's directory on every host.
    rsh, python, timeout
        As for :func:`deploy`.

    Raises
    ------
    DeployError
        (a :class:`~tvm_distx.errors.LaunchError`) for the first host, in
        placement order, that does not answer (``host t3 does not answer: ...``)
        or whose copy is missing, of another bundle or for other ranks: one
        line naming the host and the file, and a hint to deploy again.
    ArgumentError
        If the placement's slots differ from the bundle's rank count.
    """
    if not isinstance(manifest, Manifest):
        manifest = read_manifest(manifest)
    placement = _placed(manifest, placement)
    dest = _remote_dest(dest)
    sha = bundle_sha256(manifest)
    hints = _redeploy_hints(manifest.root, placement, dest)
    results = run_on_hosts({h: _remote_command(_python(python), "check", dest, h, ranks, sha,
                                            manifest)
                            for h, ranks in placement.by_host.items()}, rsh=rsh, timeout=timeout)
    failures = []
    for result in results.values():
        try:
            _reply(result, hints)
        except DeployError as err:
            failures.append(err)
    for err in failures[1:]:
        logger.warning("%s", err.message)
    if failures:
        raise failures[0]
