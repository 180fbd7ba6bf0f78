"""Placements: how a tensor is laid out over the axes of a device mesh.

This module owns the per-axis vocabulary of a sharding and its text form. A
:class:`Placement` holds one entry per mesh axis. Each entry is one of

* :class:`Replicate` (``"R"``): every device along that mesh axis holds the
  whole extent;
* :class:`Shard` ``(dim)`` (``"S[dim]"``): tensor dimension ``dim`` is split
  evenly along that mesh axis;
* :class:`Partial` ``(op="sum")`` (``"P"``): every device along that mesh axis
  holds a full-shape addend; the true value is the sum over the axis's group.
  TVM's DistIR types cannot carry a partial sum, so :meth:`Placement.to_tvm`
  refuses one; partial sums live in the compiler's own data only.

``R`` and ``S[k]`` are TVM DistIR's model and text form: ``"R"``, ``"S[1]"``,
``"S[0]R"`` (entries may also be separated by commas and spaces, as TVM's
printer writes them: ``"S[0], R"``); ``"P"`` extends it (``"PR"``, ``"S[0]P"``).

Examples
--------
>>> p = Placement.parse("S[0]R")
>>> p.entries
(Shard(dim=0), Replicate())
>>> str(p)
'S[0]R'
>>> p.mesh_axes_sharding(0)
(0,)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence, Union

from tvm_distx.errors import (
    IndivisibleShardError,
    PlacementRankError,
    PlacementSyntaxError,
    ShardDimError,
)

if TYPE_CHECKING:  # pragma: no cover
    from tvm_distx.layout.mesh import DeviceMesh

__all__ = ["Replicate", "Shard", "Partial", "Placement", "PlacementLike", "as_placement",
           "PARTIAL_OPS"]

#: The reductions a :class:`Partial` entry may stand for.
PARTIAL_OPS = ("sum",)


@dataclass(frozen=True)
class Replicate:
    """Every device along the mesh axis holds the whole tensor extent."""

    def is_replicate(self) -> bool:
        """Return True: this entry replicates."""
        return True

    def is_shard(self, dim: int | None = None) -> bool:
        """Return False: this entry does not shard any dimension."""
        return False

    def is_partial(self) -> bool:
        """Return False: every device holds the value itself."""
        return False

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Shard:
    """Tensor dimension ``dim`` is split evenly along the mesh axis.

    Parameters
    ----------
    dim : int
        The tensor dimension that is split; non-negative.
    """

    dim: int

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 0:
            raise PlacementSyntaxError(
                f"Shard needs a non-negative integer tensor dimension, got {self.dim!r}",
                hint="write Shard(0) for the first tensor dimension",
            )

    def is_replicate(self) -> bool:
        """Return False: this entry shards."""
        return False

    def is_shard(self, dim: int | None = None) -> bool:
        """Return True if this entry shards ``dim`` (any dimension when ``dim`` is None)."""
        return dim is None or dim == self.dim

    def is_partial(self) -> bool:
        """Return False: a shard holds part of the value itself."""
        return False

    def __str__(self) -> str:
        return f"S[{self.dim}]"


@dataclass(frozen=True)
class Partial:
    """Every device along the mesh axis holds a full-shape addend of the value.

    The true value is the reduction ``op`` of the addends over the mesh axis's
    group (the devices that differ only in their coordinate along the axis).
    ``Partial()`` equals ``Partial("sum")``; its text form is ``"P"``.

    Parameters
    ----------
    op : str
        The reduction; only ``"sum"`` is supported.
    """

    op: str = "sum"

    def __post_init__(self) -> None:
        if self.op not in PARTIAL_OPS:
            raise PlacementSyntaxError(
                f"Partial supports the reductions {', '.join(map(repr, PARTIAL_OPS))}, "
                f"got op={self.op!r}",
                hint='write Partial() (a partial sum, "P" in text)',
            )

    def is_replicate(self) -> bool:
        """Return False: the devices hold different addends."""
        return False

    def is_shard(self, dim: int | None = None) -> bool:
        """Return False: every device holds the full shape."""
        return False

    def is_partial(self) -> bool:
        """Return True: the value is the reduction of the group's addends."""
        return True

    def __str__(self) -> str:
        return "P"


