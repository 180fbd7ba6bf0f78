"""Bundles: a compiled distributed program, each rank's weights, and a manifest.

A bundle is a directory::

    manifest.json           what the launcher and every rank read (schema below)
    lib.so                  the rank programs, one library for all ranks
    plan.json               the same programs as data, for ranks with no TVM (the board's)
    weights/rank<d>.safetensors   the shards of every weight that device d holds

Each rank's weights are one `safetensors <https://huggingface.co/docs/safetensors>`_
file, the format Hugging Face checkpoints use: a JSON header naming each
tensor's dtype, shape and byte range, then the raw bytes. A rank reads only its
own file, and memory-maps it (:meth:`Manifest.read_weight`), so loading costs
no copy beyond the one its runtime makes.

The manifest (``"format": "tvm-distx-bundle"``, ``"version": 2``) holds:

``num_ranks``
    How many processes the program needs (device ``d`` is rank ``d``).
``library``, ``library_sha256``, ``target``
    The library's file name (relative to the bundle, as every file the manifest
    names), its sha256 and the TVM target it was built for.
    :func:`check_library` checks the library before any rank starts: an ELF
    shared library, for this host's architecture, with that sha256.
``program_files`` (optional)
    The files beside the library that every rank's host needs: the plan, the
    compiled board runtime and, for a board bundle, its ``python/`` modules
    (:meth:`Manifest.program_files`); deployment copies them to every host.
``plan``, ``plan_sha256`` (optional)
    The rank plan's file name and sha256: the program the library's virtual
    machine runs, written as data (:mod:`tvm_distx.compiler.board_plan`), which the
    board's ranks run with the library's kernels and no TVM. Absent when the
    program has a construct the plan cannot write; ``plan_refusal`` then says which.
``meshes``
    ``[{"name", "shape", "devices"}]``, every mesh of the program.
``ranks``
    ``[{"rank", "coordinates": {mesh name: [coordinate per axis]}}]``, where
    each rank sits in the meshes that contain it.
``process_groups``
    ``[{"mesh", "axis", "groups": [[ranks], ...]}]``: per mesh axis, the
    groups of ranks its collectives run among.
``collectives``
    The ``tvm_distx.ccl.*`` runtime functions the program calls.
``functions``
    Per public function: ``entries`` (the function each rank runs, ``null`` for
    none), ``params`` and ``results`` (name, global shape, dtype, mesh and
    placement), ``tuple_result``, ``weights`` (the names of the
    parameters that are stored in the bundle instead of passed at run time),
    and, optionally, ``derived``: the parameters cut from a user's fused
    weight, ``[{"name", "source", "source_shape", "axis", "start", "stop"}]``
    (:class:`tvm_distx.layout.derived.DerivedParam`), so that a weight given
    at run time may be the user's fused one; and, optionally, ``feed``: how
    the ranks receive the inputs, ``"shards"`` (each rank its shard, the
    default) or ``"worker0"`` (rank 0 the global inputs, which the program
    scatters, as lowered by TVM's ``LowerDistIR``; see
    :mod:`tvm_distx.bundle.signature`).
``weight_files``
    ``[{"rank", "file", "sha256", "weights": [{"name", "shape", "dtype"}]}]``:
    each rank's safetensors file, its sha256, and the shards it holds (under
    the ``"worker0"`` feed, rank 0's file holds the whole weights).
``weight_links`` (optional)
    ``[{"rank", "name", "checkpoint", "tensor", "start", "stop", "stored_dtype",
    "dtype"}]``: shards not copied into the bundle but read by the rank itself
    from a checkpoint's safetensors file (an absolute path, the same on every
    host): the block ``[start, stop)`` of tensor ``tensor``, converted to
    ``dtype``. A session serving a checkpoint (``CausalLM.from_pretrained``)
    links its weights this way, so no process but the rank holding a shard
    ever reads it.

:func:`read_manifest` refuses, with a :class:`tvm_distx.errors.BundleError`, a
missing or unparsable manifest, an unknown format or version, missing fields,
and (:func:`check_weights`) a weight file that is missing, is not a valid
safetensors file, holds a shard of the wrong shape or dtype, or whose sha256
differs. It runs before any rank computes.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
import hashlib
import json
import logging
import os
from pathlib import Path
import platform
from typing import Sequence

import numpy as np

from tvm_distx.sources.checkpoint import LazyTensor
from tvm_distx.sources.formats import EncodedPart, numpy_dtype, weight_format
from tvm_distx.sources.gguf import GGUFBlock
from tvm_distx.bundle.signature import FEEDS, SHARDS, FunctionSignature, TensorSpec
from tvm_distx.errors import BundleError
from tvm_distx.layout.derived import Derivations
from tvm_distx.layout.mesh import DeviceMesh

__all__ = ["FORMAT", "VERSION", "Manifest", "WeightFile", "read_manifest", "check_weights",
           "sha256_file", "check_library", "write_rank_weights", "WeightLink"]

logger = logging.getLogger(__name__)

FORMAT = "tvm-distx-bundle"
VERSION = 2
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class WeightFile:
    """One rank's shard of one weight, as the manifest lists it.

    ``file`` is the rank's safetensors file, which holds all its shards, and
    ``sha256`` is that file's.
    """

    rank: int
    name: str
    file: str
    shape: tuple[int, ...]
    dtype: str
    sha256: str


@dataclass(frozen=True)
class WeightLink:
    """One rank's shard of one weight, read from a checkpoint file by the rank itself.

    ``start`` and ``stop`` bound the block of the checkpoint's tensor. With an
    ``encoding`` (a format of :mod:`tvm_distx.sources.formats`), the shard is
    that block encoded, the ``part`` of it the program takes (``"data"`` or
    ``"scale"``): the rank quantizes its own slice as it reads it. With ``gguf``
    (a :class:`~tvm_distx.sources.gguf.GGUFBlock` as JSON), the shard is that block
    of a GGUF file's tensor, in its stored format: ``start`` and ``stop`` bound
    the part itself.
    """

    rank: int
    name: str
    checkpoint: str
    tensor: str
    start: tuple[int, ...]
    stop: tuple[int, ...]
    stored_dtype: str
    dtype: str
    encoding: str | None = None
    part: str = "data"
    gguf: dict | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        block = tuple(b - a for a, b in zip(self.start, self.stop))
        if self.encoding is None or self.gguf is not None:
            return block
        return weight_format(self.encoding).part_shape(self.part, block)

    def lazy(self):
        """The shard, read on demand (a lazy checkpoint block, encoded when linked so)."""
        if self.gguf is not None:
            return GGUFBlock.from_json(self.gguf)
        block = LazyTensor(Path(self.checkpoint), self.tensor, tuple(zip(self.start, self.stop)),
                           np.dtype("float32") if self.encoding else numpy_dtype(self.dtype),
                           self.stored_dtype)
        if self.encoding is None:
            return block
        return EncodedPart(block, weight_format(self.encoding), self.part)

    def to_json(self) -> dict:
        out = {"rank": self.rank, "name": self.name, "checkpoint": self.checkpoint,
               "tensor": self.tensor, "start": list(self.start), "stop": list(self.stop),
               "stored_dtype": self.stored_dtype, "dtype": self.dtype}
        if self.encoding is not None:
            out["encoding"] = self.encoding
        if self.part != "data":
            out["part"] = self.part
        if self.gguf is not None:
            out["gguf"] = self.gguf
        return out

    @classmethod
    def linkable(cls, value) -> bool:
        """Whether ``value`` is a checkpoint block (or one encoded from one) a rank can read."""
        if isinstance(value, EncodedPart):
            value = value.source
        return isinstance(value, (LazyTensor, GGUFBlock))

    @classmethod
    def of(cls, rank: int, name: str, block) -> "WeightLink":
        """The link to ``block``: a lazy checkpoint tensor or an encoded part of one, sliced
        to the rank's shard."""
        encoding, part, dtype = None, "data", str(block.dtype)
        if isinstance(block, GGUFBlock):
            return cls(rank, name, str(Path(block.path).resolve()), block.tensor,
                       tuple(a for a, _ in block.bounds), tuple(b for _, b in block.bounds),
                       block.ggml_type, dtype, None, block.part,
                       dict(block.to_json(), path=str(Path(block.path).resolve())))
        if isinstance(block, EncodedPart):
            encoding, part = block.fmt.name, block.part
            bounds = block._source_bounds()
            source = block.source
            block = source[tuple(slice(a, b) for a, b in bounds)]
        return cls(rank, name, str(Path(block.path).resolve()), block.key,
                   tuple(a for a, _ in block.bounds), tuple(b for _, b in block.bounds),
                   block.stored_dtype, dtype, encoding, part)


