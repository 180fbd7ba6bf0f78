"""The top level of ``tvm_distx``: a small set of names, and the old ones kept for one release.

The names of the previous release that were renamed or moved (and the error
classes other than ``DistxError``, which live in :mod:`tvm_distx.errors`) still
work for one release: each access emits a ``DeprecationWarning`` naming the new
place and gives the very same object. They are in neither ``__all__`` nor
``dir()``.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import warnings

import pytest

import tvm_distx
from tvm_distx import errors

PUBLIC = {
    "DeviceMesh", "Placement", "Shard", "Replicate", "Partial", "TensorSharding",
    "set_device_meshes",
    "ShardingRule", "AnnotateSharding", "PropagateSharding",
    "load_module", "from_torch", "export_decoder", "quantize",
    "compile", "lower_to_ranks", "DistExecutable", "CausalLM",
    "auto_shard", "explain", "comm_report",
    "DistxError", "errors",
}

#: Every deprecated name: (module, old name, the path its warning advises).
RENAMED = [
    ("tvm_distx", "distribute", "tvm_distx.lower_to_ranks"),
    ("tvm_distx", "profile", "tvm_distx.autoshard.measure_cost_profile"),
    ("tvm_distx", "CostProfile", "tvm_distx.autoshard.CostProfile"),
    ("tvm_distx", "MeshRef", "tvm_distx.layout.mesh.MeshReference"),
    ("tvm_distx", "module_meshes", "tvm_distx.layout.mesh.device_meshes"),
    ("tvm_distx.build.pipeline", "distribute", "tvm_distx.lower_to_ranks"),
    ("tvm_distx.autoshard", "profile", "tvm_distx.autoshard.measure_cost_profile"),
    ("tvm_distx.autoshard.measure", "measure_profile", "tvm_distx.autoshard.measure_cost_profile"),
    ("tvm_distx.layout", "MeshRef", "tvm_distx.layout.mesh.MeshReference"),
    ("tvm_distx.layout.mesh", "MeshRef", "tvm_distx.layout.mesh.MeshReference"),
    ("tvm_distx.layout.mesh", "module_meshes", "tvm_distx.layout.mesh.device_meshes"),
    ("tvm_distx.plans.presets", "with_meshes", "tvm_distx.set_device_meshes"),
    ("tvm_distx.plans.presets", "data_and_model", "tvm_distx.plans.presets.data_and_tensor_parallel"),
    ("tvm_distx.plans.presets", "moe_parallel", "tvm_distx.plans.moe.choose_expert_plan"),
    ("tvm_distx.plans.presets", "tensor_parallel_experts",
     "tvm_distx.plans.moe.expert_tensor_parallel"),
    ("tvm_distx.plans.moe", "moe_parallel", "tvm_distx.plans.moe.choose_expert_plan"),
    ("tvm_distx.plans.moe", "tensor_parallel_experts", "tvm_distx.plans.moe.expert_tensor_parallel"),
] + [("tvm_distx", name, f"tvm_distx.errors.{name}")
     for name in errors.__all__ if name != "DistxError"]


def _at(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_the_top_level_exports_a_small_set_of_names():
    assert len(tvm_distx.__all__) <= 25
    assert len(set(tvm_distx.__all__)) == len(tvm_distx.__all__)
    assert set(tvm_distx.__all__) == PUBLIC


def test_every_public_name_resolves_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in tvm_distx.__all__:
            assert getattr(tvm_distx, name) is not None, name
    assert tvm_distx.AnnotateSharding is _at("tvm_distx.passes.annotate_sharding.AnnotateSharding")
    assert tvm_distx.PropagateSharding is _at("tvm_distx.passes.propagate_sharding.PropagateSharding")
    assert tvm_distx.lower_to_ranks is _at("tvm_distx.build.pipeline.lower_to_ranks")
    assert tvm_distx.CausalLM is _at("tvm_distx.llm.causal_lm.CausalLM")
    assert tvm_distx.set_device_meshes is _at("tvm_distx.layout.mesh.set_device_meshes")


def test_dir_lists_the_public_names_and_no_deprecated_one():
    listed = set(dir(tvm_distx))
    assert PUBLIC <= listed
    for module, old, _ in RENAMED:
        mod = importlib.import_module(module)
        assert old not in dir(mod), (module, old)
        assert old not in getattr(mod, "__all__", ()), (module, old)


@pytest.mark.parametrize("module, old, new", RENAMED, ids=[f"{m}.{o}" for m, o, _ in RENAMED])
def test_each_old_name_warns_and_is_the_new_object(module, old, new):
    mod = importlib.import_module(module)
    with pytest.warns(DeprecationWarning) as caught:
        value = getattr(mod, old)
    assert value is _at(new)
    text = str(caught[0].message)
    assert f"{module}.{old} is deprecated" in text
    assert text.endswith(f"; use {new}"), text
    assert caught[0].filename == __file__  # the warning points at the caller


def test_from_import_of_an_old_name_warns_too():
    with pytest.warns(DeprecationWarning, match="use tvm_distx.errors.ShardingError"):
        from tvm_distx import ShardingError
    assert ShardingError is errors.ShardingError
    with pytest.warns(DeprecationWarning, match="use tvm_distx.set_device_meshes"):
        from tvm_distx.plans.presets import with_meshes
    assert with_meshes is tvm_distx.set_device_meshes


def test_an_unknown_name_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        tvm_distx.no_such_name  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        importlib.import_module("tvm_distx.plans.presets").no_such_name  # noqa: B018


def test_old_plan_names_plan_as_the_new_ones():
    """The aliases are the same functions, so the plans they build are equal."""
    from tvm_distx.plans import moe, presets

    with pytest.warns(DeprecationWarning):
        assert presets.data_and_model(("x",)) == presets.data_and_tensor_parallel(("x",))
    with pytest.warns(DeprecationWarning):
        assert moe.tensor_parallel_experts(model_axis=0) == moe.expert_tensor_parallel(model_axis=0)


def test_annotate_and_propagate_load_the_compiler_only_on_first_use():
    code = (
        "import json, sys, warnings\n"
        "warnings.simplefilter('error')\n"
        "import tvm_distx\n"
        "before = sorted(m for m in sys.modules if m.startswith(\n"
        "    ('tvm_distx.passes', 'tvm_distx.legalize', 'tvm_distx.frontend', 'tvm_distx.build')))\n"
        "from tvm_distx import AnnotateSharding, PropagateSharding\n"
        "import tvm_distx.passes as passes\n"
        "print(json.dumps([before, AnnotateSharding is passes.AnnotateSharding,\n"
        "                  PropagateSharding is passes.PropagateSharding]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=True)
    before, annotate, propagate = json.loads(done.stdout.splitlines()[-1])
    assert before == []
    assert annotate and propagate


def test_every_moved_module_keeps_its_old_import_path_for_one_release():
    """``import tvm_distx.presets`` and ``from tvm_distx import presets`` warn and give the
    module at its new place, the very same object (in a fresh interpreter: the old names
    must not have been imported yet)."""
    code = (
        "import importlib, json, sys, warnings\n"
        "import tvm_distx\n"
        "bad = []\n"
        "for old, new in sorted(tvm_distx._MOVED_MODULES.items()):\n"
        "    module = importlib.import_module(new)\n"
        "    with warnings.catch_warnings(record=True) as seen:\n"
        "        warnings.simplefilter('always')\n"
        "        got = importlib.import_module(old)\n"
        "        attr = getattr(tvm_distx, old.rpartition('.')[2])\n"
        "    said = [str(w.message) for w in seen if w.category is DeprecationWarning]\n"
        "    if got is not module or attr is not module or not any(new in m for m in said):\n"
        "        bad.append(old)\n"
        "print(json.dumps([len(tvm_distx._MOVED_MODULES), bad]))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    count, bad = json.loads(done.stdout.splitlines()[-1])
    assert count >= 20 and bad == []


def test_the_llm_package_gives_causal_lm_as_before():
    from tvm_distx.llm import CausalLM

    assert CausalLM is tvm_distx.CausalLM
