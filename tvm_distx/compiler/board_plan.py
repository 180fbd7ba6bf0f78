"""Rank plans: the per-rank Relax program the VM runs, written as data for a TVM-free executor.

TVM's default relax pipeline (:func:`lower_for_vm`) ends in a program the VM code
generator turns into bytecode: a straight list of bindings over a small vocabulary
(``vm.builtin.*`` packed calls, ``relax.vm.alloc_storage`` / ``alloc_tensor`` /
``kill_object``, calls of TIR kernels in destination-passing style, calls of other Relax
functions, ``tvm_distx.ccl.*`` collectives). :func:`rank_plan` writes that very program,
binding by binding, as JSON-able data, so that a board with no TVM runs what the VM would
(:mod:`tvm_distx.runtime.board.executor`); the VM is ``tvm.compile(final, relax_pipeline=None)``
of the same module and its exported library holds the kernels the plan calls.

The plan (``"version": 2``)::

    {"format": "tvm-distx-board-plan", "version": 2,
     "kernels": [names of the TIR functions, exported as __tvm_ffi_<name>],
     "constants": [{"dtype": "float32", "shape": [16], "data": base64} or
                   {"dtype": "int64", "shape": [], "values": [0]}, ...],
     "functions": {name: {"params": [registers], "registers": n,
                          "body": [instructions], "result": operand}}}

Operands are ``{"var": i}`` (the function's i-th register), ``{"int": n}``,
``{"float": x}``, ``{"bool": b}``, ``{"str": s}``, ``{"dtype": "float32"}``,
``{"shape": [ints]}``, ``{"const": k}`` (the k-th constant, a numpy array),
``{"item": [operand, i]}`` (field i of a tuple), ``{"tuple": [operands]}`` and
``{"null": None}``. An instruction is ``{"dst": i, "op": kind, "name": callee,
"args": [operands]}`` with ``op`` one of ``"builtin"`` (a ``vm.builtin.*`` the executor
runs, or a ``tvm_distx.ccl.*`` collective; the VM context of ``call_builtin_with_ctx`` is
not written), ``"kernel"`` (a TIR function of the library), ``"call"`` (another Relax
function of the plan), ``"alloc_storage"``, ``"alloc_tensor"``, ``"kill"`` (its argument's
register is emptied, as the VM does), ``"null"`` and ``"alias"`` (a plain value).
"""

from __future__ import annotations

import base64
import functools
import logging
import os
from pathlib import Path
import shutil
import subprocess
import tempfile

import numpy as np
import tvm
from tvm import relax
from tvm.ir.expr import GenericConst, StringImm
from tvm.ir.prim.expr import FloatImm, IntImm

from tvm_distx.runtime.board.executor import BUILTINS, COLLECTIVE_PREFIX, DTYPES, FORMAT
from tvm_distx.runtime.board.program import RUNTIME_LIBRARY
from tvm_distx.errors import CompilerStageError
from tvm_distx.ir.helpers import with_functions

__all__ = ["FORMAT", "RUNTIME_LIBRARY", "VERSION", "board_runtime", "build_board_runtime",
           "lower_for_vm", "rank_plan"]

logger = logging.getLogger(__name__)

#: The plan format this writer writes (the executor's, which checks it) and its version.
VERSION = 2
#: Constants of at most this many elements are written as a list of values, others in base64.
INLINE_ELEMENTS = 16


_VM_OPS = {"relax.vm.alloc_storage": "alloc_storage", "relax.vm.alloc_tensor": "alloc_tensor",
           "relax.vm.kill_object": "kill", "relax.null_value": "null"}
_WITH_CONTEXT = "relax.call_builtin_with_ctx"


