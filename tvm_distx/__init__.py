"""tvm-distx: make Apache TVM Relax's distributed IR usable on real programs.

The sharding vocabulary (from :mod:`tvm_distx.layout`) lives at the top level;
passes live in :mod:`tvm_distx.passes` and redistribution legalization in
:mod:`tvm_distx.legalize`.

Only the errors, meshes and the layout vocabulary are imported with the
package. The compiler's entry points (``distribute``, ``compile``,
``DistExecutable``) are loaded on first use (PEP 562), so a rank process, which imports
:mod:`tvm_distx.runtime`, never loads :mod:`tvm_distx.passes` or
:mod:`tvm_distx.legalize`.
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

from tvm_distx.errors import (
    ArgumentError,
    SymbolicExtentError,
    BundleError,
    CallGraphError,
    CollectiveGroupError,
    CompilerStageError,
    DistxError,
    LaunchError,
    PeerFailedError,
    UnsupportedProgramError,
    IndivisibleShardError,
    MeshError,
    PlacementRankError,
    PlacementSyntaxError,
    QemuError,
    RuleError,
    ScriptError,
    MemoryBudgetError,
    ShardDimError,
    ShardingConflictError,
    ShardingError,
    UnknownMeshError,
    UnmatchedRuleError,
    UnsupportedValueError,
)
from tvm_distx.layout.mesh import DeviceMesh, MeshRef, module_meshes
from tvm_distx.layout import Partial, Placement, Replicate, Shard, TensorSharding
from tvm_distx.layout.rules import ShardingRule

#: Public names loaded on first use (they import the compiler): name -> module.
_LAZY = {
    "load_module": "tvm_distx.frontend.script",
    "explain": "tvm_distx.reports.explain",
    "comm_report": "tvm_distx.reports.comm_report",
    "distribute": "tvm_distx.build.pipeline",
    "compile": "tvm_distx.build.pipeline",
    "DistExecutable": "tvm_distx.build.executable",
    "from_torch": "tvm_distx.frontend.pytorch",  # imports torch
    "export_decoder": "tvm_distx.frontend.decoder",  # imports torch and transformers
    "auto_shard": "tvm_distx.autoshard",  # imports scipy
    "profile": "tvm_distx.autoshard",
    "CostProfile": "tvm_distx.autoshard",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        # a submodule not imported yet (``tvm_distx.build.pipeline``), as before lazy loading
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
    "DeviceMesh",
    "MeshRef",
    "module_meshes",
    "Placement",
    "Replicate",
    "Shard",
    "Partial",
    "TensorSharding",
    "ShardingRule",
    "load_module",
    "explain",
    "distribute",
    "compile",
    "DistExecutable",
    "from_torch",
    "export_decoder",
    "auto_shard",
    "profile",
    "CostProfile",
    "comm_report",
    "DistxError",
    "BundleError",
    "ArgumentError",
    "SymbolicExtentError",
    "LaunchError",
    "CollectiveGroupError",
    "PeerFailedError",
    "ShardingError",
    "PlacementSyntaxError",
    "PlacementRankError",
    "ShardDimError",
    "IndivisibleShardError",
    "MeshError",
    "UnknownMeshError",
    "ShardingConflictError",
    "RuleError",
    "UnmatchedRuleError",
    "UnsupportedValueError",
    "CallGraphError",
    "UnsupportedProgramError",
    "CompilerStageError",
    "ScriptError",
    "MemoryBudgetError",
    "QemuError",
]
