"""The demo job prints the annotated seed examples."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import tvm

import tvm_distx as td
from tvm_distx.demo import EXAMPLES
from tvm_distx.passes import AnnotateSharding

ROOT = Path(__file__).resolve().parents[1]


def test_demo_prints_each_annotated_example():
    out = subprocess.run(
        [sys.executable, "-m", "tvm_distx.demo"], cwd=ROOT, check=True,
        capture_output=True, text=True,
    ).stdout
    sections = out.split("# ---- ")[1:]
    assert len(sections) == len(EXAMPLES)
    for section, (filename, rules) in zip(sections, EXAMPLES.items()):
        assert section.startswith(str(Path("tests") / "data" / filename))
        script = section[section.index("# from tvm.script"):]
        printed = tvm.script.from_source(script)
        expected = AnnotateSharding(rules)(td.load_module(ROOT / "tests" / "data" / filename))
        tvm.ir.assert_structural_equal(printed, expected)
    assert 'annotate_sharding(y, device_mesh="mesh[1]", placement="R")' in out