def lower_for_vm(built: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    """TVM's default relax pipeline: the program both the VM and a rank plan are made from.

    Parameters
    ----------
    built : tvm.IRModule
        The rank-local module of a compile (``DistExecutable.built``).
    target : tvm.target.Target
        The target its kernels are built for.

    Returns
    -------
    tvm.IRModule
        The module ``tvm.compile(final, target=target, relax_pipeline=None)`` builds.
    """
    with target:
        final = relax.get_pipeline("default")(built)
    return _noalias_shape_functions(final)


def _noalias_shape_functions(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with its TIR functions of at most one buffer marked ``tirx.noalias``.

    TVM 0.27's LLVM code generator gives each kernel's outlined compute function
    the no-alias flag of the *last* function it added to the module, not of the
    kernel. The relax pipeline adds shape functions (one buffer each, no
    ``tirx.noalias``); when one of them comes last, every kernel loses
    ``noalias`` on its buffers, and LLVM then keeps a matmul's register tile in
    memory (a run-time-row matmul ran 2x slower built with its program than
    alone). A function of one buffer cannot alias anything, so marking it is
    always true, and the kernels keep their own flag.
    """
    marked = {}
    for gv, func in mod.functions.items():
        if not isinstance(func, tvm.tirx.PrimFunc):
            continue
        if func.attrs is not None and "tirx.noalias" in func.attrs:
            continue
        buffers = [p for p in func.params if not isinstance(p.ty, tvm.ir.PrimType)]
        if len(buffers) <= 1:
            marked[gv] = func.with_attr("tirx.noalias", True)
    return with_functions(mod, marked)


def build_board_runtime(folder: str | os.PathLike, cc: str = "gcc") -> Path:
    """Compile ``board_runtime.c`` (the kernels' hooks and error reporter) into ``folder``.

    The board executor serves the kernels' workspace allocations from it (thousands per
    decode step, too many for Python callbacks); it needs only the C library.

    Parameters
    ----------
    folder : path
        Where ``board_runtime.so`` is written.
    cc : str
        The target's C compiler (``riscv64-linux-gnu-gcc`` for RVV boards).

    Returns
    -------
    Path
        The library.

    Raises
    ------
    CompilerStageError
        If the compiler is missing or fails.
    """
    out = Path(folder) / RUNTIME_LIBRARY
    compiler = shutil.which(cc)
    if compiler is None:
        raise CompilerStageError(f"stage 'board runtime' needs the C compiler {cc}",
                                 hint=f"install {cc} (the target's C compiler)")
    source = Path(__file__).parent / "board_runtime.c"
    done = subprocess.run([compiler, "-O2", "-shared", "-fPIC", str(source), "-o", str(out)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise CompilerStageError(f"stage 'board runtime': {cc} failed:\n{done.stderr}",
                                 hint="check the target's C compiler")
    return out


@functools.lru_cache(maxsize=None)
def board_runtime(cc: str = "gcc") -> bytes:
    """The board runtime built once per process for the compiler ``cc``: the bytes bundles hold.

    It is built in a temporary directory removed as soon as the library is read, so a
    process that is killed later leaves nothing behind.
    """
    with tempfile.TemporaryDirectory(prefix="tvm-distx-board-runtime-") as folder:
        return build_board_runtime(folder, cc).read_bytes()


def rank_plan(final: tvm.IRModule) -> dict:
    """The plan of every Relax function of ``final`` (the output of :func:`lower_for_vm`).

    Parameters
    ----------
    final : tvm.IRModule
        The module the VM is built from.

    Returns
    -------
    dict
        JSON-able data (see the module documentation).

    Raises
    ------
    CompilerStageError
        For a construct the board executor does not run (named, with its function).
    """
    kernels = sorted(gv.name_hint for gv, f in final.functions.items()
                     if isinstance(f, tvm.tirx.PrimFunc))
    constants: list[dict] = []
    functions = {}
    for gv, func in sorted(final.functions.items(), key=lambda item: item[0].name_hint):
        if isinstance(func, relax.Function):
            functions[gv.name_hint] = _Function(gv.name_hint, set(kernels), constants).plan(func)
    return {"format": FORMAT, "version": VERSION, "kernels": kernels, "constants": constants,
            "functions": functions}


def _constant(name: str, array: np.ndarray) -> dict:
    """One constant of the plan: its values inline when small, else its bytes in base64."""
    written = {"dtype": name, "shape": list(array.shape)}
    if array.size <= INLINE_ELEMENTS and array.dtype.kind in "biuf":
        written["values"] = array.reshape(-1).tolist()
    else:
        written["data"] = base64.b64encode(np.ascontiguousarray(array).tobytes()).decode("ascii")
    return written


class _Function:
    """Writes one Relax function's bindings as instructions over numbered registers."""

    def __init__(self, name: str, kernels: set[str], constants: list[dict]) -> None:
        self.name, self.kernels, self.constants = name, kernels, constants
        self.registers: dict[relax.Var, int] = {}

    def plan(self, func: relax.Function) -> dict:
        params = [self._define(p) for p in func.params]
        body = func.body
        if not isinstance(body, relax.SeqExpr):
            self._refuse(f"a body of {type(body).__name__}")
        instructions = [self._binding(b) for block in body.blocks for b in block.bindings]
        return {"params": params, "registers": len(self.registers), "body": instructions,
                "result": self._operand(body.body)}

    def _define(self, var: relax.Var) -> int:
        self.registers[var] = len(self.registers)
        return self.registers[var]

    def _binding(self, binding) -> dict:
        if isinstance(binding, relax.MatchCast):
            # VMShapeLower has written the checks and the symbolic extents it defines
            # (``vm.builtin.match_shape``); what is left is the value itself, as the VM's
            # code generator reads it
            return {"dst": self._define(binding.var), "op": "alias",
                    "args": [self._operand(binding.value)]}
        if not isinstance(binding, relax.VarBinding):
            self._refuse(f"a {type(binding).__name__}")
        value = binding.value
        if not isinstance(value, relax.Call):
            operand = self._operand(value)
            return {"dst": self._define(binding.var), "op": "alias", "args": [operand]}
        instruction = self._call(value)
        instruction["dst"] = self._define(binding.var)
        return instruction

    def _call(self, call: relax.Call) -> dict:
        op = call.op
        if isinstance(op, tvm.ir.Op) and op.name == _WITH_CONTEXT:
            callee, packed = call.args[0], call.args[1]
            if not isinstance(callee, relax.ExternFunc) or not isinstance(packed, relax.Tuple):
                self._refuse(f"the call_builtin_with_ctx of {callee}")
            return self._builtin(str(callee.global_symbol), list(packed.fields))
        if isinstance(op, relax.ExternFunc):
            return self._builtin(str(op.global_symbol), list(call.args))
        if isinstance(op, tvm.ir.GlobalVar):
            args = [self._operand(a) for a in call.args]
            if op.name_hint in self.kernels:
                for arg in args:
                    if next(iter(arg)) not in ("var", "int", "float", "bool", "const"):
                        self._refuse(f"the {next(iter(arg))} argument of kernel {op.name_hint}")
                return {"op": "kernel", "name": op.name_hint, "args": args}
            return {"op": "call", "name": op.name_hint, "args": args}
        if isinstance(op, tvm.ir.Op) and op.name in _VM_OPS:
            return {"op": _VM_OPS[op.name], "args": [self._operand(a) for a in call.args]}
        self._refuse(f"a call of {op}")

    def _builtin(self, name: str, args: list) -> dict:
        if name not in BUILTINS and not name.startswith(COLLECTIVE_PREFIX):
            self._refuse(f"a call of the packed function {name}")
        return {"op": "builtin", "name": name, "args": [self._operand(a) for a in args]}

    def _operand(self, expr) -> dict:
        if isinstance(expr, relax.Var):
            if expr not in self.registers:
                self._refuse(f"the free variable {expr}")
            return {"var": self.registers[expr]}
        if isinstance(expr, IntImm):
            if str(expr.ty) == "bool":
                return {"bool": bool(expr.value)}
            return {"int": int(expr.value)}
        if isinstance(expr, FloatImm):
            return {"float": float(expr.value)}
        if isinstance(expr, StringImm):
            return {"str": str(expr.value)}
        if isinstance(expr, GenericConst):
            return self._generic(expr)
        if isinstance(expr, relax.ShapeExpr):
            return {"shape": [self._dim(d) for d in expr.values]}
        if isinstance(expr, relax.Tuple):
            return {"tuple": [self._operand(f) for f in expr.fields]}
        if isinstance(expr, relax.TupleGetItem):
            return {"item": [self._operand(expr.tuple_value), int(expr.index)]}
        self._refuse(f"the operand {type(expr).__name__} {expr}")

    def _generic(self, expr: GenericConst) -> dict:
        value = expr.value
        if isinstance(value, str):  # a dtype (tvm_ffi.dtype is a str)
            return {"dtype": str(value)}
        if hasattr(value, "numpy"):  # a tensor constant
            name = str(value.dtype)
            if name not in DTYPES:
                self._refuse(f"a constant of dtype {name}")
            written = _constant(name, value.numpy())
            if written not in self.constants:  # one entry per distinct constant
                self.constants.append(written)
            return {"const": self.constants.index(written)}
        self._refuse(f"the constant {type(value).__name__} {value}")

    def _dim(self, dim) -> int:
        if isinstance(dim, IntImm):
            return int(dim.value)
        self._refuse(f"the symbolic dimension {dim} (VMShapeLower leaves none here)")

    def _refuse(self, what: str):
        raise CompilerStageError(
            f"stage 'board plan' cannot write {what} in function '{self.name}'",
            hint="run this program with backend='mpi' (the TVM VM); the board executor does "
            "not run it yet")
