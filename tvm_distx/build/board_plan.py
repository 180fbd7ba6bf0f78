"""Rank plans: the per-rank Relax program the VM runs, written as data for a TVM-free executor.

PROTOTYPE (issue 31, not wired in yet). TVM's default relax pipeline ends in a program the VM
code generator turns into bytecode: a straight list of bindings over a small vocabulary
(``vm.builtin.*`` packed calls, ``relax.vm.alloc_storage`` / ``alloc_tensor`` /
``kill_object``, calls of TIR kernels in destination-passing style, calls of other Relax
functions, ``tvm_distx.ccl.*`` collectives). :func:`rank_plan` writes that very program,
binding by binding, as JSON-able data, so that a board with no TVM runs what the VM would.

Operands are ``{"var": i}`` (the function's i-th register), ``{"int": n}``,
``{"float": x}``, ``{"str": s}``, ``{"dtype": "float32"}``, ``{"shape": [dims]}`` (each dim
an int or a ``{"var"}`` of a shape value), ``{"null": None}`` and ``{"tuple": [...]}``.
An instruction is ``{"dst": i, "op": kind, "name": callee, "args": [operands]}`` with
``op`` one of ``"builtin"`` (a ``vm.builtin.*`` or other packed function by name),
``"kernel"`` (a TIR function of the library), ``"call"`` (another Relax function of the
plan), ``"alloc_storage"``, ``"alloc_tensor"``, ``"kill"``, ``"alias"`` (a plain value).
"""

from __future__ import annotations

import logging

import tvm
from tvm import relax
from tvm.ir.expr import GenericConst, StringImm
from tvm.ir.prim.expr import FloatImm, IntImm

from tvm_distx.errors import CompilerStageError

__all__ = ["FORMAT", "VERSION", "lower_for_vm", "rank_plan"]

logger = logging.getLogger(__name__)

FORMAT = "tvm-distx-board-plan"
VERSION = 1

_VM_OPS = {"relax.vm.alloc_storage": "alloc_storage", "relax.vm.alloc_tensor": "alloc_tensor",
           "relax.vm.kill_object": "kill", "relax.null_value": "null"}


def lower_for_vm(built: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    """TVM's default relax pipeline: the program both the VM and a rank plan are made from."""
    with target:
        return relax.get_pipeline("default")(built)


def rank_plan(final: tvm.IRModule) -> dict:
    """The plan of every Relax function of ``final`` (the output of :func:`lower_for_vm`).

    Raises
    ------
    CompilerStageError
        For a construct the board executor does not run (named, with its function).
    """
    kernels = sorted(gv.name_hint for gv, f in final.functions.items()
                     if isinstance(f, tvm.tirx.PrimFunc))
    functions = {}
    for gv, func in final.functions.items():
        if isinstance(func, relax.Function):
            functions[gv.name_hint] = _Function(gv.name_hint, set(kernels)).plan(func)
    return {"format": FORMAT, "version": VERSION, "kernels": kernels, "functions": functions}


class _Function:
    """Writes one Relax function's bindings as instructions over numbered registers."""

    def __init__(self, name: str, kernels: set[str]) -> None:
        self.name, self.kernels = name, kernels
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
        if not isinstance(binding, relax.VarBinding):
            self._refuse(f"a {type(binding).__name__} (match_cast is lowered before this stage)")
        value = binding.value
        dst = self._define(binding.var)
        if not isinstance(value, relax.Call):
            return {"dst": dst, "op": "alias", "args": [self._operand(value)]}
        op = value.op
        args = [self._operand(a) for a in value.args]
        if isinstance(op, relax.ExternFunc):
            return {"dst": dst, "op": "builtin", "name": str(op.global_symbol), "args": args}
        if isinstance(op, tvm.ir.GlobalVar):
            kind = "kernel" if op.name_hint in self.kernels else "call"
            return {"dst": dst, "op": kind, "name": op.name_hint, "args": args}
        if isinstance(op, tvm.ir.Op) and op.name in _VM_OPS:
            return {"dst": dst, "op": _VM_OPS[op.name], "args": args}
        self._refuse(f"a call of {op}")

    def _operand(self, expr) -> dict:
        if isinstance(expr, relax.Var):
            if expr not in self.registers:
                self._refuse(f"the free variable {expr}")
            return {"var": self.registers[expr]}
        if isinstance(expr, IntImm):
            return {"int": int(expr.value)}
        if isinstance(expr, FloatImm):
            return {"float": float(expr.value)}
        if isinstance(expr, StringImm):
            return {"str": str(expr.value)}
        if isinstance(expr, GenericConst):  # a dtype, in this wheel
            return {"dtype": str(expr.value)}
        if isinstance(expr, relax.ShapeExpr):
            return {"shape": [self._dim(d) for d in expr.values]}
        if isinstance(expr, relax.Tuple):
            return {"tuple": [self._operand(f) for f in expr.fields]}
        self._refuse(f"the operand {type(expr).__name__} {expr}")

    def _dim(self, dim) -> int:
        if isinstance(dim, IntImm):
            return int(dim.value)
        self._refuse(f"the symbolic dimension {dim} (VMShapeLower leaves none here)")

    def _refuse(self, what: str):
        raise CompilerStageError(
            f"stage 'board plan' cannot write {what} in function '{self.name}'",
            hint="run this program with backend='mpi' (the TVM VM); the board executor does "
            "not run it yet")
