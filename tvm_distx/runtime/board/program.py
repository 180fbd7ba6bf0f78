"""A rank's program run from its plan: what the board's ranks run instead of TVM's VM.

:class:`PlanProgram` is a :class:`tvm_distx.runtime.ranks.Program`: the rank's
:class:`~tvm_distx.runtime.ranks.RankState` calls its functions on numpy arrays
exactly as it calls the virtual machine's on TVM tensors, so a board rank keeps
its weights, its resident values (a key-value cache) and its results the same way.
The functions are the bundle's rank plan (``plan.json``) run by
:class:`~tvm_distx.runtime.board.executor.Executor` over the bundle's own library
(``lib.so``: its kernels are plain C functions), and every collective goes to the
functions the caller gives.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from tvm_distx.runtime.board.executor import Executor, Kernels, aligned, check_plan
from tvm_distx.errors import BundleError

__all__ = ["PlanProgram", "read_plan", "RUNTIME_LIBRARY"]

#: The compiled board runtime in a bundle (the kernels' hooks in C; see
#: ``tvm_distx.compiler.board_plan.build_board_runtime``), when it has one.
RUNTIME_LIBRARY = "board_runtime.so"

logger = logging.getLogger(__name__)

def read_plan(manifest) -> dict:
    """The bundle's rank plan, checked to be one.

    Raises
    ------
    BundleError
        If the bundle has no plan (it was written by a version without plans, or
        its program has a construct the plan cannot write) or the file cannot be read.
    PlanError
        If the file is not a plan of a version this runtime runs.
    """
    path: Path | None = manifest.plan_path
    if path is None:
        why = manifest.raw.get("plan_refusal")
        raise BundleError(f"the bundle at {manifest.root} has no rank plan, so only TVM's "
                          "virtual machine runs it" + (f" ({why})" if why else ""),
                          hint="run it with backend='mpi', or export it again with this "
                          "version of tvm-distx",
                          cli_hint="run it with --backend mpi, or export it again with this "
                          "version of tvm-distx")
    try:
        plan = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise BundleError(f"the rank plan {path} cannot be read ({type(err).__name__})",
                          hint="export the bundle again") from None
    check_plan(plan)
    return plan


class PlanProgram:
    """The rank's functions run from the plan, on numpy arrays.

    Parameters
    ----------
    plan : dict
        The bundle's rank plan.
    library : path
        The bundle's library (its kernels are called through the tvm-ffi C ABI).
    runtime : path, optional
        The bundle's compiled board runtime (the kernels' hooks in C); without it
        they are Python callbacks, right but slow.
    collectives : mapping of str to callable
        Every ``tvm_distx.ccl.*`` (and TVM's disco builtin) the plan may call, by name,
        taking the plan's arguments (arrays, integers; the output buffer last).
    """

    def __init__(self, plan: dict, library, collectives: Mapping[str, Callable],
                 runtime=None) -> None:
        def collective(name: str, args: list):
            found = collectives.get(name)
            if found is None:
                raise BundleError(f"the rank plan calls {name}, which this runtime does not "
                                  "provide", hint="build and run with one version of tvm-distx")
            return found(*args)

        kernels = Kernels(str(library), None if runtime is None else str(runtime))
        self.executor = Executor(plan, kernels, collective)

    def function(self, name: str) -> Callable:
        return functools.partial(self.executor.run, name)

    def tensor(self, array: np.ndarray) -> np.ndarray:
        return aligned(np.asarray(array))  # kernels' vector loads need 64-byte alignment

    def numpy(self, value) -> np.ndarray:
        return np.asarray(value)
