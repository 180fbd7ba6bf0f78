"""Generation: the token loop over any session, with no TVM and no compiler.

- :mod:`~tvm_distx.generation.generator`: :class:`Generator` (prefill in chunks, decode
  step by step, greedy or sampled, token ids or text) over a session's ``prefill`` and
  ``decode`` functions;
- :mod:`~tvm_distx.generation.batch`: a left-padded batch of prompts as one prefill and one
  decode per step;
- :mod:`~tvm_distx.generation.sampling`: :class:`Sampling` (transformers' processors) and the
  seeded draw;
- :mod:`~tvm_distx.generation.text`: :class:`Tokenizer`, chat templates and text streams;
- :mod:`~tvm_distx.generation.opened_bundle`: :class:`OpenedBundle`, a generation bundle
  read once (its manifest, ``generation.json`` and tokenizer) and what it rules out;
- :mod:`~tvm_distx.generation.worker`: :class:`GenerationWorker`, the one thread that runs
  requests on the ranks for a server.

:class:`tvm_distx.CausalLM`, the HTTP server (:mod:`tvm_distx.serving`) and a board's
``./run.sh generate`` all generate through this package.
"""
