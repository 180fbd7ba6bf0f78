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
:mod:`~tvm_distx.autoshard.api`        ``auto_shard``, ``plan_cost``, the report
:mod:`~tvm_distx.autoshard.measure`    ``measure_cost_profile``: measured on MPI ranks
=====================================  ==============================================
"""

from tvm_distx.autoshard.api import AutoShardReport, auto_shard, plan_cost
from tvm_distx.autoshard.costs import DEFAULT_PROFILE, CostProfile
from tvm_distx.autoshard.measure import measure_cost_profile

__all__ = ["AutoShardReport", "CostProfile", "DEFAULT_PROFILE", "auto_shard", "plan_cost",
           "measure_cost_profile"]
