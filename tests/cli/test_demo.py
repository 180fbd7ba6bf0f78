"""The demo job prints the annotated and propagated seed examples."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import tvm

import tvm_distx as td
from tvm_distx.cli.demo import EXAMPLES
from tvm_distx.passes import AnnotateSharding, PropagateSharding
from locations import REPO_ROOT

ROOT = REPO_ROOT


def _script(section: str):
    return tvm.script.from_source(section[section.index("# from tvm.script"):])


def test_demo_prints_each_example_annotated_propagated_and_explained():
    out = subprocess.run(
        [sys.executable, "-m", "tvm_distx.cli.demo"], cwd=ROOT, check=True,
        capture_output=True, text=True,
    ).stdout
    sections = out.split("# ---- ")[1:]
    assert len(sections) == 3 * len(EXAMPLES) + 1
    for i, (filename, rules) in enumerate(EXAMPLES.items()):
        annotated_text, propagated_text, table = sections[3 * i: 3 * i + 3]
        path = str(Path("tests") / "data" / filename)
        assert annotated_text.startswith(f"{path}: annotated by")
        assert propagated_text.startswith(f"{path}: propagated")
        annotated = AnnotateSharding(rules)(td.load_module(ROOT / "tests" / "data" / filename))
        tvm.ir.assert_structural_equal(_script(annotated_text), annotated)
        tvm.ir.assert_structural_equal(_script(propagated_text), PropagateSharding()(annotated))
        assert table.split("\n", 1)[1].strip() == str(td.explain(annotated)).strip()
    assert 'R.dist.redistribute(y, device_mesh="mesh[1]", placement="R")' in out
    run = sections[-1]
    assert run.startswith("tensor-parallel MLP on 2 emulated ranks")
    assert "A (128, 64), B (64, 128)" in run
    assert float(run.split("max |error| against numpy:")[1]) < 1e-5
