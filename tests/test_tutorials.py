"""The tutorial notebooks execute from top to bottom, each within two minutes.

Each notebook ends by checking its own numbers, so a notebook that runs is one
whose claims still hold.
"""

from __future__ import annotations

import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

TUTORIALS = Path(__file__).resolve().parents[1] / "tutorials"
NOTEBOOKS = sorted(TUTORIALS.glob("[0-9][0-9]_*.ipynb"))


def test_the_five_tutorials_exist():
    assert [p.stem for p in NOTEBOOKS] == [
        "01_annotate_and_propagate", "02_redistribute_on_nd_meshes",
        "03_tensor_parallel_pytorch_on_mpi", "04_riscv_rvv_bundle",
        "05_huggingface_llm_on_mpi"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path):
    notebook = nbformat.read(path, as_version=4)
    started = time.monotonic()
    NotebookClient(notebook, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(TUTORIALS)}}).execute()
    assert time.monotonic() - started < 120, f"{path.name} took too long"
