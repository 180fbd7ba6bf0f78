"""Legalization and lowering of distributed IR (installed as ``tvm_distx.legalize``).

- :class:`LowerDistIR` lowers a DTensor module to the rank-local program, calls
  between functions included, with all-reduces over exactly the mesh axes that
  shard each reduction.
"""

from .lower_distir import CollectiveGroup, LowerDistIR

__all__ = ["LowerDistIR", "CollectiveGroup"]
