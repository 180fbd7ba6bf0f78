"""The compiler driver: from an annotated global-view module to built rank programs.

:func:`lower_to_ranks` runs the stages that give the program every rank runs;
:func:`compile` runs them once, schedules the kernels for CPU targets, builds one
library holding every rank's program, and hands it to
:class:`tvm_distx.compiler.executable.DistExecutable`, which only packages and runs it
(and keeps the module of the ``local_view`` stage, which
:func:`tvm_distx.reports.comm_report.comm_report` reads: nothing runs the stages again
to count the bytes a program moves).

The stages run in the only order that gives right numbers with the pinned TVM:
``LegalizeOps`` *before* propagation, because it skips every operator whose
operands are DTensors, and a row-parallel matmul legalized afterwards silently
loses its all-reduce.
"""

from __future__ import annotations

from dataclasses import replace
import logging
import os
from pathlib import Path

from tvm import relax
import tvm

from tvm_distx.compiler.board_plan import lower_for_vm, rank_plan
from tvm_distx.compiler.fuse_attention import FuseAttention
from tvm_distx.compiler.fuse_cache_writes import FuseCacheWrites
from tvm_distx.compiler.operator_rules import legalize_rules
from tvm_distx.compiler.parallel_build import build_vm
from tvm_distx.compiler.executable import DistExecutable
from tvm_distx.compiler.schedule import (SCHEDULED_ATTR, ScheduleCPU, WidenHalves, fuse_kernels,
                                      implement_kernels)
from tvm_distx.compiler.targets import resolve_target
from tvm_distx.bundle.signature import FunctionSignature, WORKER0
from tvm_distx.errors import CompilerStageError, DistxError, UnsupportedProgramError
from tvm_distx.ir import helpers as _ir
from tvm_distx.ir.ctrl_c import CtrlCWatch
from tvm_distx.legalize import LegalizeRedistribute, LowerDistIR, LowerGlobalViewToLocalView
from tvm_distx.legalize.linear import LegalizeLinear
from tvm_distx.legalize.lower_distir import fed_from_worker0, module_devices, rank_entry
from tvm_distx.passes import PropagateSharding, derivations_of

__all__ = ["STAGES", "compile", "legalize_operators", "legalize_ops", "lower_to_ranks",
           "run_stages"]

logger = logging.getLogger(__name__)


