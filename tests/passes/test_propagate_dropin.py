"""Drop-in check: on single-function modules our pass gives exactly TVM's result.

TVM's own ``PropagateSharding`` is the oracle. Each module in ``tests/data/dropin``
is propagated by both passes, as written and after ``LegalizeOps`` (the order the
distributed pipeline uses), and the results must be structurally equal.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tvm
from tvm import relax
from tvm.relax.distributed.transform import PropagateSharding as TVMPropagateSharding

import tvm_distx as td
from tvm_distx.passes import PropagateSharding
from locations import TESTS_DIR

CORPUS = sorted((TESTS_DIR / "data" / "dropin").glob("*.py"))


def test_corpus_is_large_enough():
    assert len(CORPUS) >= 10


def check_against_tvm(mod):
    try:
        expected = TVMPropagateSharding()(mod)
    except Exception:  # noqa: BLE001 - TVM fails with its own internal errors
        # Where TVM cannot type an operator on DTensors, ours fails too, but with
        # a tvm_distx error that says what to do.
        with pytest.raises(td.errors.ShardingError, match="LegalizeOps"):
            PropagateSharding()(mod)
        return False
    tvm.ir.assert_structural_equal(PropagateSharding()(mod), expected)
    return True


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: p.stem)
def test_same_result_as_tvm(path):
    check_against_tvm(td.load_module(path))


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: p.stem)
def test_same_result_as_tvm_after_legalize(path):
    assert check_against_tvm(relax.transform.LegalizeOps()(td.load_module(path)))
