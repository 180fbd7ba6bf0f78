"""The tutorial notebooks execute from top to bottom, each within two minutes, and leave
nothing behind.

Each notebook ends by checking its own numbers, so a notebook that runs is one
whose claims still hold. Each runs with a temporary directory of its own (``TMPDIR``),
which must be empty afterwards, and must leave ``git status`` of the checkout as it was.
Each is stored with its outputs, so that it reads as a page before anyone runs it.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = ROOT / "tutorials"
NOTEBOOKS = sorted(TUTORIALS.glob("[0-9][0-9]_*.ipynb"))
#: What others keep in TMPDIR on purpose: torch.export's compile cache (one per user, reused
#: by every later run), not a file of the notebook's.
CACHES = ("torchinductor_",)


def test_the_five_tutorials_exist():
    assert [p.stem for p in NOTEBOOKS] == [
        "01_annotate_and_propagate", "02_redistribute_on_nd_meshes",
        "03_tensor_parallel_pytorch_on_mpi", "04_riscv_rvv_bundle",
        "05_huggingface_llm_on_mpi"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_stored_with_its_outputs(path):
    notebook = json.loads(path.read_text())
    code = [c for c in notebook["cells"] if c["cell_type"] == "code"]
    assert all(c["execution_count"] for c in code), path.name  # every cell was run
    # in order, from the top, in one kernel
    assert [c["execution_count"] for c in code] == list(range(1, len(code) + 1)), path.name
    assert code[-1]["outputs"], path.name  # the last check printed what it found
    text = json.dumps([c["outputs"] for c in code])
    for private in ("/work/", "/home/", "/root/", "site-packages"):
        assert private not in text, (path.name, private)  # no path of the machine that ran it


def _git_status() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--ignored", "--", "."],
                          cwd=ROOT, capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path, tmp_path, monkeypatch):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))  # the kernel's, and what it starts
    before = _git_status()
    notebook = nbformat.read(path, as_version=4)
    started = time.monotonic()
    NotebookClient(notebook, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(TUTORIALS)}}).execute()
    assert time.monotonic() - started < 120, f"{path.name} took too long"
    left = sorted(p.name for p in tmp.iterdir() if not p.name.startswith(CACHES))
    assert left == [], f"{path.name} left files in its TMPDIR"
    assert _git_status() == before, f"{path.name} left files in the checkout"
