"""Every Python example in the README and in docs/ runs as written, on its own, and prints the
right thing.

Each ```python block (of ``README.md`` and every ``docs/**/*.md``) is executed alone, in a fresh namespace and a scratch directory that
links the checkout's ``tests/`` (the examples read ``tests/data``): a block that leans on a
name defined by another block fails with a NameError here. Each block is recognised by a
phrase only it contains, and must have a check below, so a new example cannot go untested.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Pages whose examples need a running server: tests/serving/test_serving_docs.py runs them
#: against one.
LIVE_SERVER_PAGES = {ROOT / "docs" / "serving.md"}
PAGES = [page for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
         if page not in LIVE_SERVER_PAGES]
#: (page, block) for every ```python block, in page order.
BLOCKS = [(page.relative_to(ROOT).as_posix(), block) for page in PAGES
          for block in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)]


def _error(out: str, label: str) -> float:
    assert label in out, out
    return float(out.split(label)[1].split()[0])


def _annotate(out: str, scratch: Path) -> None:
    assert "annotate_sharding" in out and "mesh[1]" in out  # both pipeline stages annotated


def _tour(out: str, scratch: Path) -> None:
    assert "function mlp" in out and "S[1]" in out  # explain's table
    assert _error(out, "mpi max |error|:") < 1e-5  # two MPI ranks equal numpy
    assert (scratch / "tour" / "bundle" / "manifest.json").is_file()  # the exported bundle


def _propagate(out: str, scratch: Path) -> None:
    assert "function main" in out and "function mlp" in out
    assert "(128, 64)" in out  # A's local shape on each rank


def _lower(out: str, scratch: Path) -> None:
    assert _error(out, "max |error|:") < 1e-5  # the emulated two-rank run equals numpy


def _mixed(out: str, scratch: Path) -> None:
    assert "mixed pipeline well formed: True" in out


def _session(out: str, scratch: Path) -> None:
    assert _error(out, "session max |error|:") < 1e-5
    assert "ranks: 2" in out


def _symbolic(out: str, scratch: Path) -> None:
    for b in (2, 6, 10):  # one compile of a symbolic batch, run at three sizes
        # outputs near 16 (sums of 64 products of numbers in [0, 1)): float32 rounding,
        # summed in another order than numpy's, is about 1e-6 of them
        assert _error(out, f"b={b} max |error| vs numpy:") < 1e-4
    assert "[symbolic-extent] input 'x' of 'main'" in out  # the indivisible batch


def _torch(out: str, scratch: Path) -> None:
    assert _error(out, "torch max |error|:") < 1e-4  # the imported transformer equals PyTorch


def _auto_shard(out: str, scratch: Path) -> None:
    assert "solver: optimal" in out  # the integer program was solved exactly
    assert _error(out, "auto_shard max |error|:") < 1e-4  # and its plan runs equal to torch


def _hf(out: str, scratch: Path) -> None:
    for length in (1, 7, 32):  # the Hugging Face Llama, tensor parallel, one compile
        assert _error(out, f"hf seq={length} max |error|:") < 1e-4
    assert "[attention]" in out and "[mlp]" in out  # the plan's blocks


def _kv(out: str, scratch: Path) -> None:
    assert "kv decode tokens equal transformers: True" in out


def _causal_lm(out: str, scratch: Path) -> None:
    assert "CausalLM equals transformers: True" in out
    assert "tokens/s" in out


def _sampling(out: str, scratch: Path) -> None:
    assert "same seed, same tokens: True" in out


def _text(out: str, scratch: Path) -> None:
    assert "streamed text equals the text: True" in out


def _user_rule(out: str, scratch: Path) -> None:
    assert "x      (64, 32)      mesh[0]  S[1]" in out  # explain: x split on the summed axis
    assert "w      (32, 16)      mesh[0]  S[0]" in out  # w split to match, by the user's rule
    assert "y      (64, 16)      mesh[0]  P" in out  # a partial sum, completed by an all-reduce
    # sums of 32 products of standard normals (up to about 20): float32 rounding, in
    # another order than numpy's, is a few 1e-6
    assert _error(out, "user rule max |error|:") < 1e-4  # two MPI ranks equal numpy


def _mutator(out: str, scratch: Path) -> None:
    assert "TVM's PropagateSharding fails: Argument 0 type mismatch" in out
    assert "mlp after ours: ['R', 'S[1]', 'S[0]']" in out
    assert _error(out, "mutator max |error|:") < 1e-5  # two emulated ranks equal numpy


def _quantized(out: str, scratch: Path) -> None:
    assert "['down', 'down_scale', 'up', 'up_scale']" in out
    assert _error(out, "quantized max |error|:") < 1e-4


#: A phrase only one block contains, and what that block must print.
CHECKS = {
    "seed_pipeline.py": _annotate,
    "mpi max |error|": _tour,
    "mod = PropagateSharding()(annotated)": _propagate,
    "emulate(exe, shards": _lower,
    "session max |error|": _session,
    "mixed pipeline well formed": _mixed,
    "data_parallel_symbolic.py": _symbolic,
    "torch max |error|": _torch,
    "hf seq=": _hf,
    "auto_shard max |error|": _auto_shard,
    "kv decode tokens": _kv,
    "CausalLM equals transformers": _causal_lm,
    "quantized max |error|": _quantized,
    "user rule max |error|": _user_rule,
    "mutator max |error|": _mutator,
    "same seed, same tokens": _sampling,
    "streamed text equals the text": _text,
}


def _check_for(block: str):
    found = [phrase for phrase in CHECKS if phrase in block]
    assert len(found) == 1, f"a documented block needs exactly one check, it matches {found}:\n{block}"
    return CHECKS[found[0]]


def test_every_block_has_one_check_and_every_check_a_block():
    assert len(BLOCKS) == len(CHECKS)
    assert {_check_for(block) for _, block in BLOCKS} == set(CHECKS.values())


def test_the_tour_stays_in_the_readme():
    assert "mpi max |error|" in "".join(b for page, b in BLOCKS if page == "README.md")


def _block_id(page: str, block: str) -> str:
    phrase = next((p for p in CHECKS if p in block), "unchecked")
    return f"{page}:" + phrase.split("(")[0].strip(" .=|").replace(" ", "-")


@pytest.mark.parametrize("page,block", BLOCKS, ids=[_block_id(*pb) for pb in BLOCKS])
def test_documented_block_runs_alone(page, block, capsys, tmp_path):
    check = _check_for(block)
    (tmp_path / "tests").symlink_to(ROOT / "tests")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        exec(compile(block, page, "exec"), {"__name__": "__readme__"})  # noqa: S102
    finally:
        os.chdir(cwd)
    check(capsys.readouterr().out, tmp_path)
