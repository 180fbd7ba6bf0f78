"""The machine code of a program's kernels, generated and emitted on every core.

``tvm.compile`` hands all of a program's kernels to LLVM as one module: one core
optimizes them (``tvm.tirx.build``) and then emits their object code
(``export_library``), about 2 s each for a decoder's 150-odd kernels, while the
other cores wait. The kernels do not call each other, so here they are dealt into
one group per core and each group is built as its own LLVM module, in its own thread: TVM's
code generation runs in C++ without Python's lock. The virtual machine's code is
linked with the first group's library, which imports the others, so the
executable finds every kernel as before. :func:`export_library` writes the groups'
objects in parallel threads too, then links them as TVM's own export does.

Where there is one core, one kernel, a target other than LLVM, or
``TVM_DISTX_BUILD_JOBS=1``, TVM's own ``tvm.compile`` and ``export_library`` run
unchanged.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
import logging
import os
from pathlib import Path
import tempfile

import tvm
from tvm import relax, tirx
from tvm.runtime import _ffi_api as _runtime_api
from tvm.support import cc as _cc

__all__ = ["build_jobs", "build_vm", "export_library"]

logger = logging.getLogger(__name__)

#: The environment variable that bounds the threads (``1``: TVM's own build).
ENVIRONMENT = "TVM_DISTX_BUILD_JOBS"

#: At most this many threads, and a group has at least this many kernels.
MAX_JOBS = 8
MIN_KERNELS_PER_JOB = 8


def build_jobs(kernels: int) -> int:
    """How many threads build ``kernels`` kernels: one per core, bounded (module doc)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 1)
    wanted = os.environ.get(ENVIRONMENT, "")
    limit = int(wanted) if wanted.isdigit() and int(wanted) > 0 else MAX_JOBS
    return max(1, min(cores, limit, kernels // MIN_KERNELS_PER_JOB))


def build_vm(final: tvm.IRModule, target: tvm.target.Target) -> tvm.runtime.Executable:
    """``tvm.compile(final, target=target, relax_pipeline=None)``, its kernels built in parallel.

    Parameters
    ----------
    final : tvm.IRModule
        The module after TVM's relax pipeline (VM-ready Relax functions and TIR).
    target : tvm.target.Target

    Returns
    -------
    tvm.runtime.Executable
        The same executable ``tvm.compile`` gives, its kernels in one LLVM module
        per group.
    """
    kernels = {gv: func for gv, func in final.functions.items()
               if isinstance(func, tirx.PrimFunc)}
    jobs = build_jobs(len(kernels))
    if jobs < 2 or str(target.kind.name) != "llvm":
        return tvm.compile(final, target=target, relax_pipeline=None)
    attrs = dict(final.attrs) if final.attrs else {}
    ext_libs = list(attrs.get("external_mods", []))
    params = dict(attrs.get("const_name_to_constant", {}))
    builder = relax.ExecBuilder()
    vm_mod = relax.vm_build._vmcodegen(builder, final, "bytecode")
    kernels = {gv: func for gv, func in vm_mod.functions.items()
               if isinstance(func, tirx.PrimFunc)}
    groups = _groups(kernels, jobs)

    def build(group: dict) -> tvm.runtime.Module:
        return tvm.tirx.build(tvm.IRModule(group, attrs=vm_mod.attrs), target=target)

    with ThreadPoolExecutor(len(groups), thread_name_prefix="tvm-distx-build") as pool:
        libs = list(pool.map(build, groups))
    lib = libs[0]
    for other in libs[1:]:
        lib.import_module(other)
    logger.debug("built %d kernels as %d LLVM modules in parallel", len(kernels), len(libs))
    linked = relax.vm_build._ffi_api.VMLink(builder, target, lib, ext_libs, params)
    return relax.vm_build.VMExecutable(linked)


def _groups(kernels: dict, jobs: int) -> list[dict]:
    """``kernels`` dealt in turn into ``jobs`` groups, in the order of their names.

    The work of a kernel is not known before LLVM has done it; dealt in turn, each
    kind of kernel (a layer's matmuls, its attention, its element-wise kernels) is
    spread over the groups.
    """
    groups: list[dict] = [{} for _ in range(jobs)]
    for index, gv in enumerate(sorted(kernels, key=lambda g: g.name_hint)):
        groups[index % jobs][gv] = kernels[gv]
    return [group for group in groups if group]


def export_library(vm_exec: tvm.runtime.Executable, path: str, **kwargs) -> None:
    """``vm_exec.export_library(path, **kwargs)``, each LLVM module's object written by a thread.

    TVM's export writes the objects of the library's modules one after the other.
    When every module of the library is an LLVM module (what :func:`build_vm`
    gives), their objects are written in parallel here, and the rest is TVM's
    export: the imported modules packed (``devc.o``) and everything linked by
    ``kwargs``' compiler. Any other library goes through TVM's export.
    """
    module = vm_exec.mod
    modules = module._collect_dso_modules()
    if len(modules) < 2 or any(m.kind != "llvm" for m in modules) or build_jobs(
            MIN_KERNELS_PER_JOB * len(modules)) < 2:
        vm_exec.export_library(path, **kwargs)
        return
    with tempfile.TemporaryDirectory(prefix="tvm-distx-export-") as work:
        files = [str(Path(work) / f"lib{index}.o") for index in range(len(modules))]
        with ThreadPoolExecutor(len(modules), thread_name_prefix="tvm-distx-emit") as pool:
            list(pool.map(lambda pair: pair[0].write_to_file(pair[1]), zip(modules, files)))
        first = modules[0]
        target = first.get_function("_get_target_string")()
        system_lib = bool(first.get_function("__tvm_is_system_module")())
        prefix = first.get_function("__tvm_get_system_lib_prefix")() or ""
        if module.imports:
            packed = str(Path(work) / f"{prefix}devc.o")
            _runtime_api.ModulePackImportsToLLVM(module, system_lib, target, prefix) \
                .write_to_file(packed)
            files.append(packed)
        _cc.create_shared(path, files, **kwargs)
