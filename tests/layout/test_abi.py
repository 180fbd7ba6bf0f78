"""The send/recv spec's run-time extents: validated, resolved from a block, announced."""

from __future__ import annotations

import pytest

from tvm_distx.ccl import RUN_TIME, SendRecvSpec
from tvm_distx.errors import ShardingError
from tvm_distx.layout import DeviceMesh, Placement, TensorSharding


def _on(first: int, size: int, placement: str) -> TensorSharding:
    return TensorSharding(DeviceMesh((size,), range(first, first + size)),
                          Placement.parse(placement))


def test_a_run_time_extent_is_read_from_a_block_and_announced_to_the_ranks_that_lack_it():
    spec = SendRecvSpec((RUN_TIME, 8), _on(0, 1, "R"), _on(1, 2, "S[1]"))
    assert spec.run_time_dims == (0,)
    assert spec.resolved((5, 8)).shape == (5, 8)
    assert spec.encode()[:3] == (2, -1, 8)
    assert SendRecvSpec.decode(spec.encode()) == spec
    header = spec.header()
    assert header.shape == (2,) and header.src == _on(0, 1, "R") and header.dst == _on(1, 2, "R")
    assert spec.resolved((5, 8)).header() is None  # resolved: nothing left to announce


def test_ranks_that_hold_the_source_need_no_announcement():
    within = SendRecvSpec((RUN_TIME, 8), _on(0, 2, "S[1]"), _on(0, 2, "R"))
    assert within.header() is None


def test_a_run_time_extent_cannot_be_split_by_a_move():
    with pytest.raises(ShardingError, match="cannot split dimension 0, whose extent is known "
                       "at run time only"):
        SendRecvSpec((RUN_TIME, 8), _on(0, 1, "R"), _on(1, 2, "S[0]"))
