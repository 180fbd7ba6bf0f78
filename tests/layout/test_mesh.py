"""Unit tests for tvm_distx.layout.mesh: DeviceMesh, MeshReference, device_meshes, resolve_mesh.

TVM's DeviceMesh objects are compared through ``.shape`` and ``.device_ids`` as
Python lists: ``same_as`` / ``==`` on them recurse without end in this TVM build.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tvm
from tvm.relax.distributed import DeviceMesh as TVMDeviceMesh
from tvm.script import ir as I
from tvm.script import relax as R

import tvm_distx as td
from tvm_distx import DeviceMesh
from tvm_distx.errors import MeshError, ShardingError, UnknownMeshError
from tvm_distx.layout.mesh import MeshReference
from tvm_distx.layout import MeshTable, TensorSharding
from tvm_distx.layout.mesh import device_meshes, resolve_mesh
from locations import TESTS_DIR

DATA = TESTS_DIR / "data"


def tvm_ids(mesh) -> list[int]:
    return [int(i) for i in mesh.device_ids]


def tvm_shape(mesh) -> list[int]:
    return [int(n) for n in mesh.shape]


@pytest.fixture(scope="module")
def pipeline():
    return td.load_module(DATA / "seed_pipeline.py")


@pytest.fixture(scope="module")
def mesh2x2():
    return td.load_module(DATA / "seed_mesh2x2.py")


@pytest.fixture(scope="module")
def no_mesh_module():
    @I.ir_module
    class NoMesh:
        @R.function
        def main(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):
            return x

    return NoMesh


@pytest.fixture(scope="module")
def vdevice_module():
    @I.ir_module
    class WithVDevice:
        I.module_global_infos({"vdevice": [I.vdevice("llvm")]})

        @R.function
        def main(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):
            return x

    return WithVDevice


# ---------------------------------------------------------------------------- DeviceMesh


class TestDeviceMeshConstruction:
    def test_basic_properties(self):
        mesh = DeviceMesh((2, 3), range(4, 10), "mesh[1]")
        assert mesh.shape == (2, 3)
        assert mesh.device_range == range(4, 10)
        assert mesh.name == "mesh[1]"
        assert mesh.ndim == 2
        assert mesh.size == 6
        assert mesh.devices == (4, 5, 6, 7, 8, 9)

    def test_shape_list_is_normalised_to_tuple(self):
        mesh = DeviceMesh([2, 2], range(0, 4))
        assert mesh.shape == (2, 2)
        assert isinstance(mesh.shape, tuple)

    @pytest.mark.parametrize("pair, expected", [((0, 4), range(0, 4)), ([3, 7], range(3, 7))])
    def test_start_stop_pair_becomes_a_range(self, pair, expected):
        mesh = DeviceMesh((4,), pair)
        assert isinstance(mesh.device_range, range)
        assert mesh.device_range == expected

    @pytest.mark.parametrize("shape", [(), (0,), (2, -1), "ab", (True,), (2.0,), 4, None, (2, None)])
    def test_bad_shapes(self, shape):
        with pytest.raises(MeshError) as info:
            DeviceMesh(shape, range(0, 2))
        assert "mesh shape must be" in str(info.value)
        assert repr(shape) in str(info.value)
        assert isinstance(info.value, ShardingError) and isinstance(info.value, ValueError)

    def test_wrong_device_count(self):
        with pytest.raises(MeshError) as info:
            DeviceMesh((2, 2), range(0, 3))
        text = str(info.value)
        assert "mesh shape (2, 2) holds 4 devices but device_range 0..3 holds 3" in text
        assert "hint: use device_range=range(0, 4)" in text

    def test_wrong_device_count_hint_keeps_the_start(self):
        with pytest.raises(MeshError, match=r"use device_range=range\(2, 4\)"):
            DeviceMesh((2,), (2, 5))

    def test_negative_start(self):
        with pytest.raises(MeshError, match="device ids must be non-negative"):
            DeviceMesh((2,), range(-1, 1))
        with pytest.raises(MeshError, match="device ids must be non-negative"):
            DeviceMesh((2,), (-2, 0))

    @pytest.mark.parametrize("devices", [range(0, 4, 2), range(3, -1, -1)])
    def test_non_unit_step(self, devices):
        with pytest.raises(MeshError, match="device_range must be contiguous"):
            DeviceMesh((2,), devices)

    @pytest.mark.parametrize("devices", [5, (0, 1, 2), "ab", None, (0.0, 2.0), (False, True)])
    def test_bad_device_range_values(self, devices):
        with pytest.raises(MeshError) as info:
            DeviceMesh((2,), devices)
        assert "device_range" in str(info.value)

    def test_empty_range(self):
        with pytest.raises(MeshError, match="holds 0"):
            DeviceMesh((2,), (4, 2))


class TestDeviceMeshValue:
    def test_equality_ignores_the_name(self):
        a = DeviceMesh((2,), range(0, 2), "mesh[0]")
        b = DeviceMesh((2,), (0, 2), "other[7]")
        assert a == b
        assert hash(a) == hash(b)

    def test_equality_uses_shape_and_devices(self):
        base = DeviceMesh((2, 2), range(0, 4))
        assert base != DeviceMesh((4,), range(0, 4))
        assert base != DeviceMesh((2, 2), range(4, 8))

    def test_frozen(self):
        mesh = DeviceMesh((2,), range(0, 2))
        with pytest.raises(AttributeError):
            mesh.shape = (4,)  # type: ignore[misc]

    def test_describe_with_and_without_name(self):
        assert DeviceMesh((2,), range(0, 2), "mesh[0]").describe() == (
            '"mesh[0]" (shape (2,), devices 0..1)'
        )
        assert DeviceMesh((2, 2), range(4, 8)).describe() == "(shape (2, 2), devices 4..7)"


class TestDeviceMeshTVM:
    @pytest.mark.parametrize(
        "shape, devices",
        [((2, 2), range(0, 4)), ((4,), range(3, 7)), ((1,), range(1, 2)), ((2, 1, 3), range(0, 6))],
    )
    def test_to_tvm(self, shape, devices):
        theirs = DeviceMesh(shape, devices).to_tvm()
        assert isinstance(theirs, TVMDeviceMesh)
        assert tvm_shape(theirs) == list(shape)
        assert tvm_ids(theirs) == list(devices)

    @pytest.mark.parametrize(
        "shape, devices",
        [((2, 2), range(0, 4)), ((4,), range(3, 7)), ((1,), range(1, 2)), ((2, 1, 3), range(0, 6))],
    )
    def test_round_trip(self, shape, devices):
        ours = DeviceMesh(shape, devices)
        back = DeviceMesh.from_tvm(ours.to_tvm(), "mesh[2]")
        assert back == ours
        assert back.shape == shape
        assert back.device_range == devices
        assert back.name == "mesh[2]"

    def test_from_tvm_with_a_range(self):
        theirs = TVMDeviceMesh((2, 2), tvm.ir.Range(0, 4))
        ours = DeviceMesh.from_tvm(theirs)
        assert ours.shape == (2, 2)
        assert ours.device_range == range(0, 4)
        assert ours.name is None
        again = ours.to_tvm()
        assert tvm_shape(again) == tvm_shape(theirs)
        assert tvm_ids(again) == tvm_ids(theirs)

    def test_from_tvm_with_a_consecutive_id_list(self):
        ours = DeviceMesh.from_tvm(TVMDeviceMesh((2,), [4, 5]))
        assert ours.device_range == range(4, 6)

    @pytest.mark.parametrize("ids", [[0, 2, 5], [2, 1, 0], [0, 1, 3]])
    def test_from_tvm_rejects_non_consecutive_ids(self, ids):
        theirs = TVMDeviceMesh((3,), ids)
        with pytest.raises(MeshError) as info:
            DeviceMesh.from_tvm(theirs, "mesh[3]")
        text = str(info.value)
        assert f"mesh mesh[3] lists non-consecutive devices {ids}" in text
        assert "hint: renumber the devices" in text


# ---------------------------------------------------------------------------- MeshReference


class TestMeshRef:
    @pytest.mark.parametrize(
        "text, key, index",
        [
            ("mesh[0]", "mesh", 0),
            ("mesh[12]", "mesh", 12),
            ("  mesh [ 1 ] ", "mesh", 1),
            ("stage_2[3]", "stage_2", 3),
            ("_m[0]", "_m", 0),
            ("mesh[007]", "mesh", 7),
        ],
    )
    def test_parse(self, text, key, index):
        ref = MeshReference.parse(text)
        assert ref == MeshReference(key, index)
        assert ref.key == key and ref.index == index

    def test_str(self):
        assert str(MeshReference("mesh", 3)) == "mesh[3]"
        assert str(MeshReference.parse(" mesh[ 02 ] ")) == "mesh[2]"

    @pytest.mark.parametrize(
        "text", ["mesh", "mesh[x]", "mesh[]", "mesh[-1]", "[0]", "0mesh[0]", "mesh[0]x", "", 3, None]
    )
    def test_bad_references(self, text):
        with pytest.raises(MeshError) as info:
            MeshReference.parse(text)  # type: ignore[arg-type]
        text_out = str(info.value)
        assert f'a mesh reference looks like "mesh[0]", got {text!r}' in text_out
        assert "hint:" in text_out

    def test_hashable_value(self):
        assert len({MeshReference("mesh", 0), MeshReference.parse("mesh[0]"), MeshReference("mesh", 1)}) == 2


# ---------------------------------------------------------------------------- modules


class TestModuleMeshes:
    def test_pipeline_has_two_one_device_meshes(self, pipeline):
        meshes = device_meshes(pipeline)
        assert list(meshes) == ["mesh[0]", "mesh[1]"]
        assert meshes["mesh[0]"] == DeviceMesh((1,), range(0, 1))
        assert meshes["mesh[1]"] == DeviceMesh((1,), range(1, 2))
        assert meshes["mesh[0]"].name == "mesh[0]"
        assert meshes["mesh[1]"].name == "mesh[1]"

    def test_2x2_module(self, mesh2x2):
        meshes = device_meshes(mesh2x2)
        assert list(meshes) == ["mesh[0]"]
        assert meshes["mesh[0]"].shape == (2, 2)
        assert meshes["mesh[0]"].devices == (0, 1, 2, 3)

    def test_module_without_meshes(self, no_mesh_module):
        assert device_meshes(no_mesh_module) == {}

    def test_non_mesh_global_infos_are_skipped(self, vdevice_module):
        assert device_meshes(vdevice_module) == {}


class TestMeshTable:
    def test_types_find_the_module_mesh_by_identity(self):
        @I.ir_module
        class Stages:
            I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2)),
                                            R.dist.device_mesh((2,), I.Range(0, 2))]})

            @R.function
            def main(x: R.dist.DTensor((4,), "float32", "mesh[1]", "S[0]"),
                     y: R.dist.DTensor((4,), "float32", "mesh[0]", "R")):
                return x

        table = MeshTable(Stages)
        assert list(table) == ["mesh[0]", "mesh[1]"] and table.as_dict() == device_meshes(Stages)
        x, y = Stages["main"].params
        # two equal meshes: an equality scan finds mesh[0] for both, identity does not
        assert table.lookup(x.ty.device_mesh) is table["mesh[1]"]
        assert table.lookup(y.ty.device_mesh) is table["mesh[0]"]
        assert TensorSharding.from_type(x.ty, table).mesh.name == "mesh[1]"

    def test_a_mesh_made_elsewhere_is_found_by_shape_and_devices(self, pipeline):
        table = MeshTable(pipeline)
        copy = TVMDeviceMesh((1,), [1])
        assert table.lookup(copy) is table["mesh[1]"]
        assert table.ref(DeviceMesh((1,), range(1, 2))) == "mesh[1]"
        stranger = DeviceMesh((2,), range(4, 6))
        assert table.named(stranger) is stranger and table.ref(stranger) is None
        assert tvm_ids(table.to_tvm(stranger)) == [4, 5]

    def test_module_without_meshes(self, no_mesh_module):
        assert len(MeshTable(no_mesh_module)) == 0


class TestResolveMesh:
    @pytest.mark.parametrize("ref", ["mesh[1]", MeshReference("mesh", 1), " mesh[ 1 ]"])
    def test_resolves_text_and_refs(self, pipeline, ref):
        ours, theirs = resolve_mesh(pipeline, ref)
        assert ours == DeviceMesh((1,), range(1, 2))
        assert ours.name == "mesh[1]"
        assert isinstance(theirs, TVMDeviceMesh)
        assert tvm_shape(theirs) == [1]
        assert tvm_ids(theirs) == [1]

    def test_returns_the_module_own_object(self, pipeline):
        _, theirs = resolve_mesh(pipeline, "mesh[0]")
        stored = pipeline.global_infos["mesh"][0]
        # Same underlying object, checked by handle rather than ==/same_as.
        assert theirs.__chandle__() == stored.__chandle__()
        assert tvm_ids(theirs) == tvm_ids(stored) == [0]

    def test_2x2(self, mesh2x2):
        ours, theirs = resolve_mesh(mesh2x2, "mesh[0]")
        assert ours == DeviceMesh((2, 2), range(0, 4))
        assert tvm_shape(theirs) == [2, 2]
        assert tvm_ids(theirs) == [0, 1, 2, 3]

    @pytest.mark.parametrize("ref", ["mesh[5]", "mesh[2]", "other[0]"])
    def test_unknown_reference_lists_available_meshes(self, pipeline, ref):
        with pytest.raises(UnknownMeshError) as info:
            resolve_mesh(pipeline, ref, function="main", var="x")
        err = info.value
        text = str(err)
        assert text.startswith("[unknown-mesh] in function 'main', variable 'x': ")
        assert f'mesh "{ref}" is not in the module\'s global_infos' in text
        assert "(it has: mesh[0], mesh[1])" in text
        assert "hint: declare it with I.module_global_infos" in text
        assert err.function == "main" and err.var == "x"
        assert isinstance(err, ShardingError) and isinstance(err, KeyError)

    def test_unknown_reference_without_location(self, mesh2x2):
        with pytest.raises(UnknownMeshError) as info:
            resolve_mesh(mesh2x2, "mesh[1]")
        text = str(info.value)
        assert text.startswith('[unknown-mesh] mesh "mesh[1]" is not')
        assert "(it has: mesh[0])" in text

    def test_module_without_meshes(self, no_mesh_module):
        with pytest.raises(UnknownMeshError, match=r"\(it has: no meshes\)"):
            resolve_mesh(no_mesh_module, "mesh[0]")

    def test_known_overrides_the_listing(self, pipeline):
        known = {"mesh[1]": DeviceMesh((1,), range(1, 2), "mesh[1]")}
        with pytest.raises(UnknownMeshError, match=r"\(it has: mesh\[1\]\)"):
            resolve_mesh(pipeline, "mesh[9]", known=known)

    def test_malformed_reference_is_a_mesh_error(self, pipeline):
        with pytest.raises(MeshError) as info:
            resolve_mesh(pipeline, "mesh")
        assert not isinstance(info.value, UnknownMeshError)

    def test_reference_to_a_non_mesh_global_info(self, vdevice_module):
        # "vdevice[0]" exists in global_infos but is not a device mesh: that is an
        # unknown mesh, not a crash inside DeviceMesh.from_tvm.
        with pytest.raises(UnknownMeshError):
            resolve_mesh(vdevice_module, "vdevice[0]")
