"""Legalization and lowering of distributed IR (installed as ``tvm_distx.legalize``).

- :func:`plan_redistribute` plans the cheapest collectives for a change of
  sharding (pure, cached; see :mod:`tvm_distx.legalize.planner`).
- :class:`LowerGlobalViewToLocalView` is TVM's pass, refusing what it gets wrong;
  then :class:`MergeAllReduces` lets partial sums combined linearly share one
  all-reduce (:mod:`~tvm_distx.legalize.linearity` says which kernels are linear).
- :mod:`~tvm_distx.legalize.partial_sums` reads back the partial sums TVM's
  all-reduces complete and plans their completion (all-reduce or reduce-scatter).
- :class:`LegalizeRedistribute` replaces every redistribute by the collectives
  the planner chose, each along one mesh axis.
- :class:`LowerDistIR` lowers a DTensor module to the rank-local program, calls
  between functions included, with all-reduces over exactly the mesh axes that
  shard each reduction.
"""

from tvm_distx.legalize.legalize_redistribute import LegalizeRedistribute
from tvm_distx.legalize.local_view import LowerGlobalViewToLocalView
from tvm_distx.legalize.lower_distir import CollectiveGroup, LowerDistIR
from tvm_distx.legalize.merge_allreduce import MergeAllReduces
from tvm_distx.legalize.planner import Collective, RedistPlan, RedistStep, lower_bound_bytes, plan_redistribute

__all__ = [
    "LegalizeRedistribute",
    "LowerGlobalViewToLocalView",
    "LowerDistIR",
    "MergeAllReduces",
    "CollectiveGroup",
    "plan_redistribute",
    "lower_bound_bytes",
    "RedistPlan",
    "RedistStep",
    "Collective",
]
