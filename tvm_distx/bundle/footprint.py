"""The bytes each rank of a bundle holds while it runs: :func:`rank_bytes`.

A rank holds, at its largest:

weights
    Its shards of the weights the bundle stores or links (exact: the manifest's
    signatures, :func:`~tvm_distx.bundle.signature.weight_bytes_per_rank`).
cache
    Its shard of the key-value cache at ``max_length``, for a generation bundle
    (exact: the cache's layout in ``generation.json``, sharded as the functions
    take it). The larger of the one-prompt and the batched cache: a rank holds one
    of them at a time.
activations
    An estimate, for the function that needs the most, with every symbolic extent
    (a prompt's length) at the most tokens one call takes (``tokens=``: a runner
    prefills a long prompt in chunks; by default ``max_length``, and 1 in a bundle
    without generation settings). It adds up:

    * the rank's shards of the call's run-time inputs other than the cache, and of
      its results, twice (the values the call passes between its kernels take about
      as many bytes again: the virtual machine reuses the storage of a dead value);
    * a new cache that the call returns, once (beside the old one it replaces);
    * for a generation bundle, the values one decoder layer makes for the call's
      tokens, twice (a layer's and the next one's are alive together): the call's
      tokens (the elements of its first input, ``input_ids``) times, for each weight
      matrix the rank holds, its wider side (the most values it makes, or takes,
      per token), summed over the matrices and divided by the layers (half the cache
      names), at 4 bytes. For a Llama this is each token's query, key, value,
      attention output, gate, up and down projections of one layer (an LM head or
      embedding is spread over the layers; attention scores are not counted, as the
      attention kernel goes over tiles of keys).

The rank process itself (Python, numpy, TVM's runtime) costs more on top; that
figure belongs to the runtime (:data:`tvm_distx.runtime.memory.RANK_RUNTIME_BYTES`).
"""

from __future__ import annotations

from dataclasses import dataclass
import os

import numpy as np

from tvm_distx.bundle.generation import GENERATION_FILE, KVCacheLayout, read_generation
from tvm_distx.bundle.manifest import Manifest, read_manifest
from tvm_distx.bundle.signature import FunctionSignature, TensorSpec, weight_bytes_per_rank
from tvm_distx.sources.formats import numpy_dtype

__all__ = ["RankBytes", "rank_bytes"]


@dataclass(frozen=True)
class RankBytes:
    """What one rank of a bundle holds (see the module documentation).

    Attributes
    ----------
    rank : int
    weights, cache, activations : int
        Bytes.
    """

    rank: int
    weights: int
    cache: int
    activations: int

    @property
    def total(self) -> int:
        """The three together."""
        return self.weights + self.cache + self.activations


def _nbytes(shape, dtype: str) -> int:
    return int(np.prod(shape, dtype=np.int64)) * numpy_dtype(dtype).itemsize


def _held(signature: FunctionSignature, spec: TensorSpec, rank: int, sizes: dict,
          param: bool) -> int:
    """The bytes of ``rank``'s part of ``spec`` (a parameter or a result) at ``sizes``."""
    if spec.symbolic:
        spec = spec.specialize({d: sizes.get(d, 1) for d in spec.shape if isinstance(d, str)})
    if param:
        return _nbytes(signature.input_shape(spec, rank), spec.dtype) \
            if signature.fed(spec, rank) else 0
    return _nbytes(spec.local_shape, spec.dtype) if spec.held_by(rank) else 0


def _cache_bytes(manifest: Manifest, layout: KVCacheLayout | None, rank: int) -> int:
    """``rank``'s shard of the cache ``layout``, as the first function taking it (its names,
    of its shapes) holds it."""
    if layout is None:
        return 0
    for signature in manifest.functions.values():
        specs = {p.name: p for p in signature.params}
        if all(name in specs and tuple(specs[name].shape) == tuple(shape)
               for name, shape in zip(layout.names, layout.shapes)):
            return sum(_held(signature, specs[name], rank, {}, True) for name in layout.names)
    return 0


def rank_bytes(bundle: str | os.PathLike | Manifest, *,
               tokens: int | None = None) -> list[RankBytes]:
    """The bytes each rank of ``bundle`` holds at its largest, by rank.

    Parameters
    ----------
    bundle : path or Manifest
        A bundle (a generation bundle's cache and ``max_length`` are counted too).
    tokens : int, optional
        The most tokens one call takes (the prefill's chunk), at most ``max_length``;
        by default ``max_length``.

    Raises
    ------
    BundleError
        For a bundle whose manifest or ``generation.json`` is malformed.
    """
    manifest = bundle if isinstance(bundle, Manifest) else read_manifest(bundle)
    layouts: list[KVCacheLayout] = []
    if (manifest.root / GENERATION_FILE).is_file():
        info = read_generation(manifest.root)
        layouts = [info.cache] + ([info.batch_cache] if info.batch_cache else [])
    max_length = max((c.max_length for c in layouts), default=1)
    extent = min(tokens, max_length) if tokens is not None and layouts else max_length
    caches = {name for c in layouts for name in c.names}
    stored = {w for names in manifest.weights.values() for w in names}
    weights = weight_bytes_per_rank(manifest.functions, stored, manifest.num_ranks)
    out = []
    for rank in range(manifest.num_ranks):
        cache = max((_cache_bytes(manifest, c, rank) for c in layouts), default=0)
        busiest = 0
        for signature in manifest.functions.values():
            sizes = {d: extent for s in (*signature.params, *signature.results)
                     for d in s.shape if isinstance(d, str)}
            inputs = sum(_held(signature, p, rank, sizes, True) for p in signature.params
                         if p.name not in stored and p.name not in caches)
            new_cache = sum(_held(signature, r, rank, sizes, False)
                            for r, name in _results_named(signature, caches))
            results = sum(_held(signature, r, rank, sizes, False)
                          for r in signature.results) - new_cache
            layer = _layer_bytes(signature, rank, sizes, stored, caches, layouts)
            busiest = max(busiest, 2 * (inputs + results + layer) + new_cache)
        out.append(RankBytes(rank, weights[rank], cache, busiest))
    return out


def _layer_bytes(signature: FunctionSignature, rank: int, sizes: dict, stored: set[str],
                 caches: set[str], layouts: list[KVCacheLayout]) -> int:
    """The values one decoder layer makes for the call's tokens (see the module
    documentation); 0 outside a generation bundle."""
    layers = max((len(c.names) // 2 for c in layouts), default=0)
    first = next((p for p in signature.params if p.name not in stored and p.name not in caches),
                 None)
    if not layers or first is None:
        return 0
    tokens = int(np.prod([sizes.get(d, 1) if isinstance(d, str) else d for d in first.shape],
                         dtype=np.int64))
    wide = sum(max(signature.input_shape(p, rank)[-2:]) for p in signature.params
               if p.name in stored and len(p.shape) >= 2 and signature.fed(p, rank))
    return tokens * wide // layers * 4


def _results_named(signature: FunctionSignature, caches: set[str]):
    """The results that are a new value of a cache parameter: ``(spec, name)`` pairs.

    A generation function returns the new value of cache parameter ``i`` of its
    cache parameters as result ``i + 1`` (:class:`~tvm_distx.bundle.generation.KVCacheLayout`).
    """
    names = [p.name for p in signature.params if p.name in caches]
    return [(signature.results[i + 1], name) for i, name in enumerate(names)
            if i + 1 < len(signature.results)]