@dataclass(frozen=True)
class Manifest:
    """A bundle's manifest, validated (see the module documentation for the schema)."""

    root: Path
    num_ranks: int
    library: str
    target: dict
    meshes: dict[str, DeviceMesh]
    functions: dict[str, FunctionSignature]
    entries: dict[str, tuple[str | None, ...]]
    weights: dict[str, tuple[str, ...]]
    weight_files: tuple[WeightFile, ...]
    collectives: tuple[str, ...]
    raw: dict
    derivations: dict[str, Derivations] = field(default_factory=dict)
    weight_links: tuple[WeightLink, ...] = ()
    plan: str | None = None
    #: the files beside the library every host needs (see ``program_files`` above)
    program_files: tuple[str, ...] = ()

    @property
    def board_python(self) -> str | None:
        """The bundle's own Python modules for hosts with no tvm-distx (``python``), if any."""
        return "python" if any(f.startswith("python/") for f in self.program_files) else None

    @property
    def library_path(self) -> Path:
        """The absolute path of the bundle's library."""
        return self.root / self.library

    @property
    def plan_path(self) -> Path | None:
        """The absolute path of the bundle's rank plan (None: it has none)."""
        return None if self.plan is None else self.root / self.plan

    def entry(self, function: str, rank: int) -> str | None:
        """The function ``rank`` runs for ``function`` (None: it takes no part)."""
        return self.entries[self.function(function).name][rank]

    def function(self, name: str) -> FunctionSignature:
        """The signature of a public function.

        Raises
        ------
        BundleError
            If the bundle has no such function.
        """
        if name not in self.functions:
            raise BundleError(
                f"the bundle at {self.root} has no function '{name}'",
                hint=f"it has: {', '.join(self.functions)}",
            )
        return self.functions[name]

    def files_of(self, rank: int) -> list[WeightFile]:
        """The weight files of one rank."""
        return [w for w in self.weight_files if w.rank == rank]

    def read_weight(self, rank: int, name: str) -> np.ndarray:
        """Rank ``rank``'s stored shard of weight ``name``, memory-mapped (read on first touch).

        The one place a rank's stored weights are read, whatever the backend;
        :func:`check_weights` checks the files first.
        """
        for w in self.weight_files:
            if w.rank == rank and w.name == name:
                path = self.root / w.file
                return _map_tensor(path, _tensor_table(path, f"rank {rank}'s weights"), name)
        for link in self.weight_links:
            if link.rank == rank and link.name == name:
                return link.lazy().read()
        raise BundleError(f"the bundle at {self.root} stores no weight '{name}' for rank {rank}",
                          hint="export the bundle again")


