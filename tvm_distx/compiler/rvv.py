"""RISC-V vector (RVV) kernels: cross-built, and checked on this machine under qemu.

There is no TVM runtime for riscv64 in the package registry, so a RISC-V build
is verified kernel by kernel: the TIR kernels of a rank program are built for
the RVV target into ``kernels.so`` (cross-linked with
``riscv64-linux-gnu-gcc``), and a small C harness (``rvv_harness.c``, built for
riscv64) loads it and calls one kernel through the tvm-ffi C ABI, with
``DLTensor`` arguments read from and written to files. The harness runs under
``qemu-riscv64 -cpu rv64,v=true,vlen=...``; with plain ``-cpu rv64`` a kernel
with vector code dies of an illegal instruction, which proves the vector path
ran. Each kernel's output is compared with the same kernel built for this host.

:func:`write_kernels` puts ``kernels/`` (the library, its kernels as
TVMScript, and a JSON index of their arguments) into a bundle;
:func:`check_kernels` runs every kernel of such a folder under qemu.
"""

from __future__ import annotations

from dataclasses import dataclass
import json
import logging
import os
from pathlib import Path
import shutil
import subprocess
import tempfile
from typing import Sequence

import numpy as np
from tvm import relax, tirx
import tvm
import tvm_ffi

from tvm_distx.compiler.targets import x86_target
from tvm_distx.errors import QemuError

__all__ = ["QemuError", "KernelArg", "Kernel", "KernelCheck", "write_kernels", "read_kernels",
           "vector_instructions", "build_harness", "run_kernel", "check_kernels",
           "CROSS_CC", "QEMU"]

logger = logging.getLogger(__name__)

CROSS_CC = "riscv64-linux-gnu-gcc"
QEMU = "qemu-riscv64"
SYSROOT = "/usr/riscv64-linux-gnu"
#: The instructions that show a kernel really uses the vector unit.
VECTOR_MNEMONICS = ("vsetvli", "vle32.v", "vse32.v", "vfmacc.vv", "vfmacc.vf", "vfmax.vf")
_DLPACK_CODES = {"int": 0, "uint": 1, "float": 2}


@dataclass(frozen=True)
class KernelArg:
    """One buffer argument of a kernel."""

    shape: tuple[int, ...]
    dtype: str
    output: bool


@dataclass(frozen=True)
class Kernel:
    """A kernel of a library: its symbol name and its arguments, in order."""

    name: str
    args: tuple[KernelArg, ...]


@dataclass(frozen=True)
class KernelCheck:
    """The result of running one kernel under qemu against the host build."""

    name: str
    max_error: float
    vector_ran: bool


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise QemuError(f"{name} is not installed",
                        hint="apt-get install gcc-riscv64-linux-gnu qemu-user "
                        "(scripts/test and scripts/demo --full do it)")
    return path


def _kernels_of(mod: tvm.IRModule) -> tuple[tvm.IRModule, list[Kernel]]:
    """The module's TIR kernels (as a module of public PrimFuncs) and their arguments.

    Which arguments are outputs comes from the ``R.call_tir`` sites: the
    buffers after the call's inputs.
    """
    inputs: dict[str, int] = {}
    for _, func in mod.functions.items():
        if not isinstance(func, relax.Function):
            continue

        def visit(expr):
            if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and (
                    expr.op.name == "relax.call_tir"):
                inputs[expr.args[0].name_hint] = len(expr.args[1].fields)

        relax.analysis.post_order_visit(func, visit)
    prims, kernels = {}, []
    for gv, func in mod.functions.items():
        if not isinstance(func, tirx.PrimFunc) or gv.name_hint not in inputs:
            continue
        name = gv.name_hint
        if not all(_static_buffer(p) for p in func.params):
            logger.debug("kernel %s has run-time extents or scalars: not checked alone", name)
            continue  # the harness passes fixed-size buffers only; the board runs it in the plan
        prims[name] = func.with_attr("global_symbol", name)
        args = []
        for index, buf in enumerate(func.params):  # in this TVM, a parameter is its buffer
            args.append(KernelArg(tuple(int(n) for n in buf.shape), str(buf.dtype),
                                  index >= inputs[name]))
        kernels.append(Kernel(name, tuple(args)))
    return tvm.IRModule(prims), sorted(kernels, key=lambda k: k.name)


