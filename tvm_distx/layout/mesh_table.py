"""The mesh table of a module: each TVM mesh object, our DeviceMesh and its reference.

This module owns the answer to "which mesh of the module is this?". A module
lists its meshes in ``global_infos`` and IR types point at those very objects,
so :class:`MeshTable` finds a TVM mesh by identity (the object's handle), with
the module's reference text (``"mesh[0]"``) as the name of our
:class:`~tvm_distx.DeviceMesh`. A mesh object that is not one of the module's
(made by a pass with ``DeviceMesh.to_tvm``) is found by its shape and devices.
"""

from __future__ import annotations

from typing import Iterator

from tvm_distx.layout.mesh import DeviceMesh

__all__ = ["MeshTable"]


def _handle(obj) -> int:
    return obj.__chandle__()


class MeshTable:
    """The device meshes of one module, built once from its ``global_infos``.

    Parameters
    ----------
    mod : tvm.IRModule
        The module.

    Examples
    --------
    >>> table = MeshTable(mod)                              # doctest: +SKIP
    >>> table.lookup(param.ty.device_mesh).name             # doctest: +SKIP
    'mesh[0]'
    """

    def __init__(self, mod) -> None:
        from tvm.relax.distributed import DeviceMesh as TVMDeviceMesh

        self._by_ref: dict[str, DeviceMesh] = {}
        self._by_handle: dict[int, DeviceMesh] = {}
        self._by_layout: dict[tuple, DeviceMesh] = {}
        self._tvm: dict[tuple, object] = {}
        for key, infos in mod.global_infos.items():
            for index, info in enumerate(infos):
                if not isinstance(info, TVMDeviceMesh):
                    continue
                ref = f"{key}[{index}]"
                mesh = DeviceMesh.from_tvm(info, ref)
                self._by_ref[ref] = mesh
                # the table keeps ``info`` alive (in _tvm), so its handle stays unique
                self._by_handle[_handle(info)] = mesh
                self._by_layout.setdefault(_layout(mesh), mesh)
                self._tvm.setdefault(_layout(mesh), info)

    def lookup(self, tvm_mesh) -> DeviceMesh:
        """Our mesh for a TVM mesh object, named after the module's reference when it has one."""
        found = self._by_handle.get(_handle(tvm_mesh))
        if found is not None:
            return found
        return self.named(DeviceMesh.from_tvm(tvm_mesh))

    def named(self, mesh: DeviceMesh) -> DeviceMesh:
        """The module's own (named) mesh equal to ``mesh``, or ``mesh`` itself."""
        return self._by_layout.get(_layout(mesh), mesh)

    def ref(self, mesh: DeviceMesh) -> str | None:
        """The module's reference text for ``mesh`` (``"mesh[0]"``), or None."""
        known = self._by_layout.get(_layout(mesh))
        return known.name if known is not None else None

    def to_tvm(self, mesh: DeviceMesh):
        """The module's own TVM object for ``mesh``, or a new one when it has none."""
        found = self._tvm.get(_layout(mesh))
        return found if found is not None else mesh.to_tvm()

    def as_dict(self) -> dict[str, DeviceMesh]:
        """Reference text to mesh, in ``global_infos`` order."""
        return dict(self._by_ref)

    def __getitem__(self, ref: str) -> DeviceMesh:
        return self._by_ref[ref]

    def __contains__(self, ref: object) -> bool:
        return ref in self._by_ref

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_ref)

    def __len__(self) -> int:
        return len(self._by_ref)


def _layout(mesh: DeviceMesh) -> tuple:
    return (mesh.shape, mesh.device_range.start)
