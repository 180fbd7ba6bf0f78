"""The global view of a distributed function: what goes in and out, and how it is sharded.

A user calls a distributed program with whole (global) arrays. The runtime
needs, for every parameter and result, its global shape, dtype and sharding, to
cut inputs into each device's shard and to put results back together. This is
a :class:`FunctionSignature`, read from the propagated (``R.DTensor``) module
and written into bundle manifests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import ArgumentError, UnsupportedProgramError
from .layout import Placement, TensorSharding
from .mesh import DeviceMesh

__all__ = ["TensorSpec", "FunctionSignature"]


@dataclass(frozen=True)
class TensorSpec:
    """One parameter or result of a distributed function, in the global view.

    Parameters
    ----------
    name : str
        The parameter's name (``out0``, ``out1``, ... for results).
    shape : tuple of int
        The global static shape.
    dtype : str
        The element type.
    sharding : TensorSharding
        Its mesh and placement.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    sharding: TensorSharding

    def held_by(self, device: int) -> bool:
        """Whether ``device`` holds a shard of this tensor."""
        return device in self.sharding.mesh.device_range

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of one device's shard."""
        return tuple(self.sharding.local_shape(self.shape))

    def to_json(self, mesh_names: dict[tuple, str]) -> dict:
        """A JSON-ready description (the mesh by its name in ``mesh_names``)."""
        mesh = self.sharding.mesh
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype,
                "mesh": mesh_names[_mesh_key(mesh)], "placement": str(self.sharding.placement)}

    @classmethod
    def from_json(cls, data: dict, meshes: dict[str, DeviceMesh]) -> "TensorSpec":
        """Read :meth:`to_json` back."""
        mesh = meshes[data["mesh"]]
        return cls(str(data["name"]), tuple(int(n) for n in data["shape"]), str(data["dtype"]),
                   TensorSharding(mesh, Placement.parse(data["placement"])))


def _mesh_key(mesh: DeviceMesh) -> tuple:
    return (mesh.shape, mesh.device_range.start)


@dataclass(frozen=True)
class FunctionSignature:
    """The parameters and results of one public distributed function.

    Parameters
    ----------
    name : str
        The function's name in the global-view module.
    params : tuple of TensorSpec
        In order.
    results : tuple of TensorSpec
        One per result tensor (a tuple result lists its fields).
    tuple_result : bool
        Whether the function returns a tuple.
    """

    name: str
    params: tuple[TensorSpec, ...]
    results: tuple[TensorSpec, ...]
    tuple_result: bool

    @classmethod
    def from_function(cls, name: str, func) -> "FunctionSignature":
        """Read the signature of a propagated (``R.DTensor``-typed) Relax function.

        Raises
        ------
        UnsupportedProgramError
            For a parameter or result that is not a DTensor of static shape.
        """
        from tvm import relax

        params = tuple(_spec(p.name, p.ty, name) for p in func.params)
        ret = func.ty.ret
        if isinstance(ret, relax.TupleType):
            results = tuple(_spec(f"out{i}", f, name) for i, f in enumerate(ret.fields))
            return cls(name, params, results, True)
        return cls(name, params, (_spec("out0", ret, name),), False)

    def bind(self, inputs, params: dict | None = None) -> list[np.ndarray]:
        """Match positional ``inputs`` and named ``params`` to the parameters, checked.

        Parameters given by name in ``params`` are skipped by the positional
        inputs, which fill the others in order. numpy arrays, torch tensors and
        anything ``np.asarray`` takes are accepted.

        Raises
        ------
        ArgumentError
            For a missing, unknown, extra or wrongly shaped or typed argument.
        """
        params = dict(params or {})
        names = [p.name for p in self.params]
        unknown = sorted(set(params) - set(names))
        if unknown:
            raise ArgumentError(
                f"'{self.name}' has no parameter named {', '.join(unknown)}",
                hint=f"its parameters are {', '.join(names)}",
            )
        positional = [p for p in self.params if p.name not in params]
        if len(inputs) != len(positional):
            raise ArgumentError(
                f"'{self.name}' takes {len(positional)} positional input(s) "
                f"({', '.join(p.name for p in positional) or 'none'}), got {len(inputs)}",
                hint="pass weights by name in params= and the other inputs in order",
            )
        given = dict(zip((p.name for p in positional), inputs))
        given.update(params)
        return [_checked(spec, given[spec.name], self.name) for spec in self.params]


def _spec(name: str, ty, function: str) -> TensorSpec:
    from tvm_distx import _ir

    sharding = TensorSharding.from_type(ty)
    shape = _ir.static_shape(ty)
    if sharding is None or shape is None or None in shape:
        raise UnsupportedProgramError(
            f"'{name}' must be a DTensor with a static shape to be run, but is {ty}",
            function=function,
            var=name,
            hint="annotate every input of the entry function (or give it a default mesh) "
            "and use static shapes",
        )
    return TensorSpec(name, tuple(shape), str(ty.tensor_ty.dtype), sharding)


def _checked(spec: TensorSpec, value, function: str) -> np.ndarray:
    if hasattr(value, "detach") and hasattr(value, "numpy"):  # a torch tensor
        value = value.detach().cpu().numpy()
    array = np.asarray(value)
    if tuple(array.shape) != spec.shape:
        raise ArgumentError(
            f"input '{spec.name}' of '{function}' has shape {tuple(array.shape)}, "
            f"expected {spec.shape}",
        )
    if array.dtype != np.dtype(spec.dtype):
        raise ArgumentError(
            f"input '{spec.name}' of '{function}' has dtype {array.dtype}, "
            f"expected {spec.dtype}",
            hint=f"convert it with .astype('{spec.dtype}')",
        )
    return np.ascontiguousarray(array)
