"""Sharding plans: which weights of a model are split, and how.

- :mod:`~tvm_distx.plans.presets`: the ready-made plans (Megatron, data parallel, pipeline);
- :mod:`~tvm_distx.plans.tensor_parallel`: tensor parallelism found from a model's structure;
- :mod:`~tvm_distx.plans.summary`: what such a plan split, block by block;
- :mod:`~tvm_distx.plans.vocab`: vocabulary-parallel embeddings;
- :mod:`~tvm_distx.plans.hf`: plans from a Hugging Face model's ``tp_plan``;
- :mod:`~tvm_distx.plans.moe` and :mod:`~tvm_distx.plans.moe_dispatch`: mixture-of-experts
  plans and the sparse expert dispatch.
"""
