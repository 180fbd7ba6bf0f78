"""The sharding of one value: a mesh and a placement, or not yet known.

:class:`TensorSharding` is what an ``R.DTensor`` type says about a tensor.
Propagation also needs to say "nothing decided yet"; that is :data:`UNKNOWN`, a
separate value that is never mistaken for replication.
"""

from __future__ import annotations

import numbers

from dataclasses import dataclass
from typing import Union

from .mesh import DeviceMesh
from .placement import Placement, Replicate

__all__ = ["TensorSharding", "Unknown", "UNKNOWN", "replicated"]


@dataclass(frozen=True)
class TensorSharding:
    """A tensor laid out on ``mesh`` as ``placement``.

    Parameters
    ----------
    mesh : DeviceMesh
    placement : Placement
        One entry per mesh axis.
    """

    mesh: DeviceMesh
    placement: Placement

    def local_shape(self, shape):
        """The shape of one device's shard of a tensor of global ``shape``.

        Each mesh axis that shards a dimension divides it; ``None`` (a dynamic
        extent) stays ``None``. Works on ints and on TVM PrimExprs alike.
        """
        local = list(shape)
        for axis, entry in enumerate(self.placement.entries):
            if entry.is_shard() and local[entry.dim] is not None:
                local[entry.dim] = local[entry.dim] // self.mesh.shape[axis]
        if any(not isinstance(d, (numbers.Integral, type(None))) for d in local):
            import tvm  # a symbolic extent: (n_local * 2) // 2 is n_local

            analyzer = tvm.sym.Analyzer()
            local = [d if isinstance(d, (numbers.Integral, type(None))) else
                     analyzer.simplify(d) for d in local]
        return tuple(local)

    def __str__(self) -> str:
        where = self.mesh.name or f"mesh{self.mesh.shape}@{self.mesh.device_range.start}"
        return f'"{self.placement}" on {where}'

    @classmethod
    def from_type(cls, ty) -> "TensorSharding | None":
        """The sharding an ``R.DTensor`` type carries; None for any other type."""
        from tvm.relax.distributed import DTensorType

        if not isinstance(ty, DTensorType):
            return None
        return cls(DeviceMesh.from_tvm(ty.device_mesh), Placement.from_tvm(ty.placement))


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
