"""Device meshes and references to the meshes of a module.

A :class:`DeviceMesh` is an N-D grid of consecutive devices, ``device_range``,
laid out in row-major order over ``shape``. A module lists its meshes in
``global_infos`` (``I.module_global_infos({"mesh": [...]})``) and IR refers to
them as ``"mesh[0]"``, ``"mesh[1]"``; :class:`MeshReference` is such a reference and
:func:`device_meshes` resolves them; :func:`set_device_meshes` gives a module its meshes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, Sequence

from tvm_distx.errors import MeshError, UnknownMeshError

if TYPE_CHECKING:
    import tvm

__all__ = ["DeviceMesh", "MeshReference", "device_meshes", "resolve_mesh", "set_device_meshes"]


def _as_range(value) -> range:
    if isinstance(value, range):
        if value.step != 1:
            raise MeshError(
                f"device_range must be contiguous, got {value!r}",
                hint="write the devices as range(start, stop)",
            )
        return value
    try:
        start, stop = value
    except (TypeError, ValueError):
        raise MeshError(
            f"device_range must be range(start, stop) or a (start, stop) pair, got {value!r}"
        ) from None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, stop)):
        raise MeshError(f"device_range bounds must be integers, got {value!r}")
    return range(start, stop)


@dataclass(frozen=True)
class DeviceMesh:
    """An N-D grid of devices.

    Parameters
    ----------
    shape : tuple of int
        The mesh's extent along each axis, for example ``(2, 2)``.
    device_range : range or (int, int)
        The consecutive global device ids ``[start, stop)`` the mesh covers, laid
        out in row-major order. ``stop - start`` must equal the product of
        ``shape``.
    name : str, optional
        The reference by which the module names this mesh, e.g. ``"mesh[0]"``.
        It is for messages only: two meshes with the same shape and devices are
        equal whatever their names.

    Raises
    ------
    MeshError
        If the shape is empty or has a non-positive extent, or if the device
        range does not hold exactly ``prod(shape)`` non-negative device ids.
    """

    shape: tuple[int, ...]
    device_range: range
    name: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        try:
            shape = tuple(self.shape)
        except TypeError:
            raise MeshError(f"mesh shape must be a tuple of ints, got {self.shape!r}") from None
        if not shape or not all(
            isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape
        ):
            raise MeshError(
                f"mesh shape must be a non-empty tuple of positive ints, got {self.shape!r}",
                hint="a 1-D mesh of 2 devices is DeviceMesh((2,), range(0, 2))",
            )
        devices = _as_range(self.device_range)
        if devices.start < 0:
            raise MeshError(f"device ids must be non-negative, got {devices!r}")
        if len(devices) != math.prod(shape):
            raise MeshError(
                f"mesh shape {shape} holds {math.prod(shape)} devices but device_range "
                f"{devices.start}..{devices.stop} holds {len(devices)}",
                hint=f"use device_range=range({devices.start}, "
                f"{devices.start + math.prod(shape)})",
            )
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "device_range", devices)

    @property
    def ndim(self) -> int:
        """The number of mesh axes."""
        return len(self.shape)

    @property
    def size(self) -> int:
        """The number of devices."""
        return len(self.device_range)

    @property
    def devices(self) -> tuple[int, ...]:
        """The global device ids, in row-major mesh order."""
        return tuple(self.device_range)

    def describe(self) -> str:
        """A short human description: ``"mesh[0]" (shape (2,), devices 0..1)``."""
        span = f"devices {self.device_range.start}..{self.device_range.stop - 1}"
        label = f'"{self.name}" ' if self.name else ""
        return f"{label}(shape {self.shape}, {span})"

    def to_tvm(self):
        """Return the equivalent ``tvm.relax.distributed.DeviceMesh``."""
        from tvm.ir import Range
        from tvm.relax.distributed import DeviceMesh as TVMDeviceMesh

        return TVMDeviceMesh(
            list(self.shape), Range(self.device_range.start, self.device_range.stop)
        )

    @classmethod
    def from_tvm(cls, mesh, name: str | None = None) -> "DeviceMesh":
        """Convert a ``tvm.relax.distributed.DeviceMesh``.

        Raises
        ------
        MeshError
            If the TVM mesh lists devices that are not consecutive.
        """
        ids = [int(i) for i in mesh.device_ids]
        shape = tuple(int(n) for n in mesh.shape)
        if ids and ids != list(range(ids[0], ids[0] + len(ids))):
            raise MeshError(
                f"mesh {name + ' ' if name else ''}lists non-consecutive devices {ids}; tvm_distx needs a "
                "device range",
                hint="renumber the devices so that each mesh covers a range of ids",
            )
        start = ids[0] if ids else 0
        return cls(shape, range(start, start + len(ids)), name)


_MESH_REF = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*\[\s*([0-9]+)\s*\]\s*$")


@dataclass(frozen=True)
class MeshReference:
    """A reference to a mesh of a module's ``global_infos``: ``"mesh[0]"``.

    Parameters
    ----------
    key : str
        The ``global_infos`` key, usually ``"mesh"``.
    index : int
        The position in that list.
    """

    key: str
    index: int

    @classmethod
    def parse(cls, text: "str | MeshReference") -> "MeshReference":
        """Parse ``"mesh[0]"`` (a MeshReference is returned unchanged).

        Raises
        ------
        MeshError
            If ``text`` is not of the form ``name[index]``.
        """
        if isinstance(text, MeshReference):
            return text
        match = _MESH_REF.match(text) if isinstance(text, str) else None
        if match is None:
            raise MeshError(
                f"a mesh reference looks like \"mesh[0]\", got {text!r}",
                hint='name a mesh of the module\'s global_infos, e.g. meshes="mesh[0]"',
            )
        return cls(match.group(1), int(match.group(2)))

    def __str__(self) -> str:
        return f"{self.key}[{self.index}]"


def device_meshes(mod) -> dict[str, DeviceMesh]:
    """Every device mesh in a module's ``global_infos``, keyed by its reference text.

    Parameters
    ----------
    mod : tvm.IRModule
        The module.

    Returns
    -------
    dict of str to DeviceMesh
        For example ``{"mesh[0]": DeviceMesh((2,), range(0, 2), "mesh[0]")}``, in
        ``global_infos`` order.
    """
    from tvm.relax.distributed import DeviceMesh as TVMDeviceMesh

    found: dict[str, DeviceMesh] = {}
    for key, infos in mod.global_infos.items():
        for index, info in enumerate(infos):
            if isinstance(info, TVMDeviceMesh):
                ref = f"{key}[{index}]"
                found[ref] = DeviceMesh.from_tvm(info, ref)
    return found


def set_device_meshes(mod: "tvm.IRModule", shapes: Sequence[Sequence[int]]) -> "tvm.IRModule":
    """``mod`` with device meshes ``mesh[0]``, ``mesh[1]``, ... of these shapes, back to back.

    The meshes take consecutive devices: ``set_device_meshes(mod, [(2,)])`` is one mesh
    of devices 0-1; ``[(2, 2)]`` a 2x2 mesh of devices 0-3; ``[(1,), (1,)]`` two
    pipeline stages on devices 0 and 1. The module's ``"mesh"`` list of
    ``global_infos`` is replaced.

    Parameters
    ----------
    mod : tvm.IRModule
        The module (a copy is changed when it can be cloned).
    shapes : sequence of sequence of int
        The shape of each mesh, in order.

    Returns
    -------
    tvm.IRModule
        The module with its meshes, which sharding rules name ``"mesh[0]"``, ...
    """
    from tvm.ir import Range
    from tvm.relax.distributed import DeviceMesh as TVMDeviceMesh

    meshes, first = [], 0
    for shape in shapes:
        size = math.prod(int(extent) for extent in shape)
        meshes.append(TVMDeviceMesh([int(n) for n in shape], Range(first, first + size)))
        first += size
    out = mod.clone() if hasattr(mod, "clone") else mod
    out.update_global_info("mesh", meshes)
    return out


def resolve_mesh(
    mod,
    ref: str | MeshReference,
    *,
    function: str | None = None,
    var: str | None = None,
    known: Mapping[str, DeviceMesh] | None = None,
):
    """Look a mesh reference up in a module.

    Returns
    -------
    (DeviceMesh, tvm.relax.distributed.DeviceMesh)
        Our description and the module's own TVM object.

    Raises
    ------
    UnknownMeshError
        If the module has no such mesh; the message lists the meshes it has.
    """
    from tvm.relax.distributed import DeviceMesh as TVMDeviceMesh

    ref = MeshReference.parse(ref)
    infos = mod.global_infos.get(ref.key) if ref.key in mod.global_infos else None
    if infos is None or ref.index >= len(infos):
        raise unknown_mesh_error(ref, known if known is not None else device_meshes(mod),
                                 function=function, var=var)
    tvm_mesh = infos[ref.index]
    if not isinstance(tvm_mesh, TVMDeviceMesh):
        raise UnknownMeshError(
            f"\"{ref}\" in the module's global_infos is a {type(tvm_mesh).__name__}, not a "
            "device mesh",
            function=function,
            var=var,
            hint="name one of the module's device meshes: "
            + (", ".join(known if known is not None else device_meshes(mod)) or "none"),
        )
    return DeviceMesh.from_tvm(tvm_mesh, str(ref)), tvm_mesh


def unknown_mesh_error(ref: MeshReference, available, *, function: str | None = None,
                       var: str | None = None) -> UnknownMeshError:
    """The error for a reference to a mesh that ``available`` (reference texts) lacks."""
    return UnknownMeshError(
        f"mesh \"{ref}\" is not in the module's global_infos "
        f"(it has: {', '.join(available) or 'no meshes'})",
        function=function,
        var=var,
        hint='declare it with I.module_global_infos({"mesh": [R.dist.device_mesh((2,), '
        "I.Range(0, 2))]}) or name one of the meshes listed",
    )

