"""The top level of ``tvm_distx``: a small set of names, loaded on first use.

No release was ever made, so the names and modules that moved during development
are gone, not kept as warning aliases: an old name is an ``AttributeError`` and an
old module path a ``ModuleNotFoundError``, like any other name that does not exist.
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
    "ShardingRule", "AnnotateSharding", "PropagateSharding", "register_sharding_rule",
    "load_module", "from_torch", "export_decoder", "quantize",
    "compile", "lower_to_ranks", "DistExecutable", "CausalLM",
    "auto_shard", "explain", "comm_report",
    "DistxError", "errors",
}

#: Names and module paths of the development versions, gone for good (no release kept them).
GONE_NAMES = [("tvm_distx", "distribute"), ("tvm_distx", "profile"), ("tvm_distx", "MeshRef"),
              ("tvm_distx", "ShardingError"), ("tvm_distx.layout.mesh", "module_meshes"),
              ("tvm_distx.plans.presets", "with_meshes"), ("tvm_distx.plans.moe", "moe_parallel")]
GONE_MODULES = ["tvm_distx.presets", "tvm_distx.pipeline", "tvm_distx.build",
                "tvm_distx.build.pipeline", "tvm_distx.board", "tvm_distx.llm.batch",
                "tvm_distx.runtime.generation", "tvm_distx.bundle.gguf",
                "tvm_distx.plans.preset", "tvm_distx.autoshard.inline", "tvm_distx._deprecated"]


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
    assert tvm_distx.register_sharding_rule is _at(
        "tvm_distx.passes.user_rules.register_sharding_rule")
    assert tvm_distx.lower_to_ranks is _at("tvm_distx.compiler.pipeline.lower_to_ranks")
    assert tvm_distx.CausalLM is _at("tvm_distx.llm.causal_lm.CausalLM")
    assert tvm_distx.set_device_meshes is _at("tvm_distx.layout.mesh.set_device_meshes")


def test_dir_lists_the_public_names():
    assert PUBLIC <= set(dir(tvm_distx))


@pytest.mark.parametrize("module, name", GONE_NAMES, ids=[f"{m}.{n}" for m, n in GONE_NAMES])
def test_an_old_name_is_an_attribute_error_like_any_unknown_name(module, name):
    mod = importlib.import_module(module)
    with pytest.raises(AttributeError, match=f"no attribute '{name}'"):
        getattr(mod, name)
    assert name not in dir(mod)


def test_an_old_module_path_is_not_found():
    code = ("import importlib, json, tvm_distx\n"
            "missing = []\n"
            f"for name in {GONE_MODULES!r}:\n"
            "    try:\n"
            "        importlib.import_module(name)\n"
            "    except ModuleNotFoundError:\n"
            "        missing.append(name)\n"
            "print(json.dumps(missing))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=True)
    assert json.loads(done.stdout.splitlines()[-1]) == GONE_MODULES


def test_presets_is_reachable_from_the_top_as_users_write_it():
    from tvm_distx import presets
    from tvm_distx.plans import presets as home

    assert presets is home


def test_an_unknown_name_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        tvm_distx.no_such_name  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        importlib.import_module("tvm_distx.plans.presets").no_such_name  # noqa: B018


def test_annotate_and_propagate_load_the_compiler_only_on_first_use():
    code = (
        "import json, sys, warnings\n"
        "warnings.simplefilter('error')\n"
        "import tvm_distx\n"
        "before = sorted(m for m in sys.modules if m.startswith(\n"
        "    ('tvm_distx.passes', 'tvm_distx.legalize', 'tvm_distx.frontend', 'tvm_distx.compiler')))\n"
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


def test_the_llm_package_gives_causal_lm_as_before():
    from tvm_distx.llm import CausalLM

    assert CausalLM is tvm_distx.CausalLM
