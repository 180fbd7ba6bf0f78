"""Cost-aware propagation: where equally firm decisions disagree, the cheaper split wins.

``a`` (4 x 1024) arrives split on its columns and ``w`` (1024 x 64) on its
columns, both by annotation. The matmul can keep ``a``'s split (a split
contraction: ``w`` is re-split by rows and the small result is all-reduced) or
``w``'s (``a`` is gathered). Gathering ``a`` moves 2,048 elements per rank,
re-splitting ``w`` alone 16,384: the solver keeps ``w`` split, says why in
``explain``, and the program runs equal to numpy on 2 MPI ranks.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import tvm_distx as td
from tvm_distx.passes import PropagateSharding
from tvm_distx.compiler.pipeline import legalize_ops, run_stages


@I.ir_module
class Disagree:
    I.module_attrs({"device_num": 2})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(a: R.Tensor((4, 1024), "float32"), w: R.Tensor((1024, 64), "float32")
             ) -> R.Tensor((4, 64), "float32"):
        a_cols = R.dist.annotate_sharding(a, device_mesh="mesh[0]", placement="S[1]")
        w_cols = R.dist.annotate_sharding(w, device_mesh="mesh[0]", placement="S[1]")
        y = R.matmul(a_cols, w_cols)
        return y


@I.ir_module
class Expected:
    I.module_attrs({"device_num": 2})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(a: R.dist.DTensor((4, 1024), "float32", "mesh[0]", "S[1]"),
             w: R.dist.DTensor((1024, 64), "float32", "mesh[0]", "S[1]")
             ) -> R.dist.DTensor((4, 64), "float32", "mesh[0]", "S[1]"):
        a_cols_redist: R.dist.DTensor((4, 1024), "float32", "mesh[0]", "R") = \
            R.dist.redistribute(a, device_mesh="mesh[0]", placement="R")
        y: R.dist.DTensor((4, 64), "float32", "mesh[0]", "S[1]") = R.matmul(a_cols_redist, w)
        return y


def test_the_cheaper_split_wins_a_tie_between_annotations():
    tvm.ir.assert_structural_equal(PropagateSharding()(Disagree), Expected)


def test_explain_gives_the_choice_and_its_cost():
    why = td.explain(legalize_ops(Disagree)).row("main", "y").reason
    assert "moves 2,048" in why and "cheaper than" in why and "moves 16,640" in why, why


def test_the_chosen_plan_runs_equal_to_numpy_on_two_mpi_ranks():
    rng = np.random.default_rng(5)
    a = rng.standard_normal((4, 1024), dtype=np.float32)
    w = rng.standard_normal((1024, 64), dtype=np.float32)
    rows = td.comm_report(run_stages(Disagree)["local_view"]).rows
    assert [r.collective for r in rows] == ["all_gather"]  # of a; w stays split
    relax.analysis.well_formed(run_stages(Disagree)["lower_distir"])
    got = td.compile(Disagree).run(a, w, backend="mpi")
    np.testing.assert_allclose(got, a @ w, rtol=1e-4, atol=1e-3)
