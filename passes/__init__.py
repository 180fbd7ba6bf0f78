"""Module passes of tvm_distx (installed as ``tvm_distx.passes``).

- :class:`AnnotateSharding` inserts ``R.dist.annotate_sharding`` from rules.
"""

from .annotate_sharding import AnnotateSharding

__all__ = ["AnnotateSharding"]