def _static_buffer(param) -> bool:
    """Whether a kernel parameter is a buffer of a static shape (the harness's arguments)."""
    try:
        return all(isinstance(n, tvm.tirx.IntImm) for n in param.shape)
    except AttributeError:  # a scalar parameter
        return False


def write_kernels(mod: tvm.IRModule, target: tvm.target.Target, folder: str | os.PathLike,
                  cc: str = CROSS_CC) -> list[Kernel]:
    """Build the kernels of a rank-local module for ``target`` into ``folder``.

    Writes ``kernels.so`` (cross-linked with ``cc``), ``kernels.py`` (the
    kernels as TVMScript, to rebuild a host reference) and ``kernels.json``
    (each kernel's arguments).

    Returns
    -------
    list of Kernel
    """
    folder = Path(folder)
    prims, kernels = _kernels_of(mod)
    if not kernels:
        return kernels
    folder.mkdir(parents=True, exist_ok=True)
    lib = tvm.tirx.build(prims, target=target)
    lib.export_library(str(folder / "kernels.so"), cc=_tool(cc))
    (folder / "kernels.s").write_text(lib.inspect_source("asm"))
    (folder / "kernels.py").write_text(prims.script(show_meta=False))
    (folder / "kernels.json").write_text(json.dumps(
        [{"name": k.name, "args": [{"shape": list(a.shape), "dtype": a.dtype,
                                     "output": a.output} for a in k.args]} for k in kernels],
        indent=1) + "\n")
    return kernels


def read_kernels(folder: str | os.PathLike) -> list[Kernel]:
    """The kernels listed in ``folder/kernels.json``."""
    data = json.loads((Path(folder) / "kernels.json").read_text())
    return [Kernel(k["name"], tuple(KernelArg(tuple(a["shape"]), a["dtype"], a["output"])
                                    for a in k["args"])) for k in data]


def vector_instructions(folder: str | os.PathLike) -> dict[str, int]:
    """How often each vector mnemonic of :data:`VECTOR_MNEMONICS` occurs in the kernels."""
    asm = (Path(folder) / "kernels.s").read_text()
    words = asm.split()
    return {m: words.count(m) for m in VECTOR_MNEMONICS}


def build_harness(folder: str | os.PathLike, cc: str = CROSS_CC) -> Path:
    """Compile ``rvv_harness.c`` for riscv64 into ``folder/harness``."""

    out = Path(folder) / "harness"
    include = Path(tvm_ffi.__file__).parent / "include"
    source = Path(__file__).parent / "rvv_harness.c"
    done = subprocess.run([_tool(cc), "-O2", "-rdynamic", "-I", str(include), str(source),
                           "-o", str(out), "-ldl"], capture_output=True, text=True)
    if done.returncode != 0:
        raise QemuError(f"building the harness failed:\n{done.stderr}")
    return out


def run_kernel(folder: str | os.PathLike, kernel: Kernel, inputs: Sequence[np.ndarray], *,
               harness: Path, vector: bool = True, vlen: int = 128,
               timeout: float = 120.0) -> list[np.ndarray]:
    """Run one kernel of ``folder/kernels.so`` under qemu; returns its outputs.

    Parameters
    ----------
    folder : path
        Holds ``kernels.so``.
    kernel : Kernel
        The kernel and its arguments.
    inputs : sequence of numpy.ndarray
        One per input argument, in order.
    harness : path
        From :func:`build_harness`.
    vector : bool
        Emulate a CPU with the vector extension (``-cpu rv64,v=true,vlen=...``)
        or without it (``-cpu rv64``).
    vlen : int
        The vector register width in bits.

    Raises
    ------
    QemuError
        If the kernel fails; "illegal instruction" when it needs the vector
        extension that the emulated CPU lacks.
    """
    cpu = f"rv64,v=true,vlen={vlen}" if vector else "rv64"
    with tempfile.TemporaryDirectory(prefix="tvm-distx-rvv-") as tmp:
        args, outputs = harness_arguments(Path(folder).resolve() / "kernels.so", kernel,
                                          inputs, tmp)
        command = [_tool(QEMU), "-cpu", cpu, "-L", SYSROOT, str(harness), *args]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            illegal = "Illegal instruction" in done.stderr or done.returncode in (-4, 132)
            raise QemuError(
                f"kernel {kernel.name} under qemu -cpu {cpu} "
                + ("died of an illegal instruction" if illegal
                   else f"failed with code {done.returncode}: {done.stderr.strip()}"),
                hint="run it on a CPU with the vector extension (v=true)" if illegal else None,
            )
        return [np.fromfile(path, dtype=arg.dtype).reshape(arg.shape) for path, arg in outputs]


