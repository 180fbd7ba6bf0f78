"""Moved to :mod:`tvm_distx.runtime.batch` (the generation loop needs no TVM); kept for one
release under this name."""

import warnings

from tvm_distx.runtime.batch import RESIDENT_PREFIX, generate_batch, left_padded  # noqa: F401

__all__ = ["generate_batch", "left_padded"]

warnings.warn("tvm_distx.llm.batch moved to tvm_distx.runtime.batch", DeprecationWarning,
              stacklevel=2)