def sha256_file(path: Path) -> str:
    """The hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _require(data: dict, key: str, kind, where: str):
    if key not in data:
        raise BundleError(f"the manifest has no '{key}' {where}",
                          hint="rebuild the bundle with DistExecutable.export")
    value = data[key]
    if not isinstance(value, kind):
        raise BundleError(f"'{key}' {where} should be a {kind.__name__}, "
                          f"got {type(value).__name__}",
                          hint="rebuild the bundle with DistExecutable.export")
    return value


def read_manifest(bundle: str | os.PathLike) -> Manifest:
    """Read and validate a bundle's ``manifest.json``.

    Parameters
    ----------
    bundle : path
        The bundle directory.

    Returns
    -------
    Manifest

    Raises
    ------
    BundleError
        If the directory or its manifest is missing, the manifest is not JSON, of
        another format or version, lacks a field, has a placement that does not
        fit its mesh, or its library is missing.
    """
    root = Path(bundle)
    path = root / MANIFEST
    if not root.exists():
        raise BundleError(f"{root} does not exist",
                          hint="give the directory DistExecutable.export(dir) wrote",
                          cli_hint="give the directory tvm-distx compile ... -o DIR wrote")
    if not path.is_file():
        raise BundleError(f"{root} is not a tvm-distx bundle: {MANIFEST} is missing",
                          hint="make one with tvm_distx.compile(...).export(dir)",
                          cli_hint="make one with tvm-distx compile MODULE --rules RULES -o DIR")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BundleError(f"{path} is not valid JSON ({err})",
                          hint="the file is corrupt or truncated; export the bundle again") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise BundleError(f"{path} is not a tvm-distx manifest (format "
                          f"{data.get('format') if isinstance(data, dict) else None!r})",
                          hint=f'a manifest starts with "format": "{FORMAT}"')
    version = data.get("version")
    if version != VERSION:
        raise BundleError(
            f"{path} has manifest version {version!r}; this tvm-distx reads version {VERSION}",
            hint="export the bundle again with this version of tvm-distx",
        )
    try:
        return _parse(root, data)
    except BundleError:
        raise
    except (KeyError, TypeError, ValueError) as err:
        raise BundleError(f"{path} is malformed: {type(err).__name__}: {err}",
                          hint="export the bundle again") from None


@contextmanager
def _entry(where: str):
    """Report a malformed part of the manifest by where it is."""
    try:
        yield
    except BundleError:
        raise
    except (KeyError, TypeError, ValueError, IndexError) as err:
        what = f"no field {err}" if type(err) is KeyError else f"{type(err).__name__}: {err}"
        raise BundleError(f"{where} of the manifest is malformed ({what})",
                          hint="export the bundle again") from None


def _parse(root: Path, data: dict) -> Manifest:
    num_ranks = _require(data, "num_ranks", int, "at the top level")
    if num_ranks < 1:
        raise BundleError(f"num_ranks must be positive, got {num_ranks}")
    meshes = {}
    for index, m in enumerate(_require(data, "meshes", list, "at the top level")):
        with _entry(f"mesh {index}"):
            devices = [int(d) for d in m["devices"]]
            mesh = DeviceMesh(tuple(int(n) for n in m["shape"]),
                              range(devices[0], devices[-1] + 1), str(m["name"]))
        if mesh.device_range.stop > num_ranks:
            raise BundleError(f"mesh '{mesh.name}' spans devices {mesh.device_range.start}.."
                              f"{mesh.device_range.stop - 1}, but the bundle has {num_ranks} "
                              "ranks", hint="export the bundle again")
        meshes[mesh.name] = mesh
    functions, entries, weights, derivations = {}, {}, {}, {}
    for name, f in _require(data, "functions", dict, "at the top level").items():
        specs = {}
        for kind in ("params", "results"):
            with _entry(f"function '{name}'"):
                items = list(f[kind])
            for index, p in enumerate(items):
                with _entry(f"{kind[:-1]} {index} of function '{name}'"):
                    if p["mesh"] not in meshes:
                        raise BundleError(
                            f"{kind[:-1]} {index} of function '{name}' is on mesh "
                            f"'{p['mesh']}', which the manifest does not list "
                            f"(it has: {', '.join(meshes) or 'none'})",
                            hint="export the bundle again")
                    spec = TensorSpec.from_json(p, meshes)
                    # a placement that does not fit its mesh or shape would cut the
                    # inputs wrongly, without an error, once the ranks run
                    spec.sharding.placement.validate(
                        spec.sharding.mesh,
                        [None if isinstance(d, str) else d for d in spec.shape], var=spec.name)
                specs.setdefault(kind, []).append(spec)
        feed = f.get("feed", SHARDS)
        if feed not in FEEDS:
            raise BundleError(f"function '{name}' has feed {feed!r}; this tvm-distx knows "
                              f"{', '.join(map(repr, FEEDS))}",
                              hint="export the bundle again with this version of tvm-distx")
        with _entry(f"function '{name}'"):
            functions[name] = FunctionSignature(name, tuple(specs.get("params", ())),
                                                tuple(specs.get("results", ())),
                                                bool(f["tuple_result"]), feed)
            row = tuple(e if e else None for e in f["entries"])
            weights[name] = tuple(str(w) for w in f.get("weights", []))
            derivations[name] = Derivations.from_json(f.get("derived"))
        if len(row) != num_ranks:
            raise BundleError(f"function '{name}' lists {len(row)} entries for {num_ranks} ranks")
        unknown = sorted(set(weights[name]) - {p.name for p in functions[name].params})
        if unknown:
            raise BundleError(f"function '{name}' stores weight(s) {', '.join(map(repr, unknown))}"
                              f", which are not among its parameters", hint="export the bundle again")
        entries[name] = row
    files = []
    for index, f in enumerate(_require(data, "weight_files", list, "at the top level")):
        with _entry(f"weight file {index}"):
            files.extend(WeightFile(int(f["rank"]), str(w["name"]), str(f["file"]),
                                    tuple(int(n) for n in w["shape"]), str(w["dtype"]),
                                    str(f["sha256"])) for w in f["weights"])
    links = []
    for index, w in enumerate(data.get("weight_links", [])):
        with _entry(f"weight link {index}"):
            links.append(WeightLink(int(w["rank"]), str(w["name"]), str(w["checkpoint"]),
                                    str(w["tensor"]), tuple(int(n) for n in w["start"]),
                                    tuple(int(n) for n in w["stop"]), str(w["stored_dtype"]),
                                    str(w["dtype"]), w.get("encoding"),
                                    str(w.get("part", "data")), w.get("gguf")))
    library = _require(data, "library", str, "at the top level")
    _inside(root, library, "the library")
    for w in files:
        _inside(root, w.file, f"weight '{w.name}' of rank {w.rank}")
    if not (root / library).is_file():
        raise BundleError(f"the bundle's library {root / library} is missing",
                          hint="export the bundle again")
    plan = data.get("plan")
    if plan is not None:
        plan = _require(data, "plan", str, "at the top level")
        _inside(root, plan, "the rank plan")
    program = tuple(str(f) for f in data.get("program_files", []))
    for name in program:
        _inside(root, name, "a program file")
    return Manifest(root, num_ranks, library, dict(data.get("target") or {}), meshes,
                    functions, entries, weights, tuple(files),
                    tuple(str(c) for c in data.get("collectives", [])), data, derivations,
                    tuple(links), plan, program)


def _inside(root: Path, relative: str, what: str) -> None:
    """Refuse a manifest path that is absolute or leaves the bundle (``../../bin/ls``)."""
    path = Path(relative)
    if path.is_absolute() or not (root / path).resolve().is_relative_to(root.resolve()):
        raise BundleError(f"{what} is '{relative}', outside the bundle at {root}",
                          hint="a bundle names its files relative to its own directory; "
                          "export the bundle again")


#: ELF ``e_machine`` values of the architectures bundles are built for.
_ELF_MACHINES = {62: "x86_64", 243: "riscv64", 183: "aarch64"}


def check_library(manifest: Manifest) -> None:
    """Check, before any rank starts, that the library is intact and runs on this host.

    Raises
    ------
    BundleError
        If the library is not a shared library, differs from its sha256 in the
        manifest, or was built for another architecture than this host's.
    """

    path = manifest.library_path
    with open(path, "rb") as f:
        header = f.read(20)
    if len(header) < 20 or header[:4] != b"\x7fELF":
        raise BundleError(f"the bundle's library {path} is not a shared library (no ELF header)",
                          hint="the file is corrupt or truncated; export the bundle again")
    order = "little" if header[5] == 1 else "big"
    built_for = _ELF_MACHINES.get(int.from_bytes(header[18:20], order), "another architecture")
    host = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(),
                                                       platform.machine().lower())
    if built_for != host:
        raise BundleError(
            f"the bundle's library was built for {built_for}, and this host is {host}",
            hint=f"run the bundle on a {built_for} machine, or build it for this one "
            f"(tvm_distx.compile(..., target=\"x86\") for x86_64)",
            cli_hint=f"run the bundle on a {built_for} machine, or build it for this one "
            "with tvm-distx compile ... --target x86")
    expected = manifest.raw.get("library_sha256")
    if expected is not None and sha256_file(path) != expected:
        raise BundleError(f"the bundle's library {path} does not match its sha256 in the "
                          "manifest", hint="the file was changed or corrupted; export the bundle "
                          "again")


def check_weights(manifest: Manifest, ranks: Sequence[int] | None = None) -> None:
    """Check the weight files of ``ranks`` (all by default) against the manifest.

    Raises
    ------
    BundleError
        For a stored weight with no file listed, a missing file, a sha256
        mismatch, or a shape or dtype that differs from the manifest's.
    """
    wanted = set(range(manifest.num_ranks) if ranks is None else ranks)
    expected = {(p.name, r): f.input_shape(p, r)
                for f in manifest.functions.values() for p in f.params
                for r in range(manifest.num_ranks) if f.fed(p, r) and not p.symbolic}
    listed = {(w.name, w.rank) for w in (*manifest.weight_files, *manifest.weight_links)}
    for function, stored in manifest.weights.items():
        signature = manifest.functions[function]
        for p in signature.params:
            for r in sorted(wanted):
                if p.name in stored and signature.fed(p, r) and (p.name, r) not in listed:
                    raise BundleError(
                        f"weight '{p.name}' of rank {r} is stored in the bundle, but the "
                        "manifest lists no file for it", hint="export the bundle again")
    for link in manifest.weight_links:
        if link.rank in wanted:
            _check_link(link, expected.get((link.name, link.rank)))
    digests: dict[Path, str] = {}
    for w in manifest.weight_files:
        if w.rank not in wanted:
            continue
        path = manifest.root / w.file
        where = f"weight '{w.name}' of rank {w.rank} ({path})"
        if not path.is_file():
            raise BundleError(f"{where} is missing", hint="export the bundle again")
        if path not in digests:
            digests[path] = sha256_file(path)
        if digests[path] != w.sha256:
            raise BundleError(f"{where} does not match its sha256 in the manifest",
                              hint="the file was changed or corrupted; export the bundle again")
        held = _tensor_table(path, where).get(w.name)
        if held is None:
            raise BundleError(f"{where}: the file holds no tensor '{w.name}'",
                              hint="export the bundle again")
        want = expected.get((w.name, w.rank))
        if want is not None and tuple(want) != w.shape:
            raise BundleError(
                f"{where}: the manifest lists shape {list(w.shape)} but the program's "
                f"parameter '{w.name}' has local shape {list(want)} on rank {w.rank}",
                hint="the manifest was edited; export the bundle again",
            )
        dtype, shape = held[0], held[1]
        if shape != w.shape or dtype != w.dtype:
            raise BundleError(
                f"{where} holds {dtype}{list(shape)}, the manifest says "
                f"{w.dtype}{list(w.shape)}",
                hint="export the bundle again",
            )


def _check_link(link: WeightLink, local_shape) -> None:
    """A linked shard: its checkpoint file has the tensor, and the block fits it and the program."""
    where = f"weight '{link.name}' of rank {link.rank} (tensor {link.tensor} of {link.checkpoint})"
    path = Path(link.checkpoint)
    if not path.is_file():
        raise BundleError(f"{where}: the checkpoint file is missing",
                          hint="the ranks read the checkpoint themselves: it must be at the "
                          "same path on every host")
    if link.gguf is not None:  # the file's tensor table was read when the link was made
        shape, stored = GGUFBlock.from_json(link.gguf).part_shape(), link.stored_dtype
    else:
        shape, stored = _safetensors_block(path, link.tensor, where)
    inside = len(shape) == len(link.start) and all(
        0 <= a <= b <= n for a, b, n in zip(link.start, link.stop, shape))
    if stored != link.stored_dtype or not inside:
        raise BundleError(f"{where}: the checkpoint holds {stored}{list(shape)}, which has no "
                          f"block {list(link.start)}..{list(link.stop)} of {link.stored_dtype}",
                          hint="the checkpoint changed since the bundle was made; make it again")
    if local_shape is not None and tuple(local_shape) != link.shape:
        raise BundleError(f"{where}: the block is {list(link.shape)} but the program's "
                          f"parameter '{link.name}' has local shape {list(local_shape)}",
                          hint="the manifest was edited; export the bundle again")


def _safetensors_block(path: Path, tensor: str, where: str) -> tuple[tuple[int, ...], str]:
    """The shape and stored dtype of ``tensor`` in a safetensors file."""
    try:
        from safetensors import SafetensorError, safe_open

        with safe_open(str(path), framework="numpy") as f:
            part = f.get_slice(tensor)
            shape, stored = tuple(int(d) for d in part.get_shape()), part.get_dtype()
    except (SafetensorError, OSError, ValueError) as err:
        raise BundleError(f"{where} cannot be read ({err})",
                          hint="the checkpoint changed since the bundle was made; make it "
                          "again") from None
    return shape, stored


#: safetensors' dtype names, as numpy's.
_SAFETENSORS_DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16",
                       "I16": "int16", "U32": "uint32", "I32": "int32", "U64": "uint64",
                       "I64": "int64", "F16": "float16", "F32": "float32", "F64": "float64",
                       "BF16": "bfloat16"}


def write_rank_weights(root: Path, rank: int, shards: dict[str, np.ndarray]) -> dict:
    """Write one rank's shards as ``weights/rank<rank>.safetensors`` under ``root``.

    Returns
    -------
    dict
        The file's ``weight_files`` entry for the manifest.
    """
    from safetensors.numpy import save_file

    relative = Path("weights") / f"rank{rank}.safetensors"
    (root / relative).parent.mkdir(parents=True, exist_ok=True)
    # np.asarray(order="C"), unlike np.ascontiguousarray, keeps a 0-d shard 0-d
    save_file({name: np.asarray(a, order="C") for name, a in shards.items()},
              str(root / relative))
    return {"rank": rank, "file": str(relative), "sha256": sha256_file(root / relative),
            "weights": [{"name": name, "shape": list(a.shape), "dtype": str(a.dtype)}
                        for name, a in shards.items()]}


def _tensor_table(path: Path, where: str) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """``{name: (dtype, shape, file offset)}`` of a safetensors file, validated.

    Read by the format's specification (an 8-byte little-endian length, that many
    bytes of JSON naming each tensor's dtype, shape and byte range, then the
    bytes), with no library: a board has numpy and nothing else. Each range must
    lie inside the file and hold exactly its dtype and shape's bytes.
    """
    bad, header = None, {}
    try:
        total = path.stat().st_size
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if 8 + size <= total:
                header = json.loads(f.read(size))
    except (OSError, ValueError) as err:
        bad = str(err)
    if bad is None and not 8 + size <= total:
        bad = f"its header claims {size} bytes of a {total}-byte file"
    elif bad is None and not isinstance(header, dict):
        bad = "its header is not a JSON object"
    table = {}
    for name, info in ({} if bad else header).items():
        if name == "__metadata__":
            continue
        try:
            dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
            shape = tuple(int(n) for n in info["shape"])
            start, stop = (int(n) for n in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as err:
            bad = f"tensor '{name}' has a malformed entry ({type(err).__name__})"
            break
        if dtype is None:
            raise BundleError(f"{where}: tensor '{name}' has dtype {info['dtype']}, which a "
                              "bundle never stores", hint="export the bundle again")
        if not (0 <= start <= stop <= total - 8 - size) or \
                stop - start != int(np.prod(shape)) * numpy_dtype(dtype).itemsize:
            bad = f"tensor '{name}' has bytes {start}..{stop}, which do not fit"
            break
        table[name] = (dtype, shape, 8 + size + start)
    if bad is not None:
        raise BundleError(f"{where} is not a valid safetensors file ({bad})",
                          hint="the file was replaced or corrupted; export the bundle again")
    return table


def _map_tensor(path: Path, table: dict, name: str) -> np.ndarray:
    """Tensor ``name`` of a safetensors file, memory-mapped read-only."""
    if name not in table:
        raise BundleError(f"{path} holds no tensor '{name}'", hint="export the bundle again")
    dtype, shape, offset = table[name]
    if 0 in shape:
        return np.zeros(shape, numpy_dtype(dtype))
    flat = np.memmap(path, dtype=numpy_dtype(dtype), mode="r", offset=offset,
                     shape=(int(np.prod(shape)),))
    return flat.reshape(shape)
