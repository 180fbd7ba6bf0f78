"""Target names: ``"x86"`` for this host's CPU, ``"rvv"`` for RISC-V with vectors.

TVM 0.27 takes a target as a JSON dict; ``"mcpu": "native"`` is rejected and
silently falls back to generic code, so ``"x86"``
asks LLVM for the host's CPU name. ``"rvv"`` is 64-bit RISC-V Linux with the
``V`` extension; its libraries are cross-linked with ``riscv64-linux-gnu-gcc``.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import tvm

from tvm_distx.compiler.parallel_build import export_library as parallel_export
from tvm_distx.errors import ArgumentError

__all__ = ["ResolvedTarget", "resolve_target", "x86_target", "rvv_target"]

logger = logging.getLogger(__name__)

RVV_MATTR = ["+64bit", "+m", "+a", "+f", "+d", "+c", "+v"]


@dataclass(frozen=True)
class ResolvedTarget:
    """A TVM target and how to build and link for it.

    Attributes
    ----------
    name : str
        ``"x86"``, ``"rvv"`` or the target's own text.
    target : tvm.target.Target
    cc : str or None
        The C compiler that links libraries (None: TVM's default, the host's).
    options : dict
        The options the target was made with (``vlen`` for ``"rvv"``).
    """

    name: str
    target: tvm.target.Target
    cc: str | None = None
    options: dict = field(default_factory=dict)

    @property
    def is_riscv(self) -> bool:
        return "riscv" in str(self.target.attrs.get("mtriple", ""))

    @property
    def runnable_here(self) -> bool:
        """Whether code for this target runs on this host."""
        return not self.is_riscv or platform.machine() == "riscv64"

    @property
    def schedulable(self) -> bool:
        """Whether our CPU schedules apply (LLVM CPU targets)."""
        return str(self.target.kind.name) == "llvm"

    def describe(self) -> dict:
        """The target as a JSON-ready dict (for manifests)."""
        return {"name": self.name, "target": json.loads(str(self.target)), **self.options}

    def export_library(self, vm_exec, path: Path) -> None:
        """Write ``vm_exec``'s shared library, cross-linked when the target needs it."""
        if self.cc is None:
            parallel_export(vm_exec, str(path))
            return
        if shutil.which(self.cc) is None:
            raise ArgumentError(
                f"the {self.name} target links with {self.cc}, which is not installed",
                hint="apt-get install gcc-riscv64-linux-gnu" if "riscv64" in self.cc
                else f"install {self.cc} or pass cc= to tvm_distx.compile",
            )
        parallel_export(vm_exec, str(path), cc=self.cc)


def x86_target(num_cores: int | None = None) -> tvm.target.Target:
    """LLVM for this host's CPU.

    ``"mcpu": "native"`` is not understood by this TVM (it silently yields
    generic code), so the CPU name is asked from LLVM.

    Parameters
    ----------
    num_cores : int, optional
        Recorded as the target's ``num-cores``; ``os.cpu_count()`` by default.

    Returns
    -------
    tvm.target.Target
        ``{"kind": "llvm", "mcpu": <host cpu>, "num-cores": n}``.
    """
    cores = num_cores if num_cores is not None else (os.cpu_count() or 1)
    return tvm.target.Target({"kind": "llvm",
                              "mcpu": tvm.target.codegen.llvm_get_system_cpu(),
                              "num-cores": int(cores)})


def rvv_target(vlen: int | None = None) -> tvm.target.Target:
    """64-bit RISC-V Linux with the vector extension (``vlen`` in bits, optional)."""
    mattr = list(RVV_MATTR)
    if vlen is not None:
        if vlen < 128 or vlen & (vlen - 1):
            raise ArgumentError(f"vlen must be a power of two of at least 128, got {vlen}")
        mattr.append(f"+zvl{vlen}b")
    return tvm.target.Target({"kind": "llvm", "mtriple": "riscv64-linux-gnu", "mattr": mattr})


def resolve_target(target="x86", **options) -> ResolvedTarget:
    """Turn a target name or object into a :class:`ResolvedTarget`.

    Parameters
    ----------
    target : {"x86", "rvv"} or tvm.target.Target or dict
        The target.
    **options
        For ``"rvv"``: ``vlen`` (bits) and ``cc`` (the cross compiler,
        ``riscv64-linux-gnu-gcc`` by default).

    Raises
    ------
    ArgumentError
        For an unknown name or option.
    """
    if isinstance(target, str) and target in ("x86", "host"):
        _no_options(target, options, set())
        return ResolvedTarget("x86", x86_target())
    if isinstance(target, str) and target == "rvv":
        _no_options(target, options, {"vlen", "cc"})
        vlen = options.get("vlen")
        return ResolvedTarget("rvv", rvv_target(vlen), options.get("cc", "riscv64-linux-gnu-gcc"),
                              {"vlen": vlen} if vlen else {})
    if isinstance(target, (tvm.target.Target, dict)):
        _no_options(str(target), options, {"cc"})
        resolved = target if isinstance(target, tvm.target.Target) else tvm.target.Target(target)
        return ResolvedTarget(str(resolved.kind.name), resolved, options.get("cc"))
    raise ArgumentError(f"unknown target {target!r}",
                        hint='use "x86", "rvv" or a tvm.target.Target')


def _no_options(name: str, options: dict, allowed: set[str]) -> None:
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ArgumentError(f"target {name} takes no option {', '.join(unknown)}",
                            hint=f"its options are: {', '.join(sorted(allowed)) or 'none'}")
