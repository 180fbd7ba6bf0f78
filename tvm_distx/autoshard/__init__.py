"""Automatic sharding: every placement chosen by cost, under a memory budget.

=====================================  ==============================================
module                                 what it does
=====================================  ==============================================
:mod:`~tvm_distx.autoshard.costs`      ``CostProfile`` (flops/s, bytes/s, latency per
                                       message), saved and loaded as JSON
:mod:`~tvm_distx.autoshard.graph`      the problem as pure data: nodes, strategies from
                                       the operator rules, repeated layers (no TVM)
:mod:`~tvm_distx.autoshard.ilp`        the integer program (HiGHS via scipy), the
                                       exact cost of a plan
:mod:`~tvm_distx.autoshard.extract`    a Relax function read into the problem
:mod:`~tvm_distx.autoshard.inline`     calls to private functions inlined, to plan
                                       through them (call site ``k`` = layer ``k``)
:mod:`~tvm_distx.autoshard.api`        ``auto_shard``, ``plan_cost``, the report
:mod:`~tvm_distx.autoshard.measure`    ``profile``: the profile measured on MPI ranks
=====================================  ==============================================
"""

from tvm_distx.autoshard.api import AutoShardReport, auto_shard, plan_cost
from tvm_distx.autoshard.costs import DEFAULT_PROFILE, CostProfile
from tvm_distx.autoshard.measure import measure_profile

__all__ = ["AutoShardReport", "CostProfile", "DEFAULT_PROFILE", "auto_shard", "plan_cost",
           "profile"]


def profile(num_ranks: int = 2, backend: str = "mpi", **kwargs) -> CostProfile:
    """Measure the cost profile on ``num_ranks`` ranks (see :mod:`.measure`)."""

    return measure_profile(num_ranks, backend, **kwargs)
