"""The bundle format: what a compiled program promises its ranks.

A bundle is a directory with the compiled library, each rank's weights and a
``manifest.json``. This package reads and checks it, and is shared by the
compiler (which writes bundles) and the runtime (which runs them):

- :mod:`~tvm_distx.bundle.manifest`: the manifest, its checks and the weight files;
- :mod:`~tvm_distx.bundle.signature`: each function's inputs and outputs, global and per rank;
- :mod:`~tvm_distx.bundle.generation`: ``generation.json`` and the key-value cache's layout.

The weights a bundle holds are in the formats of :mod:`tvm_distx.sources.formats`; a
bundle may link to blocks of a checkpoint or GGUF file (:mod:`tvm_distx.sources`) instead
of copying them.

It imports no compiler module and no TVM.
"""
