"""Generation bundles: what a bundle of ``prefill`` and ``decode`` adds, ``generation.json``.

A generation bundle (:meth:`tvm_distx.llm.causal_lm.CausalLM.export`) is a bundle
whose public functions are an exported decoder's (:mod:`tvm_distx.frontend.decoder`)
and which holds one more file, ``generation.json``::

    {"cache": {"names": [...], "shapes": [[...]], "dtype": "float32",
               "max_length": 38, "masked": false},
     "batch_cache": null or the same for the batched functions,
     "eos_token_id": 2 or [2, 3] or null, "pad_token_id": 0 or null,
     "bytes_per_token": 4096}

This module owns that file and the layout of the key-value cache it describes
(:class:`KVCacheLayout`); the exporter and every runner of a generation bundle (a
session's :class:`~tvm_distx.generation.generator.Generator`, a board's job) read it
here. It imports no TVM.
"""

from __future__ import annotations

from dataclasses import dataclass
import functools
import json
from pathlib import Path

import numpy as np

from tvm_distx.errors import BundleError

__all__ = ["GENERATION_FILE", "KVCacheLayout", "GenerationInfo", "read_generation"]

#: The file of a generation bundle that holds the cache's layout and the model's tokens.
GENERATION_FILE = "generation.json"


@dataclass(frozen=True)
class KVCacheLayout:
    """The key-value cache of an exported decoder: pure data.

    Attributes
    ----------
    names : tuple of str
        The cache parameters in order: ``key_0, value_0, key_1, value_1, ...``.
        They follow ``input_ids`` and ``cache_position`` in both functions, and
        the function's result ``i + 1`` is the new value of ``names[i]``.
    shapes : tuple of tuple of int
        The global shape of each, ``(batch, kv_heads, max_length, head_dim)``.
    dtype : str
        Their element type.
    max_length : int
        The static maximum number of tokens (prompt plus generated ones).
    masked : bool
        Whether the functions also take ``position_ids`` and ``attention_mask``
        after ``cache_position`` (the batched ones, for left-padded prompts).
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtype: str
    max_length: int
    masked: bool = False

    @property
    def batch(self) -> int:
        """The sequences the cache holds (its first axis)."""
        return int(self.shapes[0][0])

    def zeros(self) -> list[np.ndarray]:
        """An empty cache (the state before a prompt), one array per name."""
        return [np.zeros(shape, self.dtype) for shape in self.shapes]

    def nbytes(self) -> int:
        """The bytes the whole cache holds."""
        return sum(int(np.prod(s)) for s in self.shapes) * np.dtype(self.dtype).itemsize

    def to_json(self) -> dict:
        """The layout as ``generation.json`` holds it."""
        return {"names": list(self.names), "shapes": [list(s) for s in self.shapes],
                "dtype": self.dtype, "max_length": self.max_length, "masked": self.masked}

    @classmethod
    def from_json(cls, data: dict) -> "KVCacheLayout":
        """The layout from its ``generation.json`` form."""
        return cls(tuple(str(n) for n in data["names"]),
                   tuple(tuple(int(d) for d in s) for s in data["shapes"]),
                   str(data["dtype"]), int(data["max_length"]), bool(data.get("masked", False)))


@dataclass(frozen=True)
class GenerationInfo:
    """What ``generation.json`` holds (see the module documentation)."""

    cache: KVCacheLayout
    batch_cache: KVCacheLayout | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    bytes_per_token: int = 0

    def write(self, root: str | Path) -> Path:
        """Write ``generation.json`` into the bundle ``root``; returns its path."""
        path = Path(root) / GENERATION_FILE
        path.write_text(json.dumps({
            "cache": self.cache.to_json(),
            "batch_cache": self.batch_cache.to_json() if self.batch_cache else None,
            "eos_token_id": self.eos_token_id, "pad_token_id": self.pad_token_id,
            "bytes_per_token": self.bytes_per_token,
        }, indent=1) + "\n")
        return path


@functools.lru_cache(maxsize=64)
def _read(path: str, _mtime_ns: int, _size: int) -> GenerationInfo:
    """``generation.json`` at ``path``, read once per version of the file in a process (the
    command line, the memory check and the session all ask for it)."""
    data = json.loads(Path(path).read_text())
    batch = data.get("batch_cache")
    return GenerationInfo(KVCacheLayout.from_json(data["cache"]),
                          KVCacheLayout.from_json(batch) if batch else None,
                          data.get("eos_token_id"), data.get("pad_token_id"),
                          int(data.get("bytes_per_token") or 0))


def read_generation(directory: str | Path) -> GenerationInfo:
    """The generation bundle at ``directory``'s ``generation.json``.

    Raises
    ------
    BundleError
        If the directory does not exist, or is not a generation bundle, in one line.
    """
    root = Path(directory)
    if not root.is_dir():
        raise BundleError(f"{directory} does not exist" if not root.exists()
                          else f"{directory} is not a directory",
                          hint="give the directory CausalLM.export(directory) wrote",
                          cli_hint="give a generation bundle, a Hugging Face checkpoint "
                          "directory or a .gguf file")
    path = root / GENERATION_FILE
    if not path.is_file():
        raise BundleError(f"{directory} is not a generation bundle: it has no {GENERATION_FILE}",
                          hint="write one with CausalLM.from_hf(model).export(directory)",
                          cli_hint="write one in Python: CausalLM.from_hf(model)"
                          ".export(directory)")
    try:
        status = path.stat()
        return _read(str(path.resolve()), status.st_mtime_ns, status.st_size)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        what = f"no field {err}" if isinstance(err, KeyError) else type(err).__name__
        raise BundleError(f"{path} is malformed ({what})",
                          hint="export the bundle again with CausalLM.export(directory)") \
            from None
