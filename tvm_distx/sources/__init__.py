"""Model sources: the files weights come from, read a block at a time.

- :mod:`~tvm_distx.sources.checkpoint`: Hugging Face safetensors checkpoints, read lazily
  (:class:`LazyTensor`, :func:`open_checkpoint`);
- :mod:`~tvm_distx.sources.gguf`: llama.cpp's GGUF files (config, tokenizer, tensors in their
  stored formats); :mod:`~tvm_distx.sources.gguf_header` and
  :mod:`~tvm_distx.sources.gguf_tokenizer` read its header and its vocabulary;
- :mod:`~tvm_distx.sources.formats`: the weight formats (f32, bf16, f16, q8, q4) and their
  codecs, shared by the sources, which store weights in them, and bundles, which keep them.

A bundle may link to a block of a source instead of copying it, so this package sits below
:mod:`tvm_distx.bundle`. It imports no TVM.
"""
