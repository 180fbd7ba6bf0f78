"""The plan a propagated program runs, read back as strategies of a :class:`ShardGraph`.

A hand-written plan (a preset, parameter rules) fixes the inputs and weights;
propagation then chooses every other placement, and it need not choose what
the cost model would (a replicated input stays replicated, a gather may come
earlier). To price such a plan honestly, :func:`realized_choice` reads the
placement propagation gave every value of the function, and the placements
each call's operands arrive in, and picks for every node of the graph the
strategy that matches them. :func:`tvm_distx.autoshard.ilp.evaluate` then
prices that choice with the same model the integer program minimises, so a
preset and :func:`~tvm_distx.autoshard.auto_shard`'s plan are compared on the
programs that run.

Values are matched by their Relax variable names, which propagation keeps.
"""

from __future__ import annotations

import logging

import tvm
from tvm import relax

from tvm_distx.layout import TensorSharding
from tvm_distx.autoshard.graph import ShardGraph

__all__ = ["realized_choice", "propagated_placements"]

logger = logging.getLogger(__name__)


def _placement(ty) -> str | None:
    sharding = TensorSharding.from_type(ty)
    return None if sharding is None else str(sharding.placement)


def propagated_placements(mod: tvm.IRModule, function: str = "main"
                          ) -> dict[str, tuple[str, tuple[str | None, ...]]]:
    """Per variable name of ``mod[function]``: its placement and its call's operands' placements.

    ``mod`` is a module after :class:`tvm_distx.passes.PropagateSharding`
    (every value an ``R.DTensor``). The operands are the call's tensor
    arguments in order (a ``call_tir``'s argument tuple), each the placement it
    arrives in (after any redistribution propagation inserted).
    """
    func = mod[function]
    found: dict[str, tuple[str, tuple[str | None, ...]]] = {}
    for param in func.params:
        placement = _placement(param.ty)
        if placement is not None:
            found[str(param.name)] = (placement, ())
    for block in func.body.blocks:
        for binding in block.bindings:
            placement = _placement(binding.var.ty)
            if placement is None:
                continue
            value = binding.value
            args: list = []
            if isinstance(value, relax.Call):
                args = list(value.args)
                if args and isinstance(args[0], tvm.ir.GlobalVar):
                    args = list(args[1].fields) if len(args) > 1 and isinstance(
                        args[1], relax.Tuple) else args[1:]
            ins = tuple(_placement(a.ty) for a in args if isinstance(a, relax.Var))
            found[str(binding.var.name)] = (placement, ins)
    return found


def realized_choice(graph: ShardGraph, placements: dict[str, tuple[str, tuple]]) -> list[int]:
    """Per node, the index of the strategy the propagated program runs.

    A node's strategy is the one whose operand placements match the call's
    (a split contraction shows there: its result is a partial sum that the
    program completes), then whose result placement matches. A node the
    program does not name keeps its replicated strategy (or its first one).
    """
    choice = []
    unmatched = 0
    for index, node in enumerate(graph.nodes):
        strategies = graph.strategies[index]
        got = placements.get(node.name)
        if got is None:
            unmatched += 1
            replicated = [s for s, st in enumerate(strategies) if "S" not in st.out
                          and "P" not in st.out]
            choice.append(replicated[0] if replicated else 0)
            continue
        out, ins = got

        def score(s: int, out=out, ins=ins) -> tuple:
            st = strategies[s]
            same_ins = sum(1 for a, b in zip(st.ins, ins) if a == b) \
                if len(ins) == len(st.ins) else 0
            return (same_ins, st.out == out, -s)

        choice.append(max(range(len(strategies)), key=score))
    if unmatched:
        logger.debug("%d values of the graph are not in the propagated program", unmatched)
    return choice
