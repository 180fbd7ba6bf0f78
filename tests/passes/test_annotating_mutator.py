"""A user's own ``PyExprMutator`` annotates the calls of a private function, then propagation.

This is what a TVM user writes first: a mutator that puts
``R.dist.annotate_sharding`` on the arguments of every call to a Relax function
(a ``GlobalVar`` call) in ``main``. TVM's ``PropagateSharding`` stops on the result
(it has no rule for such a call); ours gives the Megatron placements inside the
callee, one version for both calls, and the program runs on two MPI ranks equal to
numpy. docs/concepts.md ("Your own pass that annotates calls") shows the same.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax.distributed import Placement
from tvm.relax.distributed import transform as tvm_dist
from tvm.relax.expr_functor import PyExprMutator, mutator

import tvm_distx as td
from locations import TESTS_DIR
from reference import mlp_twice
from test_propagate_sharding import TensorParallelPropagated


@mutator
class AnnotateCallArguments(PyExprMutator):
    """Annotate the arguments ``placements`` names at every call of a module function."""

    def __init__(self, mod: tvm.IRModule, placements: dict[int, str]) -> None:
        super().__init__(mod)
        self.mesh = mod.global_infos["mesh"][0]
        self.placements = {i: Placement.from_text(p) for i, p in placements.items()}

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not isinstance(call.op, tvm.ir.GlobalVar):
            return call
        args = [relax.op.distributed.annotate_sharding(arg, self.mesh, self.placements[i])
                if i in self.placements else arg for i, arg in enumerate(call.args)]
        return relax.Call(call.op, args, call.attrs, call.ty_args, call.span)


@pytest.fixture
def mutated() -> tvm.IRModule:
    mod = td.load_module(TESTS_DIR / "data" / "seed_tensor_parallel.py")  # main calls mlp twice
    mod["main"] = AnnotateCallArguments(mod, {1: "S[1]", 2: "S[0]"}).visit_expr(mod["main"])
    calls = [b.value for b in mod["main"].body.blocks[0].bindings
             if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.GlobalVar)]
    assert len(calls) == 2 and all(  # the mutator annotated A and B at both calls
        isinstance(a, relax.Var) for c in calls for a in c.args)
    return mod


def test_tvms_propagation_stops_at_the_call_of_the_private_function(mutated):
    with pytest.raises(Exception, match="Argument 0 type mismatch"):
        tvm_dist.PropagateSharding()(mutated)


def test_ours_gives_one_tensor_parallel_version_of_the_callee(mutated):
    out = td.PropagateSharding(warn_unlegalized=False)(mutated)
    # x replicated, A split by columns and B by rows inside mlp, its result replicated
    # (the row-parallel product's partial sum completed): both calls share one version
    tvm.ir.assert_structural_equal(out, TensorParallelPropagated)


def test_the_mutated_program_runs_on_two_mpi_ranks_equal_to_numpy(mutated):
    rng = np.random.default_rng(5)
    x, A, B = (0.1 * rng.standard_normal((128, 128), dtype="float32") for _ in range(3))
    out = td.compile(mutated).run(x, A, B, backend="mpi")
    np.testing.assert_allclose(out, mlp_twice(x, A, B), rtol=1e-5, atol=1e-5)
