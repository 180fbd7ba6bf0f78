"""What a subcommand loads before its work: TVM, without PyTorch where it is not needed.

TVM's FFI layer (``tvm_ffi``) imports PyTorch whenever it is installed, to
exchange tensors with it. That import takes about 2.5 s of the 3-5 s that
``import tvm`` takes, and the subcommands that read TVMScript and run bundles
never hand TVM a PyTorch tensor. :func:`import_tvm_without_torch` imports TVM
with PyTorch hidden for that moment only; PyTorch stays importable afterwards
(a module that needs it imports it as usual), only TVM's own exchange with
PyTorch tensors is left out of that process.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["WITHOUT_TORCH", "import_tvm_without_torch"]

logger = logging.getLogger(__name__)

#: The subcommands that never pass a PyTorch tensor to TVM.
WITHOUT_TORCH = frozenset({"annotate", "propagate", "explain", "plan", "compile", "bundle",
                           "autoshard", "run", "deploy"})


def import_tvm_without_torch() -> None:
    """Import TVM with PyTorch hidden from it; nothing when either is already imported."""
    if "tvm" in sys.modules or "torch" in sys.modules:
        return
    sys.modules["torch"] = None  # ``import torch`` raises ImportError for this moment
    try:
        import tvm  # noqa: F401
    finally:
        if sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
    logger.debug("TVM imported without PyTorch (tvm_ffi's tensor exchange with it is off)")
