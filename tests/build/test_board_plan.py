"""Rank plans (prototype, issue 31): the VM's own per-rank Relax program, written as data."""

from __future__ import annotations

import json

import pytest
import tvm

import tvm_distx as td
from tvm_distx import AnnotateSharding, ShardingRule
from tvm_distx.build.board_plan import lower_for_vm, rank_plan
from locations import TESTS_DIR


@pytest.fixture(scope="module")
def plan():
    mod = td.load_module(TESTS_DIR / "data" / "seed_tensor_parallel.py")
    rules = [ShardingRule(param="A", result="S[1]", function="mlp"),
             ShardingRule(param="B", result="S[0]", function="mlp")]
    exe = td.compile(AnnotateSharding(rules)(mod))
    return rank_plan(lower_for_vm(exe.built, tvm.target.Target("llvm")))


def test_the_plan_of_the_seed_program_is_its_kernels_calls_and_one_all_reduce(plan):
    assert json.loads(json.dumps(plan)) == plan  # plain data
    mlp = plan["functions"]["mlp"]
    calls = [(i["op"], i.get("name")) for i in mlp["body"]
             if i["op"] in ("kernel", "call", "builtin") and "check" not in i.get("name", "")
             and "match_shape" not in i.get("name", "")]
    assert calls == [("kernel", "fused_matmul1_relu1"), ("kernel", "matmul2"),
                     ("builtin", "tvm_distx.ccl.allreduce")]
    assert [i["name"] for i in plan["functions"]["main"]["body"] if i["op"] == "call"] == [
        "mlp", "mlp"]
    sizes = [i["args"][0]["shape"] for i in mlp["body"] if i["op"] == "alloc_storage"]
    assert sizes == [[32768], [65536], [65536]]  # bytes: (128, 64) and twice (128, 128) float32
    assert set(plan["kernels"]) == {"fused_matmul1_relu1", "matmul2"}
