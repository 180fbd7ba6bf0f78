"""The README's Python examples run as written."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_python_blocks_run(capsys, tmp_path):
    # The examples run from a checkout (they read tests/...) and write a bundle
    # into the working directory: run them in a scratch directory that links it.
    (tmp_path / "tests").symlink_to(ROOT / "tests")
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 2
    namespace: dict = {}
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        for block in blocks:
            exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102
    finally:
        os.chdir(cwd)
    out = capsys.readouterr().out
    assert "annotate_sharding" in out  # the annotated module
    assert "function main" in out and "function mlp_1" in out  # the sharding table
    error = float(out.split("max |error|:")[1].split()[0])
    assert error < 1e-5  # the emulated two-rank run equals numpy
    error = float(out.split("torch max |error|:")[1].split()[0])
    assert error < 1e-4  # the imported transformer equals PyTorch
    error = float(out.split("mpi max |error|:")[1].split()[0])
    assert error < 1e-5  # and so does the run on two MPI ranks
    assert "kv decode tokens equal transformers: True" in out  # greedy tokens with the cache
    assert (tmp_path / "bundle" / "manifest.json").is_file()  # the exported bundle
    for b in (2, 6, 10):  # one compile of a symbolic batch, run at three sizes
        error = float(out.split(f"b={b} max |error| vs numpy:")[1].split()[0])
        assert error < 1e-5
    assert "[symbolic-extent] input 'x' of 'main'" in out  # the indivisible batch
    for length in (1, 7, 32):  # the Hugging Face Llama, tensor parallel, one compile
        error = float(out.split(f"hf seq={length} max |error|:")[1].split()[0])
        assert error < 1e-4
    assert "[attention]" in out and "[mlp]" in out  # the plan's blocks
