"""Calls to private Relax functions inlined, so that ``auto_shard`` plans through them.

Propagation carries placements into a callee's parameters, so a plan must
price the callee's operators at every call site, each on its own operands.
:func:`inline_calls` writes each call of a private function in place, its
values named ``<name>__call<k>`` for the ``k``-th call site
(:data:`tvm_distx.autoshard.graph.CALL_SITE`, which the graph reads back to
solve repeated call sites once, as repeated layers).
"""

from __future__ import annotations

import logging

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from tvm_distx.autoshard.graph import CALL_SITE

__all__ = ["inline_calls"]

logger = logging.getLogger(__name__)


def inline_calls(mod: tvm.IRModule, function: str) -> tvm.IRModule:
    """``mod`` with the private Relax functions ``function`` calls inlined, to plan through them.

    Propagation carries placements into a callee's parameters; the planner
    must see the callee's operators at each call site. Each call site is
    costed on its own operands, and its values are named ``<name>__call<k>``
    for the ``k``-th call: repeated call sites of one callee are then solved
    once, as repeated layers (:class:`~tvm_distx.autoshard.graph.ShardGraph`).
    """
    callees = {gv for gv, f in mod.functions.items()
               if isinstance(f, relax.Function) and gv.name_hint != function
               and (f.attrs is None or "global_symbol" not in f.attrs)}
    if not callees:
        return mod

    sites = [0]

    @mutator
    class Inline(PyExprMutator):  # bound to this module's callees and call-site count
        def visit_var_binding_(self, binding) -> None:
            value = binding.value
            if not (isinstance(value, relax.Call) and value.op in callees):
                super().visit_var_binding_(binding)
                return
            site = sites[0]
            sites[0] += 1
            fresh = relax.utils.copy_with_new_vars(mod[value.op])
            for param, arg in zip(fresh.params, value.args):
                arg = self.visit_expr(arg)
                if not isinstance(arg, relax.Var):  # a constant operand
                    arg = self.builder_.emit(arg)
                self.set_var_remap(param, arg)
            body = fresh.body
            for block in body.blocks:
                for inner in block.bindings:
                    new = self.builder_.emit(self.visit_expr(inner.value),
                                             name_hint=f"{inner.var.name}{CALL_SITE}{site}")
                    self.set_var_remap(inner.var, new)
            result = self.visit_expr(body.body)
            self.builder_.emit_normalized(relax.VarBinding(binding.var, result))

    inlined = Inline(mod).visit_expr(mod[function])
    if not sites[0]:
        return mod
    logger.info("auto_shard: %s calls %s at %d sites; planned through the calls (inlined)",
                function, ", ".join(sorted(gv.name_hint for gv in callees)), sites[0])
    out = mod.clone()
    out[mod.get_global_var(function)] = inlined
    public = [gv.name_hint for gv, f in out.functions.items()
              if isinstance(f, relax.Function) and gv not in callees]
    return relax.transform.DeadCodeElimination(public)(out)  # callees no longer called
