"""Programs in: TVMScript files, PyTorch modules and Hugging Face causal LMs.

- :mod:`~tvm_distx.frontend.script`: a TVMScript file read (never executed) as a module;
- :mod:`~tvm_distx.frontend.pytorch`: ``from_torch``, through ``torch.export``;
- :mod:`~tvm_distx.frontend.decoder`: ``export_decoder``, a causal LM with its key-value
  cache as explicit state;
- :mod:`~tvm_distx.frontend.torch_ops` and :mod:`~tvm_distx.frontend.torch_moe`: the
  PyTorch operators and sparse MLPs that TVM's frontend lacks.

torch and transformers are imported only when a PyTorch model is imported.
"""
