"""The demo job prints the annotated and propagated seed examples, says what each section
shows, and ends with where to go next."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import tvm

import tvm_distx as td
from tvm_distx.cli.demo import EXAMPLES, NOTES, WHAT_NEXT
from tvm_distx.passes import AnnotateSharding, PropagateSharding
from locations import REPO_ROOT

ROOT = REPO_ROOT


def _script(section: str):
    return tvm.script.from_source(section[section.index("# from tvm.script"):])


def _notes(section: str) -> list[str]:
    return [line[4:] for line in section.splitlines() if line.startswith("# > ")]


def _demo() -> str:
    return subprocess.run(
        [sys.executable, "-m", "tvm_distx.cli.demo"], cwd=ROOT, check=True,
        capture_output=True, text=True,
    ).stdout


def test_demo_prints_each_example_annotated_propagated_and_explained():
    out = _demo()
    intro, *sections = out.split("# ---- ")
    assert "R replicated" in intro and "S[k] split" in intro and "P a partial sum" in intro
    assert len(sections) == 3 * len(EXAMPLES) + 2
    for i, (filename, rules) in enumerate(EXAMPLES.items()):
        annotated_text, propagated_text, table = sections[3 * i: 3 * i + 3]
        path = str(Path("tests") / "data" / filename)
        assert annotated_text.startswith(f"{path}: annotated by")
        assert propagated_text.startswith(f"{path}: propagated")
        annotated = AnnotateSharding(rules)(td.load_module(ROOT / "tests" / "data" / filename))
        tvm.ir.assert_structural_equal(_script(annotated_text), annotated)
        tvm.ir.assert_structural_equal(_script(propagated_text), PropagateSharding()(annotated))
        assert _notes(annotated_text) == NOTES[filename]["annotated"]
        assert _notes(propagated_text) == NOTES[filename]["propagated"]
        assert _notes(table) == NOTES[filename]["explained"]
        shown = "\n".join(line for line in table.split("\n")[1:] if not line.startswith("# > "))
        assert shown.strip() == str(td.explain(annotated)).strip()
    assert 'R.dist.redistribute(y, device_mesh="mesh[1]", placement="R")' in out
    run = sections[-2]
    assert run.startswith("tensor-parallel MLP on 2 emulated ranks")
    assert "A (128, 64), B (64, 128)" in run
    assert float(run.split("max |error| against numpy:")[1]) < 1e-5


def test_every_name_a_note_explains_is_in_the_section_it_explains():
    sections = _demo().split("# ---- ")[1:]
    for i, filename in enumerate(EXAMPLES):
        for kind, section in zip(("annotated", "propagated", "explained"),
                                 sections[3 * i: 3 * i + 3]):
            body = "\n".join(line for line in section.splitlines() if not line.startswith("# > "))
            for name in re.findall(r"\b(\w+_(?:redist|ann|1)|lv\d|mesh\[\d\]|S\[\d\])",
                                   " ".join(NOTES[filename][kind])):
                assert name in body, (filename, kind, name)
    pipeline = " ".join(NOTES["seed_pipeline.py"]["propagated"])
    for name in ("A_redist", "B_redist", "mlp_1"):  # what newcomers asked about
        assert name in pipeline


def test_the_demo_ends_with_what_next_and_its_places_exist():
    last = _demo().split("# ---- ")[-1]
    assert last.splitlines() == ["what next", *WHAT_NEXT]
    places = re.findall(r"\b((?:README|docs/\w+|tutorials/README)\.md)\b", "\n".join(WHAT_NEXT))
    assert places == ["README.md", "tutorials/README.md", "docs/cli.md", "docs/index.md"]
    for place in places:
        assert (ROOT / place).is_file(), place
    assert "scripts/demo --full" in "\n".join(WHAT_NEXT)
    assert "--full" in (ROOT / "scripts" / "demo").read_text()
