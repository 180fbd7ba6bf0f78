"""Determinism: one bundle and one input give the same bits every time, on every backend.

Each program is compiled once and exported once; the bundle then runs twice
over MPI, twice as disco workers, and once emulated. Every output must be
bitwise identical (compared as unsigned integers, so ``-0.0`` and ``0.0``
differ and a NaN equals itself). The programs all-reduce floats over four
ranks, where the order of the additions changes the bits: every backend folds
in member order (``tvm_distx.runtime.mpi_ccl`` does so even over MPI, where
``MPI_Allreduce`` would pick its own tree).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import tvm_distx as td
from tvm_distx import ShardingRule
from tvm_distx.passes import AnnotateSharding
from tvm_distx.runtime.backends import launch

from locations import TESTS_DIR
from reference import mlp_twice

DATA = TESTS_DIR / "data"

TP4 = '''
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class TensorParallel4:
    I.module_attrs({"device_num": 4})
    I.module_global_infos({"mesh": [R.dist.device_mesh((4,), I.Range(0, 4))]})

    @R.function
    def main(x: R.Tensor((64, 96), "float32"), A: R.Tensor((96, 256), "float32"),
             B: R.Tensor((256, 96), "float32")) -> R.Tensor((64, 96), "float32"):
        with R.dataflow():
            h = R.matmul(x, A)
            a = R.nn.relu(h)
            y = R.matmul(a, B)
            R.output(y)
        return y
'''


def bits(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array).view(f"u{array.dtype.itemsize}")


def programs(tmp_path: Path):
    """(name, executable, runtime inputs, weights, numpy reference) of each program."""
    rng = np.random.default_rng(2026)

    def scaled(*shape):  # magnitudes over several decades: additions round differently
        return (rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 2, shape)).astype(
            "float32")

    source = tmp_path / "tp4.py"
    source.write_text(TP4)
    rules = [ShardingRule(param="A", result="S[1]"), ShardingRule(param="B", result="S[0]")]
    tp4 = td.compile(AnnotateSharding(rules)(td.load_module(source)))
    x, A, B = scaled(64, 96), scaled(96, 256), scaled(256, 96)
    yield "tensor parallel on (4,)", tp4, [x], {"A": A, "B": B}, np.maximum(x @ A, 0) @ B

    grid = AnnotateSharding([ShardingRule(callee="mlp", args={0: "S[0]R", 1: "RS[1]",
                                                              2: "RS[0]"})])(
        td.load_module(DATA / "seed_mesh2x2.py"))
    x, A, B = scaled(128, 128), scaled(128, 128), scaled(128, 128)
    yield "data x model on 2x2", td.compile(grid), [x], {"A": A, "B": B}, mlp_twice(x, A, B)


def test_a_bundle_gives_the_same_bits_twice_and_on_every_backend(tmp_path):
    for name, exe, inputs, weights, want in programs(tmp_path):
        bundle = exe.export(tmp_path / name.replace(" ", "_"), params=weights)
        runs = {
            "mpi 1": launch(bundle, inputs, backend="mpi"),
            "mpi 2": launch(bundle, inputs, backend="mpi"),
            "disco 1": launch(bundle, inputs, backend="disco"),
            "disco 2": launch(bundle, inputs, backend="disco"),
            "emulate": exe.run(*inputs, params=weights, backend="emulate"),
        }
        first = runs["mpi 1"]
        np.testing.assert_allclose(first, want, rtol=1e-4, atol=1e-3 * np.abs(want).max())
        for label, got in runs.items():
            assert got.dtype == first.dtype and got.shape == first.shape, (name, label)
            differ = int(np.sum(bits(got) != bits(first)))
            assert differ == 0, f"{name}: {label} differs from mpi 1 in {differ} elements"


def test_the_order_of_additions_matters_for_these_inputs():
    """The check above could not fail if the sums were exact: show they are not."""
    rng = np.random.default_rng(7)
    parts = (rng.standard_normal((4, 4096)) * 10.0 ** rng.integers(-3, 2, (4, 4096))).astype(
        "float32")
    member_order = ((parts[0] + parts[1]) + parts[2]) + parts[3]
    tree = (parts[0] + parts[2]) + (parts[1] + parts[3])  # MPICH's recursive halving
    assert np.any(bits(member_order) != bits(tree))
