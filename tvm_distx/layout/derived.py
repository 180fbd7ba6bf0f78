"""Derived parameters: a program parameter that is a slice of one of the user's weights.

:class:`tvm_distx.passes.SplitFusedProjections` replaces a fused projection
weight (GPT-2's ``c_attn``, q|k|v; a gate|up pair) by one parameter per
segment, so that each segment can be split across the ranks on its own. The
user still holds the fused weight. A :class:`DerivedParam` says, as plain
data, how one new parameter is cut from it (source name, axis, start, stop),
and :class:`Derivations` applies the cuts to a weights dict wherever weights
are bound: :meth:`tvm_distx.DistExecutable.run`, ``export`` and bundles.

A vocabulary-parallel embedding (:class:`tvm_distx.passes.VocabParallelEmbedding`)
needs each rank's vocabulary offset. The program gets it as one more parameter
that no user holds: :class:`BlockOffsets`, the first index of each of ``p``
equal blocks of the vocabulary, ``arange(p) * (V // p)``. Split ``S[0]`` on the
mesh axis that splits the table, each rank's shard of it *is* its offset, cut
like any weight, so every backend and every per-rank program gets it with no
rank builtin. :class:`Derivations` adds it to every weights dict it binds.

This module imports numpy only: rank processes may use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import numpy as np

from tvm_distx.errors import ArgumentError

__all__ = ["BlockOffsets", "DerivedParam", "Derivations", "block_starts", "host_array",
           "is_deferred"]


@dataclass(frozen=True)
class DerivedParam:
    """A parameter equal to ``source[..., start:stop, ...]`` on ``axis``.

    Parameters
    ----------
    name : str
        The program's parameter.
    source : str
        The user's weight it is cut from.
    source_shape : tuple of int
        The shape the user's weight must have.
    axis : int
        The axis of ``source`` that is sliced (non-negative).
    start, stop : int
        The half-open range taken on ``axis``.

    Raises
    ------
    ArgumentError
        If the name is the source's, or the axis or range does not fit the shape.
    """

    name: str
    source: str
    source_shape: tuple[int, ...]
    axis: int
    start: int
    stop: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "source_shape", tuple(int(d) for d in self.source_shape))
        if not self.name or not self.source or self.name == self.source:
            raise ArgumentError(f"DerivedParam needs a name distinct from its source, got "
                                f"{self.name!r} from {self.source!r}",
                                hint="DerivedParam('w_seg0', 'w', (16, 48), 1, 0, 16)")
        if not 0 <= self.axis < len(self.source_shape):
            raise ArgumentError(f"DerivedParam {self.name!r}: axis {self.axis} is outside "
                                f"{self.source!r}'s shape {list(self.source_shape)}",
                                hint="give a non-negative axis of the source's shape")
        if not 0 <= self.start < self.stop <= self.source_shape[self.axis]:
            raise ArgumentError(f"DerivedParam {self.name!r}: [{self.start}, {self.stop}) is not "
                                f"a non-empty range of axis {self.axis} of {self.source!r} "
                                f"(extent {self.source_shape[self.axis]})",
                                hint="0 <= start < stop <= the axis' extent")

    @property
    def shape(self) -> tuple[int, ...]:
        """The derived parameter's shape."""
        shape = list(self.source_shape)
        shape[self.axis] = self.stop - self.start
        return tuple(shape)

    def take(self, value: np.ndarray) -> np.ndarray:
        """This parameter's slice of the user's weight ``value`` (a contiguous copy).

        Raises
        ------
        ArgumentError
            If ``value`` does not have :attr:`source_shape`.
        """
        if tuple(value.shape) != self.source_shape:
            raise ArgumentError(
                f"weight '{self.source}' has shape {list(value.shape)}, but the program was "
                f"compiled for {list(self.source_shape)} (parameter '{self.name}' is its "
                f"[{self.start}:{self.stop}] on axis {self.axis})",
                hint=f"pass params={{'{self.source}': <array of shape "
                f"{list(self.source_shape)}>}}")
        index = [slice(None)] * value.ndim
        index[self.axis] = slice(self.start, self.stop)
        part = value[tuple(index)]
        return part if is_deferred(part) else np.ascontiguousarray(part)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (see :meth:`from_json`)."""
        return {"name": self.name, "source": self.source, "source_shape": list(self.source_shape),
                "axis": self.axis, "start": self.start, "stop": self.stop}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "DerivedParam":
        """The inverse of :meth:`to_json`."""
        return cls(str(data["name"]), str(data["source"]),
                   tuple(int(d) for d in data["source_shape"]), int(data["axis"]),
                   int(data["start"]), int(data["stop"]))


def block_starts(extent: int, blocks: int) -> np.ndarray:
    """The first index of each of ``blocks`` equal blocks of ``[0, extent)`` (int64).

    Raises
    ------
    ArgumentError
        If ``blocks`` does not divide ``extent``.
    """
    if blocks < 1 or extent % blocks:
        raise ArgumentError(f"block_starts: {extent} does not split into {blocks} equal blocks",
                            hint="give a block count that divides the extent")
    return np.arange(blocks, dtype=np.int64) * (extent // blocks)


@dataclass(frozen=True)
class BlockOffsets:
    """A parameter no user holds: the first index of each block of a split axis.

    Parameters
    ----------
    name : str
        The program's parameter, of shape ``(blocks,)``.
    extent : int
        The extent of the split axis (a vocabulary size).
    blocks : int
        How many equal blocks it is split in (the ranks of the mesh axis).
    dtype : str
        The parameter's dtype (the token ids' dtype).
    """

    name: str
    extent: int
    blocks: int
    dtype: str = "int64"

    def __post_init__(self) -> None:
        if not self.name:
            raise ArgumentError("BlockOffsets needs a name", hint="BlockOffsets('off', 128, 2)")
        block_starts(int(self.extent), int(self.blocks))  # raises when it does not divide

    @property
    def shape(self) -> tuple[int, ...]:
        """The parameter's shape, ``(blocks,)``."""
        return (int(self.blocks),)

    def value(self) -> np.ndarray:
        """``arange(blocks) * (extent // blocks)`` in :attr:`dtype`."""
        return block_starts(int(self.extent), int(self.blocks)).astype(self.dtype)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (see :meth:`from_json`)."""
        return {"kind": "block_offsets", "name": self.name, "extent": int(self.extent),
                "blocks": int(self.blocks), "dtype": self.dtype}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "BlockOffsets":
        """The inverse of :meth:`to_json`."""
        return cls(str(data["name"]), int(data["extent"]), int(data["blocks"]),
                   str(data.get("dtype", "int64")))


@dataclass(frozen=True)
class Derivations:
    """The derived parameters of one function, applied to the user's weights by :meth:`bind`.

    ``params`` are cut from the user's weights; ``made`` are made from the
    layout alone (:class:`BlockOffsets`) and added to every weights dict bound.
    """

    params: tuple[DerivedParam, ...] = ()
    made: tuple[BlockOffsets, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", tuple(self.params))
        object.__setattr__(self, "made", tuple(self.made))
        names = [p.name for p in self.params] + [m.name for m in self.made]
        if len(set(names)) != len(names):
            raise ArgumentError(f"Derivations: a parameter is derived twice ({names})",
                                hint="give each derived parameter once")
        sources = {p.source for p in self.params}
        if sources & set(names):
            raise ArgumentError(f"Derivations: {sorted(sources & set(names))} are both derived "
                                "and a source",
                                hint="derive every parameter from the user's weight directly")

    def __bool__(self) -> bool:
        return bool(self.params or self.made)

    @property
    def sources(self) -> tuple[str, ...]:
        """The user's weights that are cut, in first-use order."""
        return tuple(dict.fromkeys(p.source for p in self.params))

    def merged(self, more: Iterable[DerivedParam],
               more_made: Iterable[BlockOffsets] = ()) -> "Derivations":
        """These derivations and ``more``.

        A parameter of ``more`` cut from one of these derived parameters (a
        segment of a segment) is re-expressed as a cut of the user's weight,
        and the intermediate parameter is dropped.

        Raises
        ------
        ArgumentError
            If the two cuts are on different axes (not one slice).
        """
        out = {p.name: p for p in self.params}
        for p in more:
            parent = out.get(p.source)
            if parent is not None:
                if p.axis != parent.axis:
                    raise ArgumentError(f"Derivations.merged: {p.name!r} cuts {parent.name!r} "
                                        f"on axis {p.axis}, which was cut on axis "
                                        f"{parent.axis}: not one slice of the user's weight",
                                        hint="cut segments on the axis of their parent")
                out.pop(parent.name)
                p = DerivedParam(p.name, parent.source, parent.source_shape, parent.axis,
                                 parent.start + p.start, parent.start + p.stop)
            out[p.name] = p
        made = {m.name: m for m in self.made}
        for m in more_made:
            made[m.name] = m
        return Derivations(tuple(out.values()), tuple(made.values()))

    def bind(self, weights: Mapping[str, Any] | None,
             stored: Iterable[str] = ()) -> dict[str, Any]:
        """``weights`` with every user weight that is cut replaced by its derived parameters.

        Names that are not sources pass through, so weights already given by
        their derived names are accepted too. The parameters made from the
        layout (:attr:`made`) are added, except those in ``stored`` (held in a
        bundle already).

        Raises
        ------
        ArgumentError
            If a weight is given both fused and as one of its segments, or has
            the wrong shape.
        """
        out = dict(weights or {})
        stored = set(stored)
        for m in self.made:  # made from the layout: always the same values
            if m.name not in stored:
                out[m.name] = m.value()
        if not self.params:
            return out
        for source in self.sources:
            if source not in out:
                continue
            parts = [p for p in self.params if p.source == source]
            both = [p.name for p in parts if p.name in out]
            if both:
                raise ArgumentError(
                    f"weight '{source}' is given both whole and as its segment(s) "
                    f"{', '.join(both)}",
                    hint=f"pass only params['{source}'] (the program cuts it itself)")
            value = host_array(out.pop(source))
            for p in parts:
                out[p.name] = p.take(value)
        return out

    def to_json(self) -> list[dict[str, Any]]:
        """A JSON-ready list (see :meth:`from_json`)."""
        return [p.to_json() for p in self.params] + [m.to_json() for m in self.made]

    @classmethod
    def from_json(cls, data: Iterable[Mapping[str, Any]] | None) -> "Derivations":
        """The inverse of :meth:`to_json`; None gives no derivations."""
        items = list(data or ())
        return cls(tuple(DerivedParam.from_json(d) for d in items
                         if d.get("kind", "slice") == "slice"),
                   tuple(BlockOffsets.from_json(d) for d in items
                         if d.get("kind") == "block_offsets"))


def is_deferred(value) -> bool:
    """Whether ``value`` is read only on demand (its type sets ``__distx_deferred__``)."""
    return bool(getattr(type(value), "__distx_deferred__", False))


def host_array(value) -> Any:
    """A weight or input as numpy, or as it is when it is read on demand.

    torch tensors become numpy arrays (no copy when they can share memory);
    a value marked ``__distx_deferred__`` (a
    :class:`tvm_distx.sources.checkpoint.LazyTensor`: it has ``shape``, ``dtype``
    and basic slicing, and is read only by ``np.asarray``) is returned
    untouched, so that cutting it into shards reads one shard at a time;
    anything else goes through ``np.asarray``.
    """
    if is_deferred(value):
        return value
    if hasattr(value, "detach") and hasattr(value, "numpy"):
        value = value.detach().cpu().numpy()
    return np.asarray(value)
