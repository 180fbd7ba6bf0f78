"""Sharding views: tensor pictures (terminal and PNG), sharding tables, comm tables."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

import tvm_distx as td
from tvm_distx import DeviceMesh, Placement, ShardingRule
from tvm_distx.passes import AnnotateSharding
from tvm_distx.layout import TensorSharding
from tvm_distx.reports.views import (comm_table, plot_tensor_sharding, plot_value, sharding_tables,
                             show_tensor_sharding, show_value, tensor_blocks)
from locations import TESTS_DIR

DATA = TESTS_DIR / "data"
MESH = DeviceMesh((2, 2), range(0, 4), "mesh[0]")


def render(renderable_or_call) -> str:
    console = Console(width=100, record=True, color_system=None, file=open("/dev/null", "w"))
    renderable_or_call(console)
    return console.export_text()


def sharded(text: str) -> TensorSharding:
    return TensorSharding(MESH, Placement.parse(text))


def test_a_2d_split_is_a_grid_of_one_device_per_block():
    text = render(lambda c: show_tensor_sharding(sharded("S[0]S[1]"), (8, 12), console=c))
    assert text == (
        "    S[0]S[1] on mesh[0]     \n"
        "┌────────────┬─────────────┐\n"
        "│   dev 0    │    dev 1    │\n"
        "│ [0:4, 0:6] │ [0:4, 6:12] │\n"
        "├────────────┼─────────────┤\n"
        "│   dev 2    │    dev 3    │\n"
        "│ [4:8, 0:6] │ [4:8, 6:12] │\n"
        "└────────────┴─────────────┘\n")


def test_replicas_and_nested_splits():
    # RS[0]: dimension 0 split over mesh axis 1; devices 0 and 2 hold the same rows
    assert [(b.rows, b.devices) for b in tensor_blocks(sharded("RS[0]"), (8, 12))] == [
        ((0, 4), (0, 2)), ((4, 8), (1, 3))]
    # S[0]S[0]: mesh axis 0 is the outer split, so device 1 holds rows 2..3
    assert [(b.rows, b.devices) for b in tensor_blocks(sharded("S[0]S[0]"), (8, 12))] == [
        ((0, 2), (0,)), ((2, 4), (1,)), ((4, 6), (2,)), ((6, 8), (3,))]
    assert "dev 0,2" in render(lambda c: show_tensor_sharding(sharded("RS[0]"), (8, 12),
                                                                console=c))


def test_png_has_one_rectangle_per_block(tmp_path):
    figure = plot_tensor_sharding(sharded("S[0]S[1]"), (8, 12), path=tmp_path / "s.png")
    assert len(figure.axes[0].patches) == 4
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def annotated():
    mod = td.load_module(DATA / "seed_tensor_parallel.py")
    return AnnotateSharding([ShardingRule(param="A", result="S[1]", function="mlp"),
                             ShardingRule(param="B", result="S[0]", function="mlp")])(mod)


def test_sharding_tables_hold_the_rows_of_explain(annotated):
    tables = sharding_tables(annotated)
    assert [t.title for t in tables] == ["function mlp", "function main"]
    text = render(lambda c: [c.print(t) for t in tables])
    assert "(128, 64)" in text and "S[1]" in text and "annotate_sharding" in text


def test_one_value_of_a_module_in_the_terminal_and_as_png(annotated, tmp_path):
    text = render(lambda c: show_value(annotated, "mlp", "A", console=c))
    assert "[0:128, 0:64]" in text and "[0:128, 64:128]" in text
    plot_value(annotated, "mlp", "B", path=tmp_path / "b.png")
    assert (tmp_path / "b.png").stat().st_size > 0
    with pytest.raises(td.errors.ArgumentError, match="no tensor value 'Q'"):
        show_value(annotated, "mlp", "Q")


def test_comm_table_has_readable_sizes_and_the_total(annotated):
    from tvm import relax
    from tvm.relax.distributed import transform as dist_transform

    from tvm_distx.passes import PropagateSharding

    local = dist_transform.LowerGlobalViewToLocalView()(PropagateSharding(
        require_legalized=True)(relax.transform.LegalizeOps()(annotated)))
    text = render(lambda c: c.print(comm_table(td.comm_report(local))))
    assert "all_reduce" in text and "65,536 (64.0 KiB)" in text and "total" in text
