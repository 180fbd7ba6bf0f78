"""Token generation with a sharded causal language model.

- :mod:`~tvm_distx.llm.causal_lm`: :class:`~tvm_distx.llm.causal_lm.CausalLM`, a model
  sharded over ranks that stay up between calls; its generation loop is
  :class:`tvm_distx.generation.generator.Generator`, which needs no TVM.
"""

from tvm_distx.llm.causal_lm import CausalLM

__all__ = ["CausalLM"]
