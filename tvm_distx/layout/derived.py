"""Derived parameters: a program parameter that is a slice of one of the user's weights.

:class:`tvm_distx.passes.SplitFusedProjections` replaces a fused projection
weight (GPT-2's ``c_attn``, q|k|v; a gate|up pair) by one parameter per
segment, so that each segment can be split across the ranks on its own. The
user still holds the fused weight. A :class:`DerivedParam` says, as plain
data, how one new parameter is cut from it (source name, axis, start, stop),
and :class:`Derivations` applies the cuts to a weights dict wherever weights
are bound: :meth:`tvm_distx.DistExecutable.run`, ``export`` and bundles.

This module imports numpy only: rank processes may use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import numpy as np

from ..errors import ArgumentError

__all__ = ["DerivedParam", "Derivations", "host_array", "is_deferred"]


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


@dataclass(frozen=True)
class Derivations:
    """The derived parameters of one function, applied to the user's weights by :meth:`bind`."""

    params: tuple[DerivedParam, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", tuple(self.params))
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            raise ArgumentError(f"Derivations: a parameter is derived twice ({names})",
                                hint="give each derived parameter once")
        sources = {p.source for p in self.params}
        if sources & set(names):
            raise ArgumentError(f"Derivations: {sorted(sources & set(names))} are both derived "
                                "and a source",
                                hint="derive every parameter from the user's weight directly")

    def __bool__(self) -> bool:
        return bool(self.params)

    @property
    def sources(self) -> tuple[str, ...]:
        """The user's weights that are cut, in first-use order."""
        return tuple(dict.fromkeys(p.source for p in self.params))

    def merged(self, more: Iterable[DerivedParam]) -> "Derivations":
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
        return Derivations(tuple(out.values()))

    def bind(self, weights: Mapping[str, Any] | None) -> dict[str, Any]:
        """``weights`` with every user weight that is cut replaced by its derived parameters.

        Names that are not sources pass through, so weights already given by
        their derived names are accepted too.

        Raises
        ------
        ArgumentError
            If a weight is given both fused and as one of its segments, or has
            the wrong shape.
        """
        out = dict(weights or {})
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
        return [p.to_json() for p in self.params]

    @classmethod
    def from_json(cls, data: Iterable[Mapping[str, Any]] | None) -> "Derivations":
        """The inverse of :meth:`to_json`; None gives no derivations."""
        return cls(tuple(DerivedParam.from_json(d) for d in data or ()))


def is_deferred(value) -> bool:
    """Whether ``value`` is read only on demand (its type sets ``__distx_deferred__``)."""
    return bool(getattr(type(value), "__distx_deferred__", False))


def host_array(value) -> Any:
    """A weight or input as numpy, or as it is when it is read on demand.

    torch tensors become numpy arrays (no copy when they can share memory);
    a value marked ``__distx_deferred__`` (a
    :class:`tvm_distx.runtime.checkpoint.LazyTensor`: it has ``shape``, ``dtype``
    and basic slicing, and is read only by ``np.asarray``) is returned
    untouched, so that cutting it into shards reads one shard at a time;
    anything else goes through ``np.asarray``.
    """
    if is_deferred(value):
        return value
    if hasattr(value, "detach") and hasattr(value, "numpy"):
        value = value.detach().cpu().numpy()
    return np.asarray(value)
