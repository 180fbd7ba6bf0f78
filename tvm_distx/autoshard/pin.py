"""Writing a plan into the module: annotations on parameters and on chosen values.

Parameters and inputs are annotated by :class:`tvm_distx.passes.AnnotateSharding`
(rules, which a user can read and edit). Values inside the function are
*pinned*: ``v = f(...)`` becomes ``v_raw = f(...)`` and
``v = R.dist.annotate_sharding(v_raw, ...)``, so that propagation keeps the
solver's placement where equally good alternatives exist, and inserts the
redistributions the solver costed, where it costed them.

A pin on a call's result does not fix how the call runs: propagation may
run it on other operand placements and move the result. So where the solver
moves an operand for a call (a weight held split, gathered for one user), the
call reads it through an annotation too: ``f(w)`` becomes
``w_as_R = R.dist.annotate_sharding(w, ..., "R")`` and ``f(w_as_R)``; users
that want the same placement share one.
"""

from __future__ import annotations

import logging
from typing import Mapping

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from tvm_distx.layout import Placement

__all__ = ["pin_values"]

logger = logging.getLogger(__name__)


@mutator
class _Pin(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, pins: Mapping[relax.Var, str], mesh,
                 reads: Mapping[relax.Var, Mapping[relax.Var, str]],
                 held: Mapping[relax.Var, str]) -> None:
        super().__init__(mod)
        self.held = dict(held)
        self.pins = dict(pins)
        self.mesh = mesh
        self.reads = {k: dict(v) for k, v in reads.items()}
        self.moved: dict[tuple, relax.Var] = {}

    def _annotated(self, var: relax.Var, placement: str, hint: str) -> relax.Var:
        return self.builder_.emit(relax.op.distributed.annotate_sharding(
            var, self.mesh, Placement.parse(placement).to_tvm()), name_hint=hint)

    def _read_as(self, var: relax.Var, placement: str) -> relax.Var:
        key = (var, placement)
        if key not in self.moved and var in self.held:
            # a parameter: annotated where it is held first, as its rule will say
            # (AnnotateSharding takes an annotation of the parameter itself for its own)
            if (var, None) not in self.moved:
                self.moved[var, None] = self._annotated(var, self.held[var], f"{var.name}_held")
            var = self.moved[var, None]
        if key not in self.moved:
            self.moved[key] = self._annotated(
                var, placement, f"{var.name}_as_{placement.replace('[', '').replace(']', '')}")
        return self.moved[key]

    def _with_reads(self, value, wanted: Mapping[relax.Var, str]):
        def swap(arg):
            if isinstance(arg, relax.Var) and arg in wanted:
                return self._read_as(arg, wanted[arg])
            return arg

        if not isinstance(value, relax.Call):
            return value
        args = list(value.args)
        if args and isinstance(args[0], tvm.ir.GlobalVar) and len(args) > 1 and \
                isinstance(args[1], relax.Tuple):  # call_tir(kernel, (operands...))
            args[1] = relax.Tuple([swap(a) for a in args[1].fields])
        else:
            args = [swap(a) for a in args]
        return relax.Call(value.op, args, value.attrs, value.ty_args, value.span)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        placement = self.pins.get(binding.var)
        wanted = self.reads.get(binding.var)
        if placement is None and not wanted:
            super().visit_var_binding_(binding)
            return
        value = self.visit_expr(binding.value)
        if wanted:
            value = self._with_reads(value, wanted)
        if placement is None:
            self.builder_.emit_normalized(relax.VarBinding(binding.var,
                                                           self.builder_.normalize(value)))
            return
        raw = self.builder_.emit(value, name_hint=f"{binding.var.name}_raw")
        annotated = self.builder_.normalize(relax.op.distributed.annotate_sharding(
            raw, self.mesh, Placement.parse(placement).to_tvm()))
        self.builder_.emit_normalized(relax.VarBinding(binding.var, annotated))


def pin_values(mod: tvm.IRModule, pins: Mapping[relax.Var, str],
               function: str = "main",
               reads: Mapping[relax.Var, Mapping[relax.Var, str]] | None = None,
               held: Mapping[relax.Var, str] | None = None) -> tvm.IRModule:
    """``mod`` with ``function``'s values named in ``pins`` annotated with their placements.

    Parameters
    ----------
    mod : tvm.IRModule
        With exactly one mesh.
    pins : mapping of relax.Var to str
        A variable bound in ``mod[function]`` -> placement text (no partial sums).
    function : str
    reads : mapping, optional
        A variable bound in ``mod[function]`` -> {operand variable: the placement
        the call reads it in}, for operands the solver moves for that call.
    """
    mesh = mod.global_infos["mesh"][0]
    gv = mod.get_global_var(function)
    updated = mod.clone()
    updated[gv] = _Pin(mod, pins, mesh, reads or {}, held or {}).visit_expr(mod[function])
    logger.debug("pinned %d values and %d reads of %s", len(pins), len(reads or {}), function)
    return updated
