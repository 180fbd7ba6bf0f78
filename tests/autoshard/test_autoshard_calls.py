"""auto_shard through calls: ``main`` calls a private decoder-layer function twice.

The planner inlines the calls to cost every call site, and solves the two call
sites once, as repeated layers; the rules name ``main``'s parameters, and
propagation carries them into the callee.
"""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pytest

import tvm_distx as td
from tvm_distx.autoshard import auto_shard

DIM, WIDE, TOKENS = 64, 256, 8

SCRIPT = f"""
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class Module:
    @R.function(private=True)
    def layer(x: R.Tensor(({TOKENS}, {DIM}), "float32"), w1: R.Tensor(({DIM}, {WIDE}), "float32"),
              w2: R.Tensor(({WIDE}, {DIM}), "float32")) -> R.Tensor(({TOKENS}, {DIM}), "float32"):
        with R.dataflow():
            h = R.nn.relu(R.matmul(x, w1))
            out = R.add(x, R.matmul(h, w2))
            R.output(out)
        return out

    @R.function
    def main(x: R.Tensor(({TOKENS}, {DIM}), "float32"),
             w1_0: R.Tensor(({DIM}, {WIDE}), "float32"),
             w2_0: R.Tensor(({WIDE}, {DIM}), "float32"),
             w1_1: R.Tensor(({DIM}, {WIDE}), "float32"),
             w2_1: R.Tensor(({WIDE}, {DIM}), "float32")) -> R.Tensor(({TOKENS}, {DIM}), "float32"):
        R.func_attr({{"num_input": 1}})
        cls = Module
        with R.dataflow():
            a = cls.layer(x, w1_0, w2_0)
            b = cls.layer(a, w1_1, w2_1)
            R.output(b)
        return b
"""

_ABI = {"allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter"}


def _lowered(exe) -> Counter:
    found = re.findall(r'"tvm_distx\.ccl\.(\w+)"', exe.module.script())
    return Counter(_ABI[name] for name in found if name in _ABI)


@pytest.fixture(scope="module")
def problem(tmp_path_factory):
    from tvm_distx.frontend.script import load_module

    path = tmp_path_factory.mktemp("calls") / "model.py"
    path.write_text(SCRIPT)
    mod = load_module(path)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((TOKENS, DIM)).astype("float32")
    weights = {f"{w}_{i}": (0.1 * rng.standard_normal(shape)).astype("float32")
               for i in range(2) for w, shape in (("w1", (DIM, WIDE)), ("w2", (WIDE, DIM)))}
    want = x
    for i in range(2):
        want = want + np.maximum(want @ weights[f"w1_{i}"], 0) @ \
            weights[f"w2_{i}"]
    return mod, weights, x, want


@pytest.mark.parametrize("pin", [True, False], ids=["pinned", "rules"])
def test_a_layer_called_twice_is_planned_through_the_calls_and_runs_on_mpi(problem, pin):
    mod, weights, x, want = problem
    total = sum(w.nbytes for w in weights.values())
    annotated, report = auto_shard(mod, (2,), memory_per_rank=total // 2 + 40_000,
                                   runner_ups=0, pin=pin)
    assert report.graph.layers == 2  # the two call sites solved once (no layer names needed)
    for i in range(2):  # Megatron inside the callee: column then row parallel
        assert report.placements[f"w1_{i}"] == "S[1]"
        assert report.placements[f"w2_{i}"] == "S[0]"
    assert report.weight_bytes_per_rank == total // 2
    # one reduction per block, or its sequence-parallel form
    collectives = report.collectives()
    assert collectives in ({"all_reduce": 2}, {"reduce_scatter": 2, "all_gather": 1})
    names = {gv.name_hint for gv in annotated.functions}
    assert ("layer" in names) is not pin  # the rules keep the calls; the pins inline them
    exe = td.compile(annotated)
    if pin:
        assert _lowered(exe) == collectives  # the program runs the plan that was costed
    else:  # propagation completes the callee's partial sums: one all-reduce, run per call
        assert _lowered(exe) == {"all_reduce": 1}
    np.testing.assert_allclose(exe.run(x, params=weights, backend="mpi"), want, atol=1e-5)
