"""Module passes of tvm_distx (installed as ``tvm_distx.passes``).

- :class:`AnnotateSharding` inserts ``R.dist.annotate_sharding`` from rules.
- :class:`PropagateSharding` propagates shardings through the whole module,
  calls of private functions included.
"""

from .annotate_sharding import AnnotateSharding
from .propagate_sharding import PropagateSharding, propagate

__all__ = ["AnnotateSharding", "PropagateSharding", "propagate"]