MeshAxisPlacement = Union[Replicate, Shard, Partial]

# One entry of the text form, with optional separators (TVM prints "S[0], R").
_ENTRY = re.compile(r"\s*(?:(R)|(P)|S\[\s*([0-9]+)\s*\])\s*,?")


@dataclass(frozen=True)
class Placement:
    """The placement of a tensor on a device mesh: one entry per mesh axis.

    Parameters
    ----------
    entries : sequence of Replicate, Shard or Partial
        Entry ``i`` says what mesh axis ``i`` does to the tensor. A tensor
        dimension may be sharded by several mesh axes (``"S[0]S[0]"``); it is
        then split by the product of their sizes, major mesh axis first.
    """

    entries: tuple[MeshAxisPlacement, ...]

    def __post_init__(self) -> None:
        entries = tuple(self.entries)
        if not entries:
            raise PlacementSyntaxError(
                "a placement needs at least one entry",
                hint='give one entry per mesh axis, for example "R" for a 1-D mesh',
            )
        for entry in entries:
            if not isinstance(entry, (Replicate, Shard, Partial)):
                raise PlacementSyntaxError(
                    "placement entries must be Replicate(), Shard(dim) or Partial(), got "
                    f"{entry!r}",
                    hint='build placements with Placement.parse("S[0]R")',
                )
        object.__setattr__(self, "entries", entries)

    # ------------------------------------------------------------------ text form
    @classmethod
    def parse(cls, text: str) -> "Placement":
        """Parse TVM's text form, for example ``"S[0]R"`` or ``"S[0], R"``.

        Raises
        ------
        PlacementSyntaxError
            If ``text`` is not a sequence of ``R``, ``P`` and ``S[k]`` entries.
        """
        if not isinstance(text, str):
            raise PlacementSyntaxError(
                f"a placement must be a string such as \"S[0]R\", got {type(text).__name__} {text!r}"
            )
        entries: list[MeshAxisPlacement] = []
        pos = 0
        stripped = text.strip()
        while pos < len(stripped):
            match = _ENTRY.match(stripped, pos)
            if match is None or match.end() == pos:
                raise PlacementSyntaxError(
                    f"cannot parse {text!r} at position {pos}: {stripped[pos:pos + 8]!r}",
                    placement=text,
                    hint='write one entry per mesh axis, each "R", "P" or "S[k]", e.g. "S[0]R"',
                )
            if match.group(1):
                entries.append(Replicate())
            elif match.group(2):
                entries.append(Partial())
            else:
                entries.append(Shard(int(match.group(3))))
            pos = match.end()
        if not entries:
            raise PlacementSyntaxError(
                "the placement is empty",
                placement=text,
                hint='write one entry per mesh axis, e.g. "R" for a replicated tensor on a 1-D mesh',
            )
        return cls(tuple(entries))

    def __str__(self) -> str:
        return "".join(str(entry) for entry in self.entries)

    # ------------------------------------------------------------------ TVM objects
    @classmethod
    def from_tvm(cls, placement) -> "Placement":
        """Convert a ``tvm.relax.distributed.Placement``."""
        entries: list[MeshAxisPlacement] = []
        for spec in placement.dim_specs:
            # PlacementSpecKind: kSharding = 0, kReplica = 1
            entries.append(Replicate() if int(spec.kind) == 1 else Shard(int(spec.axis)))
        return cls(tuple(entries))

    def to_tvm(self):
        """Return the equivalent ``tvm.relax.distributed.Placement``.

        Raises
        ------
        PlacementSyntaxError
            For a placement with a :class:`Partial` entry: TVM's DistIR types
            have no partial sums.
        """
        from tvm.relax.distributed import Placement as TVMPlacement

        if self.has_partial():
            raise PlacementSyntaxError(
                f'placement "{self}" holds a partial sum, which a TVM DTensor type cannot carry',
                placement=str(self),
                hint="reduce it first (redistribute it to R or S[k] on the partial axes); "
                "partial sums exist only between the compiler's own passes",
            )
        return TVMPlacement.from_text(str(self))

    # ------------------------------------------------------------------ queries
    @property
    def ndim(self) -> int:
        """The number of mesh axes this placement describes."""
        return len(self.entries)

    def is_replicated(self) -> bool:
        """True when every mesh axis replicates."""
        return all(entry.is_replicate() for entry in self.entries)

    def has_partial(self) -> bool:
        """True when some mesh axis holds a partial sum."""
        return any(entry.is_partial() for entry in self.entries)

    def partial_axes(self) -> tuple[int, ...]:
        """The mesh axes that hold partial sums, in increasing order."""
        return tuple(i for i, entry in enumerate(self.entries) if entry.is_partial())

    def sharded_dims(self) -> tuple[int, ...]:
        """The tensor dimensions that are sharded, in increasing order, without repeats."""
        return tuple(sorted({entry.dim for entry in self.entries if isinstance(entry, Shard)}))

    def mesh_axes_sharding(self, dim: int) -> tuple[int, ...]:
        """The mesh axes that shard tensor dimension ``dim``, in mesh-axis order."""
        return tuple(i for i, entry in enumerate(self.entries) if entry.is_shard(dim))

    def validate(
        self,
        mesh: "DeviceMesh",
        shape: Sequence[int | None] | None = None,
        *,
        function: str | None = None,
        var: str | None = None,
    ) -> None:
        """Check this placement against a mesh and, when given, a tensor shape.

        Parameters
        ----------
        mesh : DeviceMesh
            The mesh the tensor lives on.
        shape : sequence of int or None, optional
            The tensor's global shape; ``None`` entries are dynamic and are not
            checked for divisibility.
        function, var : str, optional
            Where the placement was found, for the error message.

        Raises
        ------
        PlacementRankError
            The placement's length differs from the mesh's rank.
        ShardDimError
            A sharded dimension is out of range for the tensor.
        IndivisibleShardError
            A static dimension is not divisible by the devices that shard it.
        """
        where = {"function": function, "var": var, "placement": str(self)}
        if self.ndim != mesh.ndim:
            axes = "axis" if mesh.ndim == 1 else "axes"
            example = "".join(["S[0]"] + ["R"] * (mesh.ndim - 1))
            raise PlacementRankError(
                f"the placement has {self.ndim} entries but mesh {mesh.describe()} has "
                f"{mesh.ndim} {axes}",
                hint=f'give one entry (R or S[k]) per mesh axis, for example "{example}"',
                **where,
            )
        if shape is None:
            return
        rank = len(shape)
        for entry in self.entries:
            if isinstance(entry, Shard) and entry.dim >= rank:
                raise ShardDimError(
                    f"S[{entry.dim}] shards dimension {entry.dim}, but the tensor has rank "
                    f"{rank} (shape {tuple(shape)})",
                    hint=f"shard a dimension between 0 and {rank - 1}"
                    if rank
                    else "a scalar cannot be sharded; use R",
                    **where,
                )
        for dim in self.sharded_dims():
            extent = shape[dim]
            parts = 1
            for axis in self.mesh_axes_sharding(dim):
                parts *= mesh.shape[axis]
            if extent is not None and extent % parts != 0:
                raise IndivisibleShardError(
                    f"dimension {dim} has extent {extent}, which does not divide into {parts} "
                    f"equal shards over mesh {mesh.describe()}",
                    hint="pad the tensor, pick another dimension, or use a mesh whose size "
                    f"divides {extent}",
                    **where,
                )


PlacementLike = Union[Placement, str]


def as_placement(value: PlacementLike) -> Placement:
    """Return ``value`` as a :class:`Placement`, parsing it if it is text."""
    if isinstance(value, Placement):
        return value
    return Placement.parse(value)
