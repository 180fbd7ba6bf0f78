"""The bundle format: what a compiled program promises its ranks.

A bundle is a directory with the compiled library, each rank's weights and a
``manifest.json``. This package reads and checks it, and is shared by the
compiler (which writes bundles) and the runtime (which runs them):

- :mod:`~tvm_distx.bundle.manifest`: the manifest, its checks and the weight files;
- :mod:`~tvm_distx.bundle.signature`: each function's inputs and outputs, global and per rank;
- :mod:`~tvm_distx.bundle.checkpoint`: Hugging Face checkpoints read lazily, a block at a time;
- :mod:`~tvm_distx.bundle.formats`: the weight formats (f32, bf16, f16, q8, q4) and their codecs;
- :mod:`~tvm_distx.bundle.gguf`: llama.cpp's GGUF files (config, tokenizer, tensors in their
  stored formats), read a block at a time.

It imports no compiler module and no TVM.
"""
