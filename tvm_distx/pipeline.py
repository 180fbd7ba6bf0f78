"""The compiler driver: from an annotated global-view module to built rank programs.

:func:`distribute` runs the stages that give the program every rank runs;
:func:`compile` runs them, schedules the kernels for CPU targets, builds one
library holding every rank's program, and hands it to
:class:`tvm_distx.executable.DistExecutable`, which only packages and runs it.

The stages run in the only order that gives right numbers with the pinned TVM:
``LegalizeOps`` *before* propagation, because it skips every operator whose
operands are DTensors, and a row-parallel matmul legalized afterwards silently
loses its all-reduce.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import tvm
from tvm import relax

from . import _ir
from .executable import DistExecutable
from .signature import FunctionSignature
from .targets import resolve_target

__all__ = ["STAGES", "compile", "distribute", "run_stages"]

logger = logging.getLogger(__name__)


def _stages():
    from tvm_distx.legalize import LegalizeRedistribute, LowerDistIR, LowerGlobalViewToLocalView
    from tvm_distx.passes import PropagateSharding

    return [
        ("legalize_ops", legalize_ops),
        ("propagate_sharding", PropagateSharding(require_legalized=True)),
        ("local_view", LowerGlobalViewToLocalView()),
        ("legalize_redistribute", LegalizeRedistribute()),
        ("lower_distir", LowerDistIR()),
    ]


@tvm.transform.module_pass(opt_level=0, name="tvm_distx.LegalizeOps")
def legalize_ops(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Every Relax operator as a call to a TIR function, sort, scan and top-k included.

    ``LegalizeOps`` has no rule for ``sort``, ``cumsum`` or ``topk`` (used by
    position ids and mixture-of-experts routing); ``DispatchSortScan`` lowers
    them first, to the generic CPU kernels (any LLVM target gets the same ones).
    """
    with tvm.target.Target({"kind": "llvm"}):
        mod = relax.backend.DispatchSortScan()(mod)
    return relax.transform.LegalizeOps()(mod)


#: The stage names, in order (also the file names under ``dump_dir``).
STAGES = ("legalize_ops", "propagate_sharding", "local_view", "legalize_redistribute",
          "lower_distir")


def distribute(mod: tvm.IRModule, *, dump_dir: str | os.PathLike | None = None) -> tvm.IRModule:
    """Lower an annotated module to the program every rank runs.

    Parameters
    ----------
    mod : tvm.IRModule
        A global-view module with ``R.dist.annotate_sharding`` calls (see
        :class:`tvm_distx.passes.AnnotateSharding`) and its meshes in
        ``global_infos``.
    dump_dir : path, optional
        Write the module after every stage there, as ``NN_<stage>.py`` TVMScript
        (``00_input.py`` first), for debugging.

    Returns
    -------
    tvm.IRModule
        The rank-local module: every tensor has its local shape, and
        communication is ``tvm_distx.ccl.*`` calls. A function spanning
        several meshes has one version per rank set; see
        :func:`tvm_distx.legalize.lower_distir.rank_entry`.

    Raises
    ------
    ShardingError
        From any stage, naming the function and the value.
    """
    return run_stages(mod, dump_dir=dump_dir)[STAGES[-1]]


def run_stages(mod: tvm.IRModule, *,
               dump_dir: str | os.PathLike | None = None) -> dict[str, tvm.IRModule]:
    """Run every stage of :func:`distribute`; returns the module after each, by stage name."""
    dump = Path(dump_dir) if dump_dir is not None else None
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        (dump / "00_input.py").write_text(mod.script(show_meta=False))
    out = {}
    for index, (name, stage) in enumerate(_stages(), start=1):
        mod = stage(mod)
        out[name] = mod
        logger.debug("distribute: %s done", name)
        if dump is not None:
            (dump / f"{index:02d}_{name}.py").write_text(mod.script(show_meta=False))
    return out


def compile(mod: tvm.IRModule, target="x86", *, schedule: bool = True,
            dump_dir: str | os.PathLike | None = None, **target_options) -> DistExecutable:
    """Compile an annotated global-view module into one executable for all ranks.

    Parameters
    ----------
    mod : tvm.IRModule
        A module with sharding annotations (see
        :class:`tvm_distx.passes.AnnotateSharding`) and its meshes.
    target : str or tvm.target.Target
        ``"x86"`` (this host's CPU), ``"rvv"`` (RISC-V with the vector
        extension), or any ``tvm.target.Target``.
    schedule : bool
        Apply our CPU kernel schedules (:mod:`tvm_distx.schedule`).
    dump_dir : path, optional
        Write the module after every stage of :func:`tvm_distx.distribute`.
    **target_options
        Options of the named target (for ``"rvv"``: ``vlen``, ``cc``).

    Returns
    -------
    DistExecutable

    Raises
    ------
    ShardingError
        From any stage, naming the function and the value.
    """
    resolved = resolve_target(target, **target_options)
    stages = run_stages(mod, dump_dir=dump_dir)
    propagated, lowered = stages["propagate_sharding"], stages["lower_distir"]
    signatures = {gv.name_hint: FunctionSignature.from_function(gv.name_hint, func)
                  for gv, func in _ir.relax_functions(propagated)
                  if func.attrs is not None and "global_symbol" in func.attrs}
    built = lowered
    if schedule and resolved.schedulable:
        from .schedule import schedule_module

        built = schedule_module(lowered, resolved.target)
    logger.info("building for %s", resolved.name)
    vm_exec = tvm.compile(built, target=resolved.target)
    return DistExecutable(lowered, signatures, vm_exec, resolved, built=built,
                          **_rank_entries(lowered, signatures))


def _rank_entries(lowered: tvm.IRModule, signatures) -> dict:
    """How many ranks the lowered program runs on, and the function each runs per public one."""
    from .legalize.lower_distir import module_devices, rank_entry

    num_ranks = len(module_devices(lowered))
    return {"num_ranks": num_ranks,
            "entries": {name: [rank_entry(lowered, name, d) for d in range(num_ranks)]
                        for name in signatures}}
