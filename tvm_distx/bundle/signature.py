"""The global view of a distributed function: what goes in and out, and how it is sharded.

A user calls a distributed program with whole (global) arrays. The runtime
needs, for every parameter and result, its global shape, dtype and sharding, to
cut inputs into each device's shard and to put results back together. This is
a :class:`FunctionSignature`, read from the propagated (``R.DTensor``) module
and written into bundle manifests.

A dimension may be symbolic (a run-time extent such as a token count): the
signature then names its variable (``("n", 64)``). One compiled program serves
every size; :meth:`FunctionSignature.bind_sizes` reads the sizes from the
actual inputs, checks them (one value per variable, split extents divisible by
their mesh axes) and gives the concrete signature of that run.

How the ranks receive the inputs is the signature's *feed*:

``"shards"`` (:data:`SHARDS`, ours)
    Each rank's entry takes its own shard of every parameter (our
    ``LowerDistIR``); the runtime cuts the global inputs.
``"worker0"`` (:data:`WORKER0`, TVM's)
    Every rank's entry takes every parameter with its *global* shape, and
    only rank 0's values are read: the program broadcasts and scatters them
    at entry (``runtime.disco.broadcast_from_worker0`` and
    ``scatter_from_worker0``), as TVM's ``LowerDistIR`` lowers it. The
    runtime gives rank 0 the global inputs and the other ranks a placeholder
    of the same shape. Results are each rank's shards in both feeds.

:meth:`FunctionSignature.rank_input` is the one place that says what a rank
is given.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Mapping

import numpy as np

from tvm_distx.sources.formats import numpy_dtype
from tvm_distx.errors import ArgumentError, SymbolicExtentError, UnsupportedProgramError
from tvm_distx.layout import MeshTable, Placement, TensorSharding
from tvm_distx.layout.arrays import shard_array
from tvm_distx.layout.derived import host_array, is_deferred
from tvm_distx.layout.mesh import DeviceMesh

__all__ = ["TensorSpec", "FunctionSignature", "SHARDS", "WORKER0", "FEEDS",
           "weight_bytes_per_rank"]

#: Each rank takes its shard of every parameter (our ``LowerDistIR``).
SHARDS = "shards"
#: Rank 0 takes the global inputs and the program scatters them (TVM's ``LowerDistIR``).
WORKER0 = "worker0"
#: The feeds a signature may have.
FEEDS = (SHARDS, WORKER0)


@dataclass(frozen=True)
class TensorSpec:
    """One parameter or result of a distributed function, in the global view.

    Parameters
    ----------
    name : str
        The parameter's name (``out0``, ``out1``, ... for results).
    shape : tuple of int or str
        The global shape; a symbolic dimension is the name of its variable.
    dtype : str
        The element type.
    sharding : TensorSharding
        Its mesh and placement.
    """

    name: str
    shape: tuple[int | str, ...]
    dtype: str
    sharding: TensorSharding

    def held_by(self, device: int) -> bool:
        """Whether ``device`` holds a shard of this tensor."""
        return device in self.sharding.mesh.device_range

    @cached_property
    def symbolic(self) -> bool:
        """Whether some dimension is a run-time extent."""
        return any(isinstance(d, str) for d in self.shape)

    def specialize(self, sizes: dict[str, int]) -> "TensorSpec":
        """This spec with every symbolic dimension replaced by its size in ``sizes``."""
        shape = tuple(sizes[d] if isinstance(d, str) else d for d in self.shape)
        return TensorSpec(self.name, shape, self.dtype, self.sharding)

    def split_axes(self, dim: int) -> tuple[int, ...]:
        """The mesh axes that split tensor dimension ``dim``."""
        return tuple(axis for axis, entry in enumerate(self.sharding.placement.entries)
                     if entry.is_shard() and entry.dim == dim)

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of one device's shard."""
        return tuple(self.sharding.local_shape(self.shape))

    def to_json(self, meshes: MeshTable) -> dict:
        """A JSON-ready description (the mesh by its reference in the module's ``meshes``).

        A symbolic dimension is its variable's name in ``shape``; ``symbolic``
        lists each with the mesh axes that split it (informative: the placement
        says the same).
        """
        mesh = self.sharding.mesh
        data = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype,
                "mesh": meshes.ref(mesh), "placement": str(self.sharding.placement)}
        if self.symbolic:  # each symbolic dimension: its variable and the mesh axes splitting it
            data["symbolic"] = [{"dim": dim, "var": d, "mesh_axes": list(self.split_axes(dim))}
                                for dim, d in enumerate(self.shape) if isinstance(d, str)]
        return data

    @classmethod
    def from_json(cls, data: dict, meshes: dict[str, DeviceMesh]) -> "TensorSpec":
        """Read :meth:`to_json` back."""
        mesh = meshes[data["mesh"]]
        shape = tuple(n if isinstance(n, str) else int(n) for n in data["shape"])
        return cls(str(data["name"]), shape, str(data["dtype"]),
                   TensorSharding(mesh, Placement.parse(data["placement"])))


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
    feed : {"shards", "worker0"}
        How the ranks receive the inputs (see the module documentation).
    """

    name: str
    params: tuple[TensorSpec, ...]
    results: tuple[TensorSpec, ...]
    tuple_result: bool
    feed: str = SHARDS

    def __post_init__(self) -> None:
        if self.feed not in FEEDS:
            raise ArgumentError(f"'{self.name}' has an unknown feed {self.feed!r}",
                                hint=f"use one of {', '.join(FEEDS)}")

    def fed(self, spec: TensorSpec, device: int) -> bool:
        """Whether ``device`` is given data for parameter ``spec`` (else a placeholder).

        Under ``"shards"`` every device holding ``spec`` gets its shard; under
        ``"worker0"`` device 0 alone gets the global value.
        """
        return spec.held_by(device) and (self.feed == SHARDS or device == 0)

    def input_shape(self, spec: TensorSpec, device: int) -> tuple[int, ...]:
        """The shape of what ``device`` passes for parameter ``spec`` (which it holds)."""
        return spec.local_shape if self.feed == SHARDS else tuple(spec.shape)

    def rank_input(self, spec: TensorSpec, value, device: int) -> np.ndarray:
        """What ``device`` passes for parameter ``spec``, from its global ``value``.

        Its shard (``"shards"``); under ``"worker0"``, the global value on
        device 0 and zeros of the global shape elsewhere (the program reads
        device 0's only). ``value`` is not read for a device that is not
        :meth:`fed`, and may then be None.
        """

        if not self.fed(spec, device):
            return np.zeros(self.input_shape(spec, device), spec.dtype)
        if self.feed == WORKER0:
            return np.ascontiguousarray(host_array(value))
        return shard_array(host_array(value), spec.sharding, device)

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
                cli_hint="give one -i file per input, in parameter order ("
                f"{', '.join(p.name for p in positional) or 'none'}), or -i NAME=PATH; the "
                "weights come from the bundle",
            )
        given = dict(zip((p.name for p in positional), inputs))
        given.update(params)
        return [_checked(spec, given[spec.name], self.name) for spec in self.params]

    @cached_property
    def symbolic(self) -> bool:
        """Whether some parameter or result has a run-time extent (asked on every call)."""
        return any(s.symbolic for s in (*self.params, *self.results))

    @cached_property
    def _without(self) -> dict:
        return {}

    def without(self, names: frozenset[str]) -> "FunctionSignature":
        """This signature without the parameters named in ``names`` (made once per set:
        a session asks for the same one on every call)."""
        found = self._without.get(names)
        if found is None:
            found = self._without[names] = replace(
                self, params=tuple(p for p in self.params if p.name not in names))
        return found

    def specialize(self, sizes: dict[str, int]) -> "FunctionSignature":
        """The concrete signature of a run with symbolic ``sizes``."""
        return replace(self, params=tuple(p.specialize(sizes) for p in self.params),
                       results=tuple(r.specialize(sizes) for r in self.results))

    def bind_sizes(self, inputs, params: dict | None = None
                   ) -> tuple[list[np.ndarray], "FunctionSignature"]:
        """:meth:`bind`, and the concrete signature of this run.

        Returns
        -------
        values : list of numpy.ndarray
            One per parameter, in order.
        concrete : FunctionSignature
            This signature with every symbolic dimension set from ``values``.

        Raises
        ------
        ArgumentError
            As :meth:`bind`.
        SymbolicExtentError
            When a symbolic variable takes two values, or a split symbolic
            extent is not divisible by its mesh axes.
        """
        values = self.bind(inputs, params)
        sizes = self.sizes(values)
        return values, self.specialize(sizes) if sizes else self

    def sizes(self, values) -> dict[str, int]:
        """The value of every symbolic variable, read from the parameters' ``values``."""
        sizes: dict[str, int] = {}
        seen: dict[str, tuple[str, int]] = {}
        for spec, value in zip(self.params, values):
            for dim, extent in enumerate(spec.shape):
                if not isinstance(extent, str):
                    continue
                size = int(np.shape(value)[dim])
                if extent in sizes and sizes[extent] != size:
                    first, first_dim = seen[extent]
                    raise SymbolicExtentError(
                        f"symbolic dimension '{extent}' of '{self.name}' is "
                        f"{sizes[extent]} in '{first}' (dimension {first_dim}) but {size} in "
                        f"'{spec.name}' (dimension {dim})",
                        hint=f"pass inputs whose dimensions named '{extent}' are equal")
                sizes[extent] = size
                seen.setdefault(extent, (spec.name, dim))
                _check_divisible(self.name, spec, dim, size)
        return sizes


def _check_divisible(function: str, spec: TensorSpec, dim: int, size: int) -> None:
    """Refuse a run-time ``size`` of dimension ``dim`` that its mesh axes do not divide."""
    parts = 1
    for axis in spec.split_axes(dim):
        parts *= spec.sharding.mesh.shape[axis]
        if size % parts:
            raise SymbolicExtentError(
                f"input '{spec.name}' of '{function}': dimension {dim} "
                f"('{spec.shape[dim]}') has size {size}, which mesh axis {axis} "
                f"(placement \"{spec.sharding.placement}\") does not split evenly into "
                f"{parts} parts",
                hint=f"pass a size that is a multiple of {parts} (pad the input), or "
                f"replicate dimension {dim}")


def _dims(ty) -> tuple | None:
    """Each dimension of a tensor type: an int, a variable's name, or None (an expression)."""
    import tvm
    from tvm import relax

    tensor = getattr(ty, "tensor_ty", ty)
    if not isinstance(tensor, relax.TensorType) or not isinstance(tensor.shape,
                                                                  relax.ShapeExpr):
        return None
    dims = []
    for v in tensor.shape.values:
        if isinstance(v, tvm.tirx.IntImm):
            dims.append(int(v.value))
        elif isinstance(v, tvm.tirx.Var):
            dims.append(str(v.name))
        else:
            dims.append(None)
    return tuple(dims)


def _spec(name: str, ty, function: str) -> TensorSpec:
    sharding = TensorSharding.from_type(ty)
    shape = _dims(ty)
    if sharding is None or shape is None or None in shape:
        raise UnsupportedProgramError(
            f"'{name}' must be a DTensor whose dimensions are constants or symbolic "
            f"variables to be run, but is {ty}",
            function=function,
            var=name,
            hint="annotate every input of the entry function (or give it a default mesh) "
            "and give each dimension a constant or a variable (R.Tensor((\"n\", 64)))",
        )
    return TensorSpec(name, shape, str(ty.tensor_ty.dtype), sharding)


def _checked(spec: TensorSpec, value, function: str) -> np.ndarray:
    array = host_array(value)  # a tensor read on demand stays unread: only its shape is checked
    if not _fits(tuple(array.shape), spec.shape):
        raise ArgumentError(
            f"input '{spec.name}' of '{function}' has shape {tuple(array.shape)}, "
            f"expected {spec.shape}",
        )
    if array.dtype != np.dtype(spec.dtype):
        raise ArgumentError(
            f"input '{spec.name}' of '{function}' has dtype {array.dtype}, "
            f"expected {spec.dtype}",
            hint=f"convert it with .astype('{spec.dtype}')",
            cli_hint=f"save it as {spec.dtype}: np.save(path, array.astype('{spec.dtype}'))",
        )
    if is_deferred(array):
        return array
    return np.ascontiguousarray(array)


def _fits(shape: tuple[int, ...], expected: tuple) -> bool:
    return len(shape) == len(expected) and all(
        isinstance(e, str) or e == s for s, e in zip(shape, expected))


def weight_bytes_per_rank(signatures: Mapping[str, "FunctionSignature"], weights,
                          num_ranks: int) -> list[int]:
    """The bytes of the weights each rank holds, each weight counted once across functions.

    Parameters
    ----------
    signatures : mapping of str to FunctionSignature
        The public functions.
    weights : collection of str
        The parameter names that are weights (not inputs).
    num_ranks : int
        The ranks.
    """
    out, seen = [0] * num_ranks, set()
    for signature in signatures.values():
        for spec in signature.params:
            if spec.name not in weights or spec.name in seen:
                continue
            seen.add(spec.name)
            size = numpy_dtype(spec.dtype).itemsize
            for rank in range(num_ranks):
                if signature.fed(spec, rank):
                    out[rank] += int(np.prod(signature.input_shape(spec, rank),
                                             dtype=np.int64)) * size
    return out

