"""tvm-distx: make Apache TVM Relax's distributed IR usable on real programs.

The top level holds what a user of the package needs (see ``__all__``):

- the layout vocabulary, as in PyTorch DTensor: :class:`DeviceMesh`,
  :class:`Placement` (:class:`Shard`, :class:`Replicate`, :class:`Partial`),
  :class:`TensorSharding`, and :func:`set_device_meshes` to give a module its meshes;
- annotating and propagating: :class:`ShardingRule`, :class:`AnnotateSharding`,
  :class:`PropagateSharding`, and :func:`register_sharding_rule` (how an operator
  or kernel tvm-distx does not know shards, as ``"mk,kn->mn"``);
- importing: :func:`load_module` (TVMScript), :func:`from_torch`,
  :func:`export_decoder` (a Hugging Face decoder with its KV cache);
- storing weights in 16 bits or quantized (:func:`quantize`);
- compiling and running: :func:`compile`, :func:`lower_to_ranks` (the rank
  programs, before building), :class:`DistExecutable`, :class:`CausalLM`;
- choosing and reading plans: :func:`auto_shard`, :func:`explain`, :func:`comm_report`;
- errors: :class:`DistxError`, the base of every class in :mod:`tvm_distx.errors`.

Everything else lives in its package: :mod:`tvm_distx.plans` (presets, tensor,
vocabulary and expert plans), :mod:`tvm_distx.passes`, :mod:`tvm_distx.legalize`,
:mod:`tvm_distx.compiler`, :mod:`tvm_distx.runtime`, :mod:`tvm_distx.generation`,
:mod:`tvm_distx.sources`, :mod:`tvm_distx.autoshard`, :mod:`tvm_distx.reports`.

Only the errors and the layout vocabulary are imported with the package. The
other names are loaded on first use (PEP 562, the ``_LAZY`` table below), so a
rank process, which imports :mod:`tvm_distx.runtime`, never loads
:mod:`tvm_distx.passes` or :mod:`tvm_distx.legalize`.
"""

import importlib
import importlib.util
import os
import signal
import sys


def _quiet_ctrl_c_while_the_command_line_starts() -> None:
    """Make Ctrl-C during the ``tvm-distx`` command's own start-up one line and exit 130.

    The command line catches Ctrl-C once :func:`tvm_distx.cli.main.main` runs, but the
    imports before it (this package, numpy) take a noticeable moment, during which
    Python would print a ``KeyboardInterrupt`` traceback. Only the command (the
    ``tvm-distx`` script or ``python -m tvm_distx``) gets this handler, and
    ``main`` puts Python's own back as its first step; nothing is running yet
    that would need cleaning up.
    """
    argv = list(getattr(sys, "orig_argv", sys.argv))
    as_module = "-m" in argv and argv[argv.index("-m") + 1:argv.index("-m") + 2] == ["tvm_distx"]
    if not (as_module or os.path.basename(sys.argv[0] if sys.argv else "") == "tvm-distx"):
        return
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return  # someone else chose how to handle it

    def interrupted(signum, frame):  # noqa: ARG001
        os.write(2, b"interrupted\n")
        os._exit(130)

    signal.signal(signal.SIGINT, interrupted)


_quiet_ctrl_c_while_the_command_line_starts()

from tvm_distx import errors
from tvm_distx.errors import DistxError
from tvm_distx.layout import Partial, Placement, Replicate, Shard, TensorSharding
from tvm_distx.layout.mesh import DeviceMesh, set_device_meshes
from tvm_distx.layout.rules import ShardingRule

#: Public names loaded on first use (they import the compiler, torch or scipy): name -> module.
_LAZY = {
    "AnnotateSharding": "tvm_distx.passes",
    "PropagateSharding": "tvm_distx.passes",
    "register_sharding_rule": "tvm_distx.passes",
    "load_module": "tvm_distx.frontend.script",
    "from_torch": "tvm_distx.frontend.pytorch",  # imports torch
    "export_decoder": "tvm_distx.frontend.decoder",  # imports torch and transformers
    "quantize": "tvm_distx.passes.quantize",
    "compile": "tvm_distx.compiler.pipeline",
    "lower_to_ranks": "tvm_distx.compiler.pipeline",
    "DistExecutable": "tvm_distx.compiler.executable",
    "CausalLM": "tvm_distx.llm.causal_lm",
    "auto_shard": "tvm_distx.autoshard",  # imports scipy
    "explain": "tvm_distx.reports.explain",
    "comm_report": "tvm_distx.reports.comm_report",
}


#: Packages of plans reachable from the top, as users write them (``from tvm_distx import
#: presets``): name -> module, loaded on first use.
_SUBMODULES = {"presets": "tvm_distx.plans.presets"}


def __getattr__(name: str):
    if name in _SUBMODULES:
        value = importlib.import_module(_SUBMODULES[name])
        globals()[name] = value
        return value
    module = _LAZY.get(name)
    if module is None:
        # a submodule not imported yet (``tvm_distx.compiler``), as before lazy loading
        if importlib.util.find_spec(f"{__name__}.{name}") is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        return importlib.import_module(f".{name}", __name__)
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.1.0"

__all__ = [
    # the layout vocabulary, as in PyTorch DTensor
    "DeviceMesh",
    "Placement",
    "Shard",
    "Replicate",
    "Partial",
    "TensorSharding",
    "set_device_meshes",
    # annotating and propagating shardings
    "ShardingRule",
    "AnnotateSharding",
    "PropagateSharding",
    "register_sharding_rule",
    # importing programs
    "load_module",
    "from_torch",
    "export_decoder",
    # weights stored as 16-bit floats or quantized groups, decoded in the program
    "quantize",
    # compiling and running
    "compile",
    "lower_to_ranks",
    "DistExecutable",
    "CausalLM",
    # choosing and reading plans
    "auto_shard",
    "explain",
    "comm_report",
    # errors: the base class here, every class in tvm_distx.errors
    "DistxError",
    "errors",
]