def harness_arguments(library: str | os.PathLike, kernel: Kernel, inputs: Sequence[np.ndarray],
                      folder: str | os.PathLike) -> tuple[list[str], list[tuple[Path, KernelArg]]]:
    """The harness's arguments that run ``kernel`` of ``library`` on ``inputs``.

    Each input is written to ``folder/arg<i>.bin``; each output will be read from the path
    returned with its argument, once the harness has run (``harness *arguments``, on any
    riscv64 machine: under qemu here, or on a board).
    """
    command = [str(library), kernel.name, str(len(kernel.args))]
    given = iter(inputs)
    outputs = []
    for index, arg in enumerate(kernel.args):
        dtype = np.dtype(arg.dtype)
        code = _DLPACK_CODES[{"i": "int", "u": "uint", "f": "float"}[dtype.kind]]
        path = Path(folder) / f"arg{index}.bin"
        command += [str(code), str(dtype.itemsize * 8), str(len(arg.shape)),
                    *map(str, arg.shape)]
        if arg.output:
            command += ["out", str(path)]
            outputs.append((path, arg))
        else:
            np.ascontiguousarray(next(given), dtype=dtype).tofile(path)
            command += ["in", str(path)]
    return command, outputs


def check_kernels(folder: str | os.PathLike, *, vlen: int = 128, seed: int = 0,
                  rtol: float = 1e-5, atol: float = 1e-5) -> list[KernelCheck]:
    """Run every kernel of a ``kernels/`` folder under qemu and compare with this host.

    Each kernel gets random inputs; the reference is the same TIR (from
    ``kernels.py``) built for this host's CPU. Every kernel is also run
    without the vector extension, where it must die of an illegal instruction
    if it uses vector code.

    Returns
    -------
    list of KernelCheck

    Raises
    ------
    QemuError
        If a kernel's output differs from the host's, or a kernel fails.
    """

    folder = Path(folder)
    kernels = read_kernels(folder)
    host = tvm.tirx.build(tvm.script.from_source((folder / "kernels.py").read_text()),
                          target=x86_target())
    rng = np.random.default_rng(seed)
    checks = []
    with tempfile.TemporaryDirectory(prefix="tvm-distx-harness-") as tmp:
        harness = build_harness(tmp)
        for kernel in kernels:
            inputs = [rng.standard_normal(a.shape).astype(a.dtype) for a in kernel.args
                      if not a.output]
            got = run_kernel(folder, kernel, inputs, harness=harness, vlen=vlen)
            want = _run_on_host(host, kernel, inputs)
            error = max(float(np.max(np.abs(g - w), initial=0.0)) for g, w in zip(got, want))
            for g, w in zip(got, want):
                if not np.allclose(g, w, rtol=rtol, atol=atol):
                    raise QemuError(f"kernel {kernel.name} differs from the host build by "
                                    f"{error:g} under qemu (vlen {vlen})")
            try:
                run_kernel(folder, kernel, inputs, harness=harness, vector=False)
                vector_ran = False
            except QemuError as err:
                if "illegal instruction" not in str(err):
                    raise
                vector_ran = True
            logger.info("kernel %s: max |error| %g, vector code %s", kernel.name, error,
                        "ran" if vector_ran else "absent")
            checks.append(KernelCheck(kernel.name, error, vector_ran))
    return checks


def _run_on_host(lib, kernel: Kernel, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    given = iter(inputs)
    args, outs = [], []
    for arg in kernel.args:
        if arg.output:
            tensor = tvm.runtime.tensor(np.zeros(arg.shape, arg.dtype))
            outs.append(tensor)
        else:
            tensor = tvm.runtime.tensor(next(given))
        args.append(tensor)
    lib[kernel.name](*args)
    return [t.numpy() for t in outs]
