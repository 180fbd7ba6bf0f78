"""Token generation with a sharded causal language model.

- :mod:`~tvm_distx.llm.causal_lm`: :class:`~tvm_distx.llm.causal_lm.CausalLM`, a model
  sharded over ranks that stay up between calls;
- :mod:`~tvm_distx.llm.batch`: several prompts as one left-padded batch per step.
"""

from tvm_distx.llm.causal_lm import CausalLM

__all__ = ["CausalLM"]
