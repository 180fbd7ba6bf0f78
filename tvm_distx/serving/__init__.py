"""Serving a model over HTTP: an OpenAI-compatible API (:mod:`tvm_distx.serving.openai_app`)
on one generation worker that owns the ranks (:mod:`tvm_distx.generation.worker`)."""
