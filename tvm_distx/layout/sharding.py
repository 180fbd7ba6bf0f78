"""The sharding of one value: a mesh and a placement, or not yet known.

This module owns :class:`TensorSharding`, what an ``R.DTensor`` type says about
a tensor, checked when it is built (the placement has one entry per mesh
axis), and its local shape. Propagation also needs to say "nothing decided
yet"; that is :data:`UNKNOWN`, a separate value that is never mistaken for
replication.
"""

from __future__ import annotations

import numbers

from dataclasses import dataclass
from typing import Union

from tvm_distx.errors import UnsupportedValueError
from tvm_distx.layout.mesh import DeviceMesh
from tvm_distx.layout.placement import Placement, Replicate, as_placement

__all__ = ["TensorSharding", "Unknown", "UNKNOWN", "Sharding", "replicated"]


@dataclass(frozen=True)
class TensorSharding:
    """A tensor laid out on ``mesh`` as ``placement``.

    Parameters
    ----------
    mesh : DeviceMesh
    placement : Placement or str
        One entry per mesh axis; text (``"S[0]R"``) is parsed.

    Raises
    ------
    UnsupportedValueError
        If ``mesh`` is not a :class:`~tvm_distx.DeviceMesh`.
    PlacementSyntaxError
        If ``placement`` is text that does not parse.
    PlacementRankError
        If the placement's length differs from the mesh's number of axes.

    Examples
    --------
    >>> TensorSharding(DeviceMesh((2,), range(0, 2)), "S[0]").local_shape((8, 4))
    (4, 4)
    """

    mesh: DeviceMesh
    placement: Placement

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, DeviceMesh):
            raise UnsupportedValueError(
                f"a TensorSharding needs a DeviceMesh, got {type(self.mesh).__name__} "
                f"{self.mesh!r}",
                hint="TensorSharding(DeviceMesh((2,), range(0, 2)), Placement.parse(\"S[0]\"))",
            )
        placement = as_placement(self.placement)
        object.__setattr__(self, "placement", placement)
        placement.validate(self.mesh)

    def local_shape(self, shape):
        """The shape of one device's shard of a tensor of global ``shape``.

        Each mesh axis that shards a dimension divides it; ``None`` (a dynamic
        extent) stays ``None``. Works on ints and on TVM PrimExprs alike (a
        symbolic ``n`` split over 2 devices becomes ``n // 2``). A partial sum
        keeps the full shape.
        """
        local = list(shape)
        for axis, entry in enumerate(self.placement.entries):
            if entry.is_shard() and local[entry.dim] is not None:
                local[entry.dim] = local[entry.dim] // self.mesh.shape[axis]
        if any(not isinstance(d, (numbers.Integral, type(None))) for d in local):
            import tvm  # only symbolic extents need TVM: (n_local * 2) // 2 is n_local

            analyzer = tvm.sym.Analyzer()
            local = [d if isinstance(d, (numbers.Integral, type(None))) else
                     analyzer.simplify(d) for d in local]
        return tuple(local)

    def __str__(self) -> str:
        where = self.mesh.name or f"mesh{self.mesh.shape}@{self.mesh.device_range.start}"
        return f'"{self.placement}" on {where}'

    @classmethod
    def from_type(cls, ty, meshes=None) -> "TensorSharding | None":
        """The sharding an ``R.DTensor`` type carries; None for any other type.

        Parameters
        ----------
        ty : tvm.relax.Type
        meshes : MeshTable, optional
            The module's mesh table; with it the mesh carries the module's name
            for it (``"mesh[0]"``).
        """
        from tvm.relax.distributed import DTensorType

        if not isinstance(ty, DTensorType):
            return None
        mesh = meshes.lookup(ty.device_mesh) if meshes is not None else DeviceMesh.from_tvm(
            ty.device_mesh)
        return cls(mesh, Placement.from_tvm(ty.placement))


class Unknown:
    """No sharding has been decided for a value yet (a singleton: :data:`UNKNOWN`)."""

    _instance: "Unknown | None" = None

    def __new__(cls) -> "Unknown":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNKNOWN"

    def __bool__(self) -> bool:
        return False


UNKNOWN = Unknown()

#: A value's sharding: one TensorSharding, a tuple for tuple-typed values, or UNKNOWN.
Sharding = Union[TensorSharding, tuple, Unknown]


def replicated(mesh: DeviceMesh) -> TensorSharding:
    """The fully replicated sharding on ``mesh``."""
    return TensorSharding(mesh, Placement((Replicate(),) * mesh.ndim))
