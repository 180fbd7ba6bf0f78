"""Calls to private Relax functions inlined, so that ``auto_shard`` plans through them.

Propagation carries placements into a callee's parameters, so a plan must
price the callee's operators at every call site, each on its own operands.
:func:`inline_calls` writes each call of a private function in place
(:func:`tvm_distx.ir.inline.inline_calls`), its values named ``<name>__call<k>``
for the ``k``-th call site (:data:`tvm_distx.autoshard.graph.CALL_SITE`, which
the graph reads back to solve repeated call sites once, as repeated layers).
"""

from __future__ import annotations

import logging

import tvm

from tvm_distx.autoshard.graph import CALL_SITE
from tvm_distx.ir import inline as _inline

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
    callees = _inline.private_callees(mod, function)
    out, sites = _inline.inline_calls(mod, function, CALL_SITE)
    if sites:
        logger.info("auto_shard: %s calls %s at %d sites; planned through the calls (inlined)",
                    function, ", ".join(sorted(gv.name_hint for gv in callees)), sites)
    return out
