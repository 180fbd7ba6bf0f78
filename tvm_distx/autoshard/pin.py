"""Writing a plan into the module: annotations on parameters and on chosen values.

Parameters and inputs are annotated by :class:`tvm_distx.passes.AnnotateSharding`
(rules, which a user can read and edit). Values inside the function are
*pinned*: ``v = f(...)`` becomes ``v_raw = f(...)`` and
``v = R.dist.annotate_sharding(v_raw, ...)``, so that propagation keeps the
solver's placement where equally good alternatives exist, and inserts the
redistributions the solver costed, where it costed them.
"""

from __future__ import annotations

import logging
from typing import Mapping

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..layout import Placement

__all__ = ["pin_values"]

logger = logging.getLogger(__name__)


@mutator
class _Pin(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, pins: Mapping[relax.Var, str], mesh) -> None:
        super().__init__(mod)
        self.pins = dict(pins)
        self.mesh = mesh

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        placement = self.pins.get(binding.var)
        if placement is None:
            super().visit_var_binding_(binding)
            return
        value = self.visit_expr(binding.value)
        raw = self.builder_.emit(value, name_hint=f"{binding.var.name}_raw")
        annotated = self.builder_.normalize(relax.op.distributed.annotate_sharding(
            raw, self.mesh, Placement.parse(placement).to_tvm()))
        self.builder_.emit_normalized(relax.VarBinding(binding.var, annotated))


def pin_values(mod: tvm.IRModule, pins: Mapping[relax.Var, str],
               function: str = "main") -> tvm.IRModule:
    """``mod`` with ``function``'s values named in ``pins`` annotated with their placements.

    Parameters
    ----------
    mod : tvm.IRModule
        With exactly one mesh.
    pins : mapping of relax.Var to str
        A variable bound in ``mod[function]`` -> placement text (no partial sums).
    function : str
    """
    mesh = mod.global_infos["mesh"][0]
    gv = mod.get_global_var(function)
    updated = mod.clone()
    updated[gv] = _Pin(mod, pins, mesh).visit_expr(mod[function])
    logger.debug("pinned %d values of %s", len(pins), function)
    return updated