def _stages():

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
    Before both, :class:`~tvm_distx.compiler.fuse_attention.FuseAttention` and
    :class:`~tvm_distx.compiler.fuse_cache_writes.FuseCacheWrites` make each attention
    and each key-value cache write one kernel, and
    :class:`~tvm_distx.legalize.linear.LegalizeLinear`
    reads ``(out, in)`` weights in place instead of transposing them on every call.
    """

    return legalize_operators(mod)


def legalize_operators(mod: tvm.IRModule, *, fuse: bool = True) -> tvm.IRModule:
    """:func:`legalize_ops` as a function; ``fuse=False`` leaves attention and cache
    writes as the operators that compute them (automatic sharding plans on those:
    its operator costs and rules know them one by one)."""
    if fuse:
        mod = FuseCacheWrites()(FuseAttention()(mod))
    mod = LegalizeLinear()(mod)
    with tvm.target.Target({"kind": "llvm"}):
        mod = relax.backend.DispatchSortScan()(mod)
    return relax.transform.LegalizeOps(customize_legalize_map=legalize_rules())(mod)


#: The stage names, in order (also the file names under ``dump_dir``).
STAGES = ("legalize_ops", "propagate_sharding", "local_view", "legalize_redistribute",
          "lower_distir")


def lower_to_ranks(mod: tvm.IRModule, *,
                   dump_dir: str | os.PathLike | None = None) -> tvm.IRModule:
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
    """Run every stage of :func:`lower_to_ranks`; returns the module after each, by stage name."""
    dump = Path(dump_dir) if dump_dir is not None else None
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        (dump / "00_input.py").write_text(mod.script(show_meta=False))
    out = {}
    for index, (name, stage) in enumerate(_stages(), start=1):
        try:
            with CtrlCWatch():  # a Ctrl-C inside TVM is an interruption, not a failure
                mod = stage(mod)
        except DistxError:
            raise
        except Exception as err:  # TVM raises InternalError, KeyError, TypeError, ...
            raise CompilerStageError(
                f"stage '{name}' failed inside TVM: {type(err).__name__}: "
                f"{_ir.tvm_error_reason(err)}",
                hint="tvm_distx.compile(mod, dump_dir='stages') writes the module before and "
                "after every stage; please report the failing one") from None
        out[name] = mod
        logger.debug("lower_to_ranks: %s done", name)
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
        Apply our CPU kernel schedules (:mod:`tvm_distx.compiler.schedule`).
    dump_dir : path, optional
        Write the module after every stage of :func:`tvm_distx.lower_to_ranks`.
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
    derivations = derivations_of(mod)  # parameters cut from a user's fused weight
    stages = run_stages(mod, dump_dir=dump_dir)
    propagated, lowered = stages["propagate_sharding"], stages["lower_distir"]
    signatures = {gv.name_hint: FunctionSignature.from_function(gv.name_hint, func)
                  for gv, func in _ir.relax_functions(propagated)
                  if func.attrs is not None and "global_symbol" in func.attrs}

    # the experts kernels run as a sparse dispatch over each rank's own experts, the
    # attention kernels as an online softmax over tiles of keys, the cache writes in place
    built = unscheduled = implement_kernels(lowered)
    if resolved.schedulable:  # float16 conversions the target's LLVM would get wrong
        built = unscheduled = WidenHalves(resolved.target)(built)
    if schedule and resolved.schedulable:

        unscheduled = fuse_kernels(unscheduled)
        built = ScheduleCPU(resolved.target)(unscheduled)
    logger.info("building for %s", resolved.name)
    vm_exec, built, final = _build(built, unscheduled, resolved.target)
    entries = _rank_entries(lowered, signatures)
    signatures = _with_feeds(lowered, signatures, entries["num_ranks"])
    try:  # the very program the VM runs, as data, for ranks with no TVM
        plan, refusal = rank_plan(final), None
    except CompilerStageError as err:
        plan, refusal = None, err.message
        logger.debug("no rank plan: %s", refusal)
    return DistExecutable(lowered, signatures, vm_exec, resolved, built=built,
                          derivations=derivations, plan=plan, plan_refusal=refusal,
                          local_view=stages["local_view"], **entries)


def _build(built: tvm.IRModule, unscheduled: tvm.IRModule, target):
    """``tvm.compile(built)``; a scheduled kernel that TVM cannot build falls back to TVM's.

    Returns the executable, the module built and the module its virtual machine
    code was generated from (TVM's relax pipeline run once, :func:`lower_for_vm`),
    which the rank plan is written from too.

    Our schedules are checked by tests, but a kernel shape they never met can
    still reach a TVM lowering check. Then each scheduled kernel is built
    alone, those that fail are replaced by their unscheduled version (logged
    as a warning), and the module is built again.
    """

    with CtrlCWatch() as ctrl_c:  # a Ctrl-C inside TVM is an interruption, not a failure
        try:
            return _vm_build(built, target)
        except Exception as err:  # TVM raises InternalError, TVMError, ...
            if ctrl_c.pressed:
                raise
            failure = err
        scheduled = [(gv, func) for gv, func in built.functions.items()
                     if isinstance(func, tvm.tirx.PrimFunc) and func.attrs is not None
                     and bool(func.attrs.get(SCHEDULED_ATTR, False))]
        broken = [gv for gv, func in scheduled if not _builds_alone(func, target)]
        if broken:
            logger.warning("our schedule of %s does not build (%s); using TVM's default "
                           "lowering for %s", ", ".join(gv.name_hint for gv in broken),
                           _ir.tvm_error_reason(failure),
                           "it" if len(broken) == 1 else "them")
            built = built.clone()
            for gv in broken:
                built.update_func(gv, unscheduled[gv.name_hint])
            try:
                return _vm_build(built, target)
            except Exception as err:  # noqa: BLE001 - reported below
                if ctrl_c.pressed:
                    raise
                failure = err
    raise CompilerStageError(
        f"stage 'build' failed inside TVM: {type(failure).__name__}: "
        f"{_ir.tvm_error_reason(failure)}",
        hint="tvm_distx.compile(mod, schedule=False) builds without our kernel schedules; "
        "tvm_distx.compile(mod, dump_dir='stages') writes the module of every stage") from None


def _vm_build(built: tvm.IRModule, target):
    """The executable, ``built``, and the final module its VM code was generated from."""
    final = lower_for_vm(built, target)
    return build_vm(final, target), built, final


def _builds_alone(func, target) -> bool:
    """Whether one TIR kernel builds on its own for ``target``."""
    with CtrlCWatch() as ctrl_c:
        try:
            tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                        target=target)
        except Exception:  # noqa: BLE001 - any failure means: do not use this schedule
            if ctrl_c.pressed:
                raise
            return False
    return True


def _with_feeds(lowered: tvm.IRModule, signatures: dict[str, FunctionSignature],
                num_ranks: int) -> dict[str, FunctionSignature]:
    """Each signature with its feed: ``"worker0"`` for a function lowered by TVM's LowerDistIR.

    TVM's lowering broadcasts and scatters the inputs from worker 0 over every
    worker (``runtime.disco.*``, over the whole MPI world on our ranks), so each
    parameter must live on a one-axis mesh of all the run's devices.

    Raises
    ------
    UnsupportedProgramError
        For a parameter of such a function on another mesh.
    """


    out = {}
    for name, signature in signatures.items():
        if fed_from_worker0(lowered, name):
            for spec in signature.params:
                mesh = spec.sharding.mesh
                if len(mesh.shape) != 1 or mesh.device_range != range(num_ranks):
                    raise UnsupportedProgramError(
                        f"TVM's LowerDistIR feeds '{spec.name}' from worker 0 over all "
                        f"{num_ranks} workers, but it lives on mesh {mesh.describe()}",
                        function=name, var=spec.name, placement=str(spec.sharding.placement),
                        hint="lower the module with tvm_distx.legalize.LowerDistIR, which "
                        "gives each rank its shard on any mesh")
            signature = replace(signature, feed=WORKER0)
        out[name] = signature
    return out


def _rank_entries(lowered: tvm.IRModule, signatures) -> dict:
    """How many ranks the lowered program runs on, and the function each runs per public one."""

    num_ranks = len(module_devices(lowered))
    return {"num_ranks": num_ranks,
            "entries": {name: [rank_entry(lowered, name, d) for d in range(num_ranks)]
                        for name in signatures}}

