"""RISC-V RVV bundles: cross-built, real vector code, every kernel checked under qemu.

scripts/test installs gcc-riscv64-linux-gnu and qemu-user when they are missing;
in CI a missing tool is a failure, never a skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax

import tvm_distx as td
from tvm_distx.compiler.pipeline import legalize_ops
from tvm_distx.compiler.schedule import RULE_ATTR, ScheduleCPU, fuse_kernels
from tvm_distx.compiler.targets import resolve_target
from tvm_distx.sources import formats
from tvm_distx import ShardingRule
from tvm_distx.compiler import rvv
from tvm_distx.passes import AnnotateSharding

from rvv_tools import require_tools
from locations import TESTS_DIR

DATA = TESTS_DIR / "data"
require_tools()  # at import: the whole module needs them

TP_RULES = [ShardingRule(param="A", result="S[1]", function="mlp"),
            ShardingRule(param="B", result="S[0]", function="mlp")]


@pytest.fixture(scope="module")
def weights():
    rng = np.random.default_rng(31)
    return [(0.1 * rng.standard_normal((128, 128))).astype("float32") for _ in range(3)]


@pytest.fixture(scope="module")
def tp_bundle(tmp_path_factory, weights):
    exe = td.compile(AnnotateSharding(TP_RULES)(td.load_module(DATA / "seed_tensor_parallel.py")),
                     target="rvv")
    _, A, B = weights
    return exe.export(tmp_path_factory.mktemp("rvv") / "tp", params={"A": A, "B": B})


def test_the_bundle_is_cross_linked_for_riscv_with_weights_manifest_readme_and_launcher(
        tp_bundle):
    for path in ("lib.so", "kernels/kernels.so"):
        header = subprocess.run(["riscv64-linux-gnu-readelf", "-h", str(tp_bundle / path)],
                                capture_output=True, text=True, check=True).stdout
        assert "RISC-V" in header, path
    manifest = json.loads((tp_bundle / "manifest.json").read_text())
    assert manifest["target"]["name"] == "rvv"
    assert "+v" in manifest["target"]["target"]["mattr"]
    assert [(f["file"], [w["name"] for w in f["weights"]]) for f in manifest["weight_files"]] \
        == [("weights/rank0.safetensors", ["A", "B"]), ("weights/rank1.safetensors", ["A", "B"])]
    assert "kernels/" in (tp_bundle / "README.md").read_text()
    assert os.access(tp_bundle / "run.sh", os.X_OK)


def test_the_kernels_hold_real_vector_code(tp_bundle):
    found = rvv.vector_instructions(tp_bundle / "kernels")
    for mnemonic in ("vsetvli", "vle32.v", "vfmacc.vv"):
        assert found[mnemonic] > 0, (mnemonic, found)


def test_tp_mlp_kernels_equal_numpy_under_qemu_and_need_the_vector_unit(tp_bundle, weights):
    folder = tp_bundle / "kernels"
    kernels = {k.name: k for k in rvv.read_kernels(folder)}
    harness = rvv.build_harness(folder)
    x, A, B = weights
    # rank 1's program: its column block of A, then its row block of B
    A1, B1 = A[:, 64:], B[64:]
    (fused,) = [k for k in kernels.values() if "relu" in k.name]
    (h,) = rvv.run_kernel(folder, fused, [x, A1], harness=harness)
    np.testing.assert_allclose(h, np.maximum(x @ A1, 0), rtol=1e-5, atol=1e-5)
    (second,) = [k for k in kernels.values() if "relu" not in k.name]
    (partial,) = rvv.run_kernel(folder, second, [h, B1], harness=harness, vlen=256)
    np.testing.assert_allclose(partial, h @ B1, rtol=1e-5, atol=1e-5)
    with pytest.raises(rvv.QemuError, match="illegal instruction"):
        rvv.run_kernel(folder, fused, [x, A1], harness=harness, vector=False)


def test_every_kernel_of_tp_and_pipeline_bundles_matches_the_host_under_qemu(tp_bundle,
                                                                            tmp_path):
    checks = rvv.check_kernels(tp_bundle / "kernels")
    assert len(checks) == 2 and all(c.vector_ran for c in checks)
    # the seed pipeline through the command line
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps([{"callee": "mlp", "args": {"0": "R"},
                                  "meshes": ["mesh[0]", "mesh[1]"]}]))
    done = subprocess.run([sys.executable, "-m", "tvm_distx", "bundle",
                           str(DATA / "seed_pipeline.py"), "--rules", str(rules),
                           "--target", "rvv", "--check", "-o", str(tmp_path / "pipeline")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "vector code ran" in done.stdout
    assert "for 2 ranks" in done.stdout
    manifest = json.loads((tmp_path / "pipeline" / "manifest.json").read_text())
    assert manifest["functions"]["main"]["entries"] == ["main_rank0", "main_rank1"]


def test_target_errors_name_the_fix(tmp_path, monkeypatch):
    with pytest.raises(td.errors.ArgumentError, match="unknown target 'arm'") as info:
        td.compile(AnnotateSharding(TP_RULES)(td.load_module(DATA / "seed_tensor_parallel.py")),
                   target="arm")
    assert '"x86", "rvv"' in str(info.value)
    exe = td.compile(AnnotateSharding(TP_RULES)(td.load_module(DATA / "seed_tensor_parallel.py")),
                     target="rvv", schedule=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # neither the cross compiler nor qemu
    with pytest.raises(td.errors.ArgumentError, match="riscv64-linux-gnu-gcc, which is not installed"
                       ) as info:
        exe.export(tmp_path / "bundle")
    assert "apt-get install gcc-riscv64-linux-gnu" in str(info.value)
    with pytest.raises(rvv.QemuError, match="qemu-riscv64 is not installed") as info:
        rvv.run_kernel(tmp_path, rvv.Kernel("k", ()), [], harness=tmp_path / "harness")
    assert "qemu-user" in str(info.value)


def linear_under_qemu(fmt: str, rows: int, rule: str, tmp_path: Path) -> tuple[list, object]:
    """``(rows, 256) @ W.T`` with ``W`` (48, 256) stored in ``fmt``, built for RVV.

    Checks the kernel's rule, runs it under qemu at VLEN 128 and 256 against numpy
    on the decoded weight, and returns the assembly's words and the kernel.
    """
    rng = np.random.default_rng(rows)
    weight = rng.standard_normal((48, 256), dtype="float32")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((rows, 256), "float32"))
    w = relax.Var("w", relax.TensorType((48, 256), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.matmul(x, relax.op.permute_dims(w)))
        bb.emit_func_output(out)
    mod, stored = (bb.get(), {"w": weight}) if fmt == "f32" else \
        td.quantize(bb.get(), {"w": weight}, fmt)
    target = resolve_target("rvv").target
    built = ScheduleCPU(target)(fuse_kernels(legalize_ops(mod)))
    (kernel,) = rvv.write_kernels(built, target, tmp_path)
    (prim,) = [f for f in built.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    assert prim.attrs[RULE_ATTR] == rule
    parts = {"data": np.asarray(stored["w"])}
    if "w_scale" in stored:
        parts["scale"] = np.asarray(stored["w_scale"])
    activations = rng.standard_normal((rows, 256), dtype="float32")
    by_name = {"w": parts["data"], "w_scale": parts.get("scale"), "x": activations}
    inputs = [by_name[str(p.name)] for p in prim.params[:-1]]
    want = activations @ formats.decode(parts, fmt).T
    harness = rvv.build_harness(tmp_path)
    for vlen in (128, 256):
        (got,) = rvv.run_kernel(tmp_path, kernel, inputs, harness=harness, vlen=vlen)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    with pytest.raises(rvv.QemuError, match="illegal instruction"):
        rvv.run_kernel(tmp_path, kernel, inputs, harness=harness, vector=False)
    return (tmp_path / "kernels.s").read_text().split(), prim


@pytest.mark.parametrize("fmt, widen", [("q8", ("vle8.v", "vsext.vf2", "vfwcvt.f.x.v")),
                                        ("q4", ("vle8.v", "vand.vi", "vsrl.vi", "vfwcvt.f.xu.v")),
                                        ("f16", ())])  # float16 widened by integer operations
def test_quantized_and_f16_matvec_kernels_hold_vector_code_and_equal_numpy_under_qemu(
        fmt, widen, tmp_path):
    words, _ = linear_under_qemu(fmt, 1, "matvec", tmp_path)
    for mnemonic in ("vsetvli", "vfmacc.vv") + widen:
        assert mnemonic in words, mnemonic


@pytest.mark.parametrize("fmt", ["f32", "q8", "q4"])
def test_a_prompts_projection_runs_row_panels_in_vector_code_under_qemu(fmt, tmp_path):
    """7 prompt rows times an (out, in) weight: row panels (padded), vector FMAs, numpy's values."""
    words, prim = linear_under_qemu(fmt, 7, "matmul", tmp_path)
    assert "x_pad" in prim.script()  # the rows' panels
    assert "vsetvli" in words and ("vfmacc.vf" in words or "vfmacc.vv" in words)
