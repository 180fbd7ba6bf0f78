"""Calls to private Relax functions written in place, so that an analysis sees through them.

Propagation carries placements from a caller into a private callee's
parameters, so a plan of the caller must read the callee's operators at every
call site, each on its own operands. :func:`inline_calls` writes each call of
a private function in place, the callee's values named ``<name><suffix><k>``
for the ``k``-th call site. The automatic sharding (:mod:`tvm_distx.autoshard`)
prices the inlined program; the tensor-parallel plan
(:mod:`tvm_distx.plans.tensor_parallel`) reads its linears there.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

__all__ = ["inline_calls", "private_callees"]


def private_callees(mod: tvm.IRModule, function: str) -> set:
    """The global variables of ``mod``'s private Relax functions other than ``function``."""
    return {gv for gv, f in mod.functions.items()
            if isinstance(f, relax.Function) and gv.name_hint != function
            and (f.attrs is None or "global_symbol" not in f.attrs)}


def inline_calls(mod: tvm.IRModule, function: str,
                 suffix: str = "__call") -> tuple[tvm.IRModule, int]:
    """``mod`` with the calls ``function`` makes to private Relax functions inlined.

    Parameters
    ----------
    mod : tvm.IRModule
        The module (not changed).
    function : str
        The function whose calls are inlined (one level: the callees' own calls
        are inlined too, as the callee's body is visited again).
    suffix : str
        What a callee's value has after its name, before the call site's number.

    Returns
    -------
    tuple of (tvm.IRModule, int)
        The module (``mod`` itself when ``function`` calls no private function),
        with the callees no longer called removed, and the number of call sites.
    """
    callees = private_callees(mod, function)
    if not callees:
        return mod, 0

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
                                             name_hint=f"{inner.var.name}{suffix}{site}")
                    self.set_var_remap(inner.var, new)
            result = self.visit_expr(body.body)
            self.builder_.emit_normalized(relax.VarBinding(binding.var, result))

    inlined = Inline(mod).visit_expr(mod[function])
    if not sites[0]:
        return mod, 0
    out = mod.clone()
    out[mod.get_global_var(function)] = inlined
    public = [gv.name_hint for gv, f in out.functions.items()
              if isinstance(f, relax.Function) and gv not in callees]
    return relax.transform.DeadCodeElimination(public)(out), sites[0]  # callees not called
