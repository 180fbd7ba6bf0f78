"""Module passes of tvm_distx (installed as ``tvm_distx.passes``).

- :class:`AnnotateSharding` inserts ``R.dist.annotate_sharding`` from rules.
- :class:`PropagateSharding` propagates shardings through the whole module,
  calls of private functions included.
- :class:`SplitFusedProjections` gives each segment of a fused projection
  (q|k|v, gate|up) its own weight parameter, recording how it is cut from the
  user's weight (:func:`derivations_of`).
- :func:`quantize` stores weights as 16-bit floats or int8/int4 groups and
  decodes them in the program before each read.
- :class:`VocabParallelEmbedding` writes the lookups of a vocabulary-split
  embedding table as masked, offset lookups summed over the ranks.

- :func:`register_sharding_rule` declares how an operator or a ``call_tir``
  kernel shards, as an einsum-like string (``"mk,kn->mn"``).

Propagation reads each call's signature (:mod:`.op_signatures`) from the
rules of :mod:`.relax_op_rules` and :mod:`.tir_access`, registered on import
here, and the users' (:mod:`.user_rules`); :mod:`.sharding_solver` decides the
shardings from them.
"""

from tvm_distx.passes import dist_type_rules, relax_op_rules, tir_access  # noqa: F401 - register the built-in rules
from tvm_distx.passes.annotate_sharding import AnnotateSharding
from tvm_distx.passes.propagate_sharding import PropagateSharding, propagate
from tvm_distx.passes.grouped_attention import GroupedQueryAttention
from tvm_distx.passes.split_fused import SplitFusedProjections, derivations_of
from tvm_distx.passes.quantize import quantize
from tvm_distx.passes.vocab_parallel import VocabParallelEmbedding, vocab_lookups
from tvm_distx.passes.user_rules import register_sharding_rule

__all__ = ["AnnotateSharding", "GroupedQueryAttention", "PropagateSharding", "SplitFusedProjections",
           "VocabParallelEmbedding", "derivations_of", "propagate", "quantize", "register_sharding_rule", "vocab_lookups"]
