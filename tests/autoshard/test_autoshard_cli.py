"""``tvm-distx autoshard --function NAME --size NAME=INT``: a named function of run-time extents."""

from __future__ import annotations

import pytest

from tvm_distx.cli.main import main

HIDDEN, WIDE = 64, 1024


SCRIPT = f"""
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class Module:
    @R.function
    def step(x: R.Tensor(("n", {HIDDEN}), "float32"), w1: R.Tensor(({HIDDEN}, {WIDE}), "float32"),
             w2: R.Tensor(({WIDE}, {HIDDEN}), "float32")) -> R.Tensor(("n", {HIDDEN}), "float32"):
        # x + relu(x @ w1) @ w2, n a run-time extent
        R.func_attr({{"num_input": 1}})
        with R.dataflow():
            h = R.nn.relu(R.matmul(x, w1))
            out = R.add(x, R.matmul(h, w2))
            R.output(out)
        return out
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "model.py"
    path.write_text(SCRIPT)
    return path


def test_function_and_size_plan_a_named_function_at_an_example_size(model, tmp_path, capsys):
    import yaml

    out = tmp_path / "rules.yaml"
    budget = HIDDEN * WIDE * 4 + (160 << 10)  # half the weights and some activations
    assert main(["autoshard", str(model), "--mesh", "2", "--function", "step", "--size",
                 "n=32", "--memory", str(budget), "-o", str(out)]) == 0
    assert "n=32" in capsys.readouterr().err
    rules = {r["param"]: (r["result"], r["function"]) for r in yaml.safe_load(out.read_text())}
    assert rules["w1"] == ("S[1]", "step") and rules["w2"] == ("S[0]", "step")
    assert rules["x"] == ("R", "step")  # a run-time extent is never split


def test_a_missing_function_names_the_ones_there(model, capsys):
    assert main(["autoshard", str(model), "--mesh", "2"]) == 2
    assert "its functions: step (--function step)" in capsys.readouterr().err


def test_a_missing_size_hints_the_flag(model, capsys):
    assert main(["autoshard", str(model), "--mesh", "2", "--function", "step"]) == 2
    err = capsys.readouterr().err
    assert "'n'" in err and "--size n=128" in err and "sizes=" not in err
    assert main(["autoshard", str(model), "--mesh", "2", "--function", "step", "--size",
                 "seq=4"]) == 2
    assert "its symbolic extents: n" in capsys.readouterr().err
    assert main(["autoshard", str(model), "--mesh", "2", "--function", "step", "--size",
                 "n"]) == 2
    assert "--size takes NAME=INT" in capsys.readouterr().err
    assert main(["autoshard", str(model), "--mesh", "2", "--function", "step", "--size",
                 "n=32", "--memory", "1KiB"]) == 2
    err = capsys.readouterr().err
    assert "priced at n=32" in err and "give smaller --size NAME=INT" in err
