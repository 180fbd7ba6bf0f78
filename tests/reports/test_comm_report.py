"""comm_report: the collectives a program will run, with bytes per rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from tvm import relax
from tvm.relax.distributed import transform as dist_transform

import tvm_distx as td
from tvm_distx import ShardingRule
from tvm_distx.compiler.pipeline import run_stages
from tvm_distx.reports.comm_report import comm_report
from tvm_distx.passes import AnnotateSharding, PropagateSharding

from programs import moved
from locations import TESTS_DIR

DATA = TESTS_DIR / "data"


def test_all_to_all_moves_t_times_p_minus_1_over_p_squared():
    mod = PropagateSharding(require_legalized=True)(relax.transform.LegalizeOps()(
        moved("S[0]", "S[1]", (4,))))
    report = comm_report(mod)
    assert [(r.collective, r.mesh_axis, r.src, r.dst) for r in report.rows] == [
        ("all_to_all", 0, "S[0]", "S[1]")]
    tensor = 8 * 12 * 4 * 4
    assert report.rows[0].bytes_per_rank == tensor * 3 // 16
    assert report.total_bytes_per_rank == tensor * 3 // 16


def test_tensor_parallel_mlp_reports_its_all_reduces():
    mod = td.load_module(DATA / "seed_tensor_parallel.py")
    rules = [ShardingRule(param="A", result="S[1]", function="mlp"),
             ShardingRule(param="B", result="S[0]", function="mlp")]
    legal = relax.transform.LegalizeOps()(AnnotateSharding(rules)(mod))
    local = dist_transform.LowerGlobalViewToLocalView()(
        PropagateSharding(require_legalized=True)(legal))
    report = comm_report(local)
    assert [(r.function, r.collective, r.mesh_axis) for r in report.rows] == [
        ("mlp", "all_reduce", 0)]
    # a ring all-reduce of the 128x128 float32 result over 2 ranks
    assert report.rows[0].bytes_per_rank == 2 * 128 * 128 * 4 // 2
    text = str(report)
    assert "all_reduce" in text and "total bytes received per rank: 65,536" in text


def test_moves_between_pipeline_stages_are_send_recv_rows_naming_both_meshes():
    mod = td.load_module(DATA / "seed_pipeline.py")
    rule = ShardingRule(callee="mlp", args={0: "R"}, meshes=["mesh[0]", "mesh[1]"])
    propagated = PropagateSharding(require_legalized=True)(
        relax.transform.LegalizeOps()(AnnotateSharding([rule])(mod)))
    report = comm_report(propagated)
    block = 128 * 128 * 4  # stage 1 receives y and both weights whole
    assert [(r.value, r.collective, r.mesh_axis, r.src, r.dst, r.bytes_per_rank)
            for r in report.rows] == [
        (v, "send_recv", None, "R on mesh[0]", "R on mesh[1]", block)
        for v in ("y_ann", "A_redist", "B_redist")]
    assert report.total_bytes_per_rank == 3 * block


def test_a_kernel_on_a_nested_split_reports_the_all_gather_that_feeds_it():
    # relu on "S[0]S[0]" runs on "S[0]R" after the local view: an all-gather along
    # mesh axis 1 of the 8x12x4 float32 tensor in, a local slice out.
    stages = run_stages(moved("S[0]S[0]", "S[0]S[0]", (2, 2)))
    report = comm_report(stages["local_view"])
    assert [(r.collective, r.mesh_axis, r.src, r.dst) for r in report.rows] == [
        ("all_gather", 1, "S[0]S[0]", "S[0]R"), ("local_slice", 1, "S[0]R", "S[0]S[0]")]
    assert report.total_bytes_per_rank == 8 * 12 * 4 * 4 // 4  # the quarter it lacks


def test_a_module_not_yet_propagated_is_refused_not_reported_empty():
    with pytest.raises(td.errors.ArgumentError, match="needs a propagated module") as info:
        comm_report(moved("S[0]", "S[1]", (4,)))
    assert "'main'" in str(info.value) and "PropagateSharding" in info.value.hint
