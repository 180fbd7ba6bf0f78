"""Which embedding tables a tensor-parallel plan splits on their vocabulary, and why.

A token embedding, ``take(table, ids, axis=0)`` of a ``(V, H)`` table, can be
vocabulary parallel (:class:`tvm_distx.passes.VocabParallelEmbedding`): each of
``p`` ranks holds ``V/p`` rows, and one all-reduce of the ``(T, H)`` hidden
states of a lookup of ``T`` tokens completes it. :func:`embedding_roles` splits a
table where that saves memory. All three rules must hold:

1. **Not tied, or tied to a head split alike.** Nothing but lookups reads the
   table, or the only other reader is the LM head over the same vocabulary
   (``x @ table.T``, the function's output): then the head is split on the
   vocabulary too, each rank holds ``V/p`` rows serving both, and the logits
   are gathered as for any LM head. A table read by anything else stays whole:
   that use would gather it every run.
2. **Divisible.** ``V`` divides by ``p``.
3. **Large against the all-reduce.** ``V >= 2 * T``. Each rank saves
   ``V * H * b * (p - 1) / p`` bytes of table for as long as the program runs;
   a ring all-reduce of the hidden states moves ``2 * T * H * b * (p - 1) / p``
   bytes per rank per run. The rule splits when the first is at least the
   second: one run's traffic is paid back by the memory, whatever ``H``, ``b``
   and ``p``. A symbolic token count (a prompt of any length) passes:
   vocabularies are tens of thousands of rows, and a prompt of half that is not
   what a served model sees per step. Decoding (``T`` = batch) always passes.

A lookup whose ids are not computed from the function's inputs (a position
table looked up with an ``arange``) stays replicated: it is small and its
indices are not token ids. A position table looked up with positions that are
an input (the steps :mod:`tvm_distx.frontend.decoder` makes take ``cache_position``)
cannot be told from a token table, and follows the same three rules; where its
partial sum is added to the token lookup's, one all-reduce completes both
(:class:`tvm_distx.legalize.merge_allreduce.MergeAllReduces`). The reason of every decision is the
:class:`~tvm_distx.plans.tensor_parallel.WeightRole`'s, which ``str(plan)``, the per-layer
summary and ``tvm-distx plan`` print.
"""

from __future__ import annotations

import math

from tvm import relax
import tvm

from tvm_distx.ir import helpers as _ir
from tvm_distx.passes.vocab_parallel import embedding_lookups, vocab_lookups
from tvm_distx.plans.structure import ModelGraph, WeightRole

__all__ = ["embedding_roles"]


def embedding_roles(mod: tvm.IRModule, ranks: int,
                    function: str = "main") -> dict[str, WeightRole]:
    """The role of every embedding table of ``function`` (and of its offsets, once split).

    A table looked up by ``take(table, ids, axis=0)`` is ``"vocab"`` (split on
    its rows, axis 0) when the three rules of the module documentation hold,
    ``"replicated"`` otherwise, with the rule that kept it whole as the reason.
    A lookup already rewritten by :class:`tvm_distx.passes.VocabParallelEmbedding`
    gives the table and its offsets parameter ``"vocab"``.

    Parameters
    ----------
    mod : tvm.IRModule
        As imported, or after :meth:`TensorParallel.prepare`.
    ranks : int
        The size of the model mesh axis.
    function : str
        The function whose tables are planned.
    """

    graph = ModelGraph(mod[function])
    func = mod[function]
    count = int(func.attrs["num_input"]) if func.attrs is not None and \
        "num_input" in func.attrs else None
    inputs = {p for i, p in enumerate(func.params) if count is not None and i < count}
    roles: dict[str, WeightRole] = {}
    for table, offsets in vocab_lookups(mod, function).items():
        tied = any(linear.weight == table for linear in graph.linears.values())
        roles[table] = WeightRole(table, "vocab", 0, _vocab_reason(
            _ir.static_shape(graph.params[table].ty)[0], None, tied), lookup=True)
        roles[offsets] = WeightRole(offsets, "vocab", 0, "each rank's vocabulary offset "
                                    "(its shard is its first row)", bias=True)
    for table, takes in embedding_lookups(func).items():
        vocab, hidden = _ir.static_shape(graph.params[table].ty)

        def whole(reason: str, table=table) -> None:
            roles[table] = WeightRole(table, "replicated", None, reason)

        if not any(_reaches_back(graph, call.args[1], inputs) for call in takes):
            whole("a position table (its indices are not token ids): small, kept whole")
            continue
        head = _tied_head(graph, table, takes)
        if head is False:
            whole("the embedding table is also read by another use than the LM head: a "
                  "vocabulary split would gather it every run")
            continue
        if vocab % ranks:
            whole(f"the embedding's {vocab} rows do not divide by {ranks} ranks")
            continue
        shapes = [_ir.static_shape(call.args[1].ty) for call in takes]
        tokens = max((math.prod(s) for s in shapes if s is not None and None not in s),
                     default=None)
        if tokens is not None and vocab < 2 * tokens:
            whole(f"a vocabulary split would save {vocab} rows of {hidden} per rank, less "
                  f"than the all-reduce of {tokens} tokens' hidden states it adds to every "
                  f"run (vocabulary < 2 x tokens)")
            continue
        roles[table] = WeightRole(table, "vocab", 0, _vocab_reason(vocab, tokens, head),
                                  lookup=True)
    return roles


def _tied_head(graph: ModelGraph, table: str, takes: list) -> bool | None:
    """None if only ``takes`` read ``table``; True if the LM head over the vocabulary reads
    it too (``x @ table.T``, the function's output); False for any other use."""
    others = [u for u in graph.users.get(graph.params[table], [])
              if not any(graph.value[u].same_as(call) for call in takes)]
    if not others:
        return None
    heads = [linear for linear in graph.linears.values() if linear.weight == table]
    if len(heads) != 1 or heads[0].out_axis != 0 or not graph.is_output_projection(heads[0]):
        return False
    head = heads[0]
    return all(u is head.matmul or (_ir.is_call_to(graph.value[u], "relax.permute_dims") and
                                    graph.users.get(u, []) == [head.matmul]) for u in others)


def _vocab_reason(vocab: int, tokens: int | None, tied: bool | None = None) -> str:
    told = f" >= 2 x {tokens} tokens" if tokens else ""
    what = "the token embedding, tied to the LM head split alike" if tied else \
        "an embedding table looked up with ids from the inputs"
    return (f"{what}: its {vocab} rows split{told} (each rank saves more table than the "
            "lookup's all-reduce moves); masked lookup, one all-reduce")


def _reaches_back(graph: ModelGraph, expr, inputs: set) -> bool:
    """Whether ``expr`` is computed from one of ``inputs`` (any non-weight when unknown)."""
    stack, seen = [expr], set()
    while stack:
        node = stack.pop()
        if not isinstance(node, relax.Var) or node in seen:
            continue
        seen.add(node)
        if node.name in graph.params and graph.params[node.name].same_as(node):
            if node in inputs or not inputs and len(_ir.static_shape(node.ty) or ()) != 2:
                return True
            continue
        value = graph.value.get(node)
        if value is not None:
            stack.extend(_ir.operand_vars(value))
    return False
