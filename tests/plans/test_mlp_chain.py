"""presets.tensor_parallel() on a plain chain of linears with no residual add after it.

``relu(x @ A) @ B`` (the README's seed program) and its gated, ``(out, in)``
cousin ``(silu(h @ G.T) * (h @ U.T)) @ D.T``: the first linears split on their
outputs, the last on its inputs, one all-reduce per call, whatever the weights
are named and whether the chain sits in ``main`` or in a function it calls.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
import tvm

import tvm_distx as td
from tvm_distx.compiler.pipeline import run_stages
from tvm_distx.plans import presets

GATED = """
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class Gated:
    @R.function
    def main(h: R.Tensor((8, 96), "float32"), w_gate: R.Tensor((192, 96), "float32"),
             w_up: R.Tensor((192, 96), "float32"),
             w_down: R.Tensor((96, 192), "float32")) -> R.Tensor((8, 96), "float32"):
        with R.dataflow():
            gt = R.permute_dims(w_gate)
            g = R.matmul(h, gt)
            ut = R.permute_dims(w_up)
            u = R.matmul(h, ut)
            act = R.multiply(R.nn.silu(g), u)
            dt = R.permute_dims(w_down)
            out = R.matmul(act, dt)
            R.output(out)
        return out
"""

# two calls of a private function whose chain reads the weights as (in, out)
CALLED = """
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class Called:
    @R.function(private=True)
    def ffn(t: R.Tensor((16, 32), "float32"), w_in: R.Tensor((32, 64), "float32"),
            w_out: R.Tensor((64, 32), "float32")) -> R.Tensor((16, 32), "float32"):
        with R.dataflow():
            a = R.matmul(t, w_in)
            b = R.nn.gelu(a)
            c = R.multiply(b, R.const(0.5, "float32"))
            d = R.matmul(c, w_out)
            R.output(d)
        return d

    @R.function
    def main(t: R.Tensor((16, 32), "float32"), first: R.Tensor((32, 64), "float32"),
             second: R.Tensor((64, 32), "float32"), third: R.Tensor((32, 64), "float32"),
             fourth: R.Tensor((64, 32), "float32")) -> R.Tensor((16, 32), "float32"):
        cls = Called
        with R.dataflow():
            y = cls.ffn(t, first, second)
            z = cls.ffn(y, third, fourth)
            R.output(z)
        return z
"""


def _module(text: str, ranks: int = 2) -> tvm.IRModule:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "model.py"
        path.write_text(text)
        return presets.set_device_meshes(td.load_module(path), [(ranks,)])


def _reduces(annotated) -> list[tuple[str, str]]:
    rows = td.comm_report(run_stages(annotated)["local_view"]).rows
    return [(r.function, r.collective) for r in rows if r.collective != "local_slice"]


def test_a_gated_chain_in_out_in_layout_is_one_block():
    mod = _module(GATED)
    plan = presets.tensor_parallel().plan(mod)
    assert plan.placements() == {"w_gate": "S[0]", "w_up": "S[0]", "w_down": "S[1]"}
    assert plan.role("w_down").reason == ("ends the mlp block, after its elementwise work; "
                                          "input features split, one all-reduce")
    assert [(b.kind, b.column, b.row) for b in plan.blocks] == \
        [("mlp", ("w_gate", "w_up"), "w_down")]
    annotated = presets.tensor_parallel().apply(mod)
    assert _reduces(annotated) == [("main", "all_reduce")]
    rng = np.random.default_rng(0)
    h = rng.standard_normal((8, 96), dtype="float32")
    weights = {"w_gate": rng.standard_normal((192, 96), dtype="float32") / 10,
               "w_up": rng.standard_normal((192, 96), dtype="float32") / 10,
               "w_down": rng.standard_normal((96, 192), dtype="float32") / 10}
    g, u = h @ weights["w_gate"].T, h @ weights["w_up"].T
    want = (g / (1 + np.exp(-g)) * u) @ weights["w_down"].T
    got = td.compile(annotated).run(h, params=weights, backend="emulate")
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_a_chain_in_a_called_function_places_the_callers_weights_per_call():
    mod = _module(CALLED, ranks=4)
    plan = presets.tensor_parallel().plan(mod)
    assert plan.placements() == {"first": "S[1]", "second": "S[0]", "third": "S[1]",
                                 "fourth": "S[0]"}
    assert [(b.column, b.row) for b in plan.blocks] == [(("first",), "second"),
                                                        (("third",), "fourth")]
    assert _reduces(presets.tensor_parallel().apply(mod)) == [("ffn", "all_reduce")]
    summary = presets.tensor_parallel().layers(mod)  # one all-reduce per call
    assert [(layer.all_reduces, layer.ideal) for layer in summary.layers] == [(2, 2)]
    assert summary.ideal


def _variant(act: str, returned: str = "out", ty: str = 'R.Tensor((8, 96), "float32")') -> str:
    return (GATED.replace("act = R.multiply(R.nn.silu(g), u)", act)
            .replace("R.output(out)\n        return out",
                     f"R.output({returned.strip('()')})\n        return {returned}")
            .replace('-> R.Tensor((8, 96), "float32"):', f"-> {ty}:"))


@pytest.mark.parametrize("text", [
    # the activation is read by something else too (an output): every rank needs it whole
    _variant("act = R.multiply(R.nn.silu(g), u)", "(out, act)",
             'R.Tuple(R.Tensor((8, 96), "float32"), R.Tensor((8, 192), "float32"))'),
    # softmax mixes the features: it is no elementwise work
    _variant("act = R.nn.softmax(R.multiply(R.nn.silu(g), u))"),
], ids=["read-elsewhere", "softmax"])
def test_a_chain_broken_by_another_reader_or_a_mixing_operator_is_no_block(text):
    plan = presets.tensor_parallel().plan(_module(text))
    assert plan.blocks == ()
    assert plan.role("w_gate").role != "column" and plan.role("w_up").role != "column"
    assert plan.role("w_down").role == "lm_head"  # the output projection, as before
