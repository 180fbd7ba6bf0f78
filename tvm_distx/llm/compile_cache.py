"""The compile cache: a model's generation bundle kept between starts, under its key.

``CausalLM.from_pretrained``, ``from_hf`` and ``from_gguf`` (and so ``tvm-distx generate``
and ``serve``) trace, shard and compile a model, which takes tens of seconds for a real
checkpoint. They keep the bundle they compiled in a user cache directory
(``$TVM_DISTX_CACHE``, by default ``~/.cache/tvm-distx``) and open it again on the next
start with the same :class:`CacheKey`, skipping the trace and the compile.
``TVM_DISTX_CACHE=off`` (or ``compile_cache=False``) turns it off.

The key is everything that determines the program and its weights:

* the model (its config), the plan, the rank count, the target (the CPU it was built for),
  the storage (dtype, format), the cache and prompt lengths, the batch;
* the versions: tvm-distx (and a fingerprint of its installed source files, so an edited
  checkout never reuses an old build), TVM, transformers;
* the weights: by their files' identity (path, size, modification time) when the bundle
  links them to a checkpoint or a GGUF file, by a hash of their bytes when the bundle holds
  a copy (``from_hf``), so an entry never serves another model's weights;
* the tokenizer's files, which the bundle carries.

An entry is written to a temporary directory and renamed into place, so a reader never
sees half of one. A corrupt entry (a library or weight file whose sha256 no longer
matches the manifest, which every session checks) is removed and built again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import hashlib
from importlib import metadata
import json
import logging
import os
from pathlib import Path
import shutil
import tempfile
from typing import Any, Callable, Iterable

import numpy as np

from tvm_distx.errors import ArgumentError

__all__ = ["CacheKey", "CompileCache", "bytes_digest", "default_root", "file_identity",
           "source_fingerprint"]

logger = logging.getLogger(__name__)

#: The file in each entry that holds its key's fields (written last: an entry's mark).
ENTRY_FILE = "cache-entry.json"


#: ``TVM_DISTX_CACHE`` set to this turns the cache off.
OFF = "off"


def default_root() -> Path | None:
    """``$TVM_DISTX_CACHE``, else ``$XDG_CACHE_HOME/tvm-distx``, else ``~/.cache/tvm-distx``;
    None when ``TVM_DISTX_CACHE=off``."""
    if os.environ.get("TVM_DISTX_CACHE"):
        if os.environ["TVM_DISTX_CACHE"].strip().lower() == OFF:
            return None
        return Path(os.environ["TVM_DISTX_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tvm-distx"


def file_identity(path: str | os.PathLike) -> dict[str, Any]:
    """A file's identity as a key sees it: its absolute path, size and modification time."""
    path = Path(path).absolute()
    stat = path.stat()
    return {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def bytes_digest(arrays: Iterable[tuple[str, Any]]) -> str:
    """The sha256 of named arrays' names, dtypes, shapes and bytes, in the order given."""
    digest = hashlib.sha256()
    for name, array in arrays:
        array = np.ascontiguousarray(array)
        digest.update(f"{name}:{array.dtype.str}:{array.shape};".encode())
        digest.update(memoryview(array).cast("B"))
    return digest.hexdigest()


def source_fingerprint() -> str:
    """A digest of tvm-distx's installed Python files (paths, sizes, modification times)."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        stat = path.stat()
        digest.update(f"{path.relative_to(package)}:{stat.st_size}:{stat.st_mtime_ns};"
                      .encode())
    return digest.hexdigest()[:16]


def _versions() -> dict[str, str]:
    found = {}
    for name in ("tvm-distx", "apache-tvm", "transformers", "torch"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "-"
    found["tvm-distx source"] = source_fingerprint()
    return found


@dataclass(frozen=True)
class CacheKey:
    """What determines a compiled generation bundle, as JSON-ready fields.

    Parameters
    ----------
    fields : dict
        The model, plan, ranks, target, storage, lengths, weights' identity and
        tokenizer; the versions are added.
    """

    fields: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "fields", {**self.fields, "versions": _versions()})

    @property
    def digest(self) -> str:
        """The entry's name: the sha256 of the fields."""
        text = json.dumps(self.fields, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:32]


class CompileCache:
    """Bundles under their :class:`CacheKey`, in ``root``.

    Parameters
    ----------
    root : path
        The cache directory (see :func:`default_root`).
    """

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root).expanduser()

    @classmethod
    def of(cls, cache) -> "CompileCache | None":
        """The cache a ``cache=`` argument names: True (the default directory), a
        directory, or False/None (no cache).

        Raises
        ------
        ArgumentError
            For anything else.
        """
        if cache is None or cache is False:
            return None
        if cache is True:
            root = default_root()
            return cls(root) if root is not None else None
        if isinstance(cache, (str, os.PathLike)):
            return cls(cache)
        raise ArgumentError(f"cache={cache!r}: give True, False or a directory",
                            hint="cache=True keeps compiled models in ~/.cache/tvm-distx")

    def path(self, key: CacheKey) -> Path:
        """Where ``key``'s entry lives (whether or not it exists)."""
        return self.root / key.digest

    def lookup(self, key: CacheKey) -> Path | None:
        """``key``'s bundle, or None when there is no complete entry for it."""
        entry = self.path(key)
        try:
            stored = json.loads((entry / ENTRY_FILE).read_text())
        except (OSError, ValueError):
            return None
        if stored != json.loads(json.dumps(key.fields, sort_keys=True, default=str)):
            logger.warning("compile cache: %s holds another key; it is built again", entry)
            self.discard(key)
            return None
        return entry

    def store(self, key: CacheKey, write: Callable[[Path], Any]) -> Path:
        """Write ``key``'s entry with ``write(directory)``; its path.

        A failure leaves no entry; so does a concurrent writer that finished first
        (its entry is kept).
        """
        self.root.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{key.digest}-", dir=self.root))
        try:
            write(scratch / "bundle")
            (scratch / "bundle" / ENTRY_FILE).write_text(
                json.dumps(key.fields, sort_keys=True, default=str, indent=1))
            final = self.path(key)
            try:
                (scratch / "bundle").rename(final)
            except OSError:  # another process stored the same key meanwhile
                if self.lookup(key) is None:
                    raise
            logger.info("compile cache: stored %s", final)
            return final
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def discard(self, key: CacheKey) -> None:
        """Remove ``key``'s entry (a corrupt one, before it is built again)."""
        shutil.rmtree(self.path(key), ignore_errors=True)
