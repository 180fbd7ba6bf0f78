"""``VocabParallelEmbedding``: embedding lookups that read a vocabulary-split table.

A token embedding is ``take(table, ids, axis=0)`` on a ``(V, H)`` table. Split
on the vocabulary (``S[0]``) over ``p`` ranks, each rank holds rows
``[offset, offset + V/p)``, and a lookup is done in four steps on each rank:
mask the ids outside its rows, take ``ids - offset`` only where the mask holds
(an ``if_then_else``, which evaluates only the branch it takes, so no row outside
the rank's block is read), zero the masked rows, and sum over the ranks. The sum is a
partial sum, completed by one all-reduce (or a reduce-scatter where the
consumer wants the tokens split).

This pass writes that lookup so that it is exact in the *global* view, where
propagation and the local-view lowering already know what to do with it:

* the table is reshaped to ``(p, V/p, H)``: its first axis is the block a row
  lives in, split ``S[0]`` like the table (a reshape of the leading axis);
* a new parameter ``<table>_vocab_offsets`` of shape ``(p,)`` holds each
  block's first row (:class:`tvm_distx.layout.derived.BlockOffsets`); split
  ``S[0]``, each rank's shard of it is its own offset;
* one kernel (``tvm_distx.vocab_lookup``) computes
  ``out[t, h] = sum_b (0 <= ids[t] - off[b] < V/p) ? table3[b, ids[t] - off[b], h] : 0``
  (the kernel's declared read region covers the masked rows too; only the guarded
  branch reads).

Propagation reads the kernel like any ``call_tir``
(:mod:`tvm_distx.passes.tir_access`): ``b`` indexes the table's block axis
and the offsets, and is summed over, so splitting it leaves a partial sum
(``P``); the data-dependent row index keeps the row axis whole. The local-view
lowering then shrinks ``b`` to one block, which is exactly the masked, offset
lookup of each rank, followed by the all-reduce TVM adds after a split
reduction. The program computes the same values on one rank as
``take`` does.

Why a parameter for the offset, not a rank builtin: the offset is a fact of
the layout (which rows a rank holds), so it is cut from the layout like any
weight. It reaches MPI ranks, disco workers, emulated threads and exported
bundles by the one path weights already take, every per-rank program stays
identical within its rank set, and nothing in the runtime changes. It costs
``p`` integers.

The reshape costs no copy: after lowering it is a kernel that only moves
indices, which TVM's build (``RewriteDataflowReshape``) turns back into a view
of each rank's rows.

Which tables are split is the caller's choice (``tables``);
:func:`tvm_distx.plans.presets.tensor_parallel` and :func:`tvm_distx.plans.presets.from_hf`
decide it (see :mod:`tvm_distx.plans.vocab`). A rewritten lookup is recognised by
:func:`vocab_lookups`. The offsets are recorded as a derived parameter in the
module attribute :data:`tvm_distx.passes.split_fused.ATTR`, so ``run``,
``export`` and bundles add them to the user's weights.
"""

from __future__ import annotations

import json
import logging
from typing import Mapping

import tvm
from tvm import relax, te, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from tvm_distx.ir import helpers as _ir
from tvm_distx.ir.module_pass import module_pass
from tvm_distx.errors import RuleError
from tvm_distx.layout.derived import BlockOffsets, Derivations

from tvm_distx.passes.split_fused import ATTR, derivations_of

__all__ = ["KERNEL_ATTR", "VocabParallelEmbedding", "embedding_lookups", "offsets_name",
           "vocab_lookups"]

logger = logging.getLogger(__name__)

#: The PrimFunc attribute that marks the vocabulary-parallel lookup kernel.
KERNEL_ATTR = "tvm_distx.vocab_lookup"


def offsets_name(table: str) -> str:
    """The name of the offsets parameter of ``table``'s vocabulary-parallel lookups."""
    return f"{table}_vocab_offsets"


def embedding_lookups(func: relax.Function) -> dict[str, list[relax.Call]]:
    """Every ``take(param, ids, axis=0)`` of a 2-D parameter, by the parameter's name."""
    params = {p.name: p for p in func.params}
    out: dict[str, list[relax.Call]] = {}
    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if not _ir.is_call_to(value, "relax.take"):
                continue
            table = value.args[0]
            if not (isinstance(table, relax.Var) and table.name in params and
                    params[table.name].same_as(table)):
                continue
            shape = _ir.static_shape(table.ty)
            axis = value.attrs.axis
            if shape is None or len(shape) != 2 or None in shape or axis is None or \
                    int(axis) != 0:
                continue
            out.setdefault(table.name, []).append(value)
    return out


def vocab_lookups(mod: tvm.IRModule, function: str = "main") -> dict[str, str]:
    """The vocabulary-parallel lookups of ``function``: table parameter -> offsets parameter."""
    func = mod[function]
    params = {p.name for p in func.params}
    values = {}
    for block in func.body.blocks:
        for binding in block.bindings:
            values[binding.var] = binding.value
    out = {}
    for value in values.values():
        if not _ir.is_call_to(value, "relax.call_tir"):
            continue
        callee = value.args[0]
        try:
            kernel = mod[callee]
        except Exception:  # noqa: BLE001 - not in the module
            continue
        if not isinstance(kernel, tirx.PrimFunc) or kernel.attrs is None or \
                KERNEL_ATTR not in kernel.attrs:
            continue
        table3, _, offsets = value.args[1].fields
        reshape = values.get(table3)
        if reshape is None or not _ir.is_call_to(reshape, "relax.reshape"):
            continue
        table = reshape.args[0]
        if isinstance(table, relax.Var) and table.name in params and \
                isinstance(offsets, relax.Var) and offsets.name in params:
            out[table.name] = offsets.name
    return out


def _kernel(blocks: int, rows: int, hidden: int, ids_shape, id_dtype: str,
            dtype: str) -> tirx.PrimFunc:
    """The masked, offset lookup summed over the vocabulary blocks (see the module doc).

    Its extents and the row it reads are ``int64``, as ``LegalizeOps`` writes
    them, so that ``FuseTIR`` can fuse the kernel with one that writes its table
    (a decoded weight) and the fused indices have one type.
    """
    blocks, rows, hidden = (tirx.IntImm("int64", v) for v in (blocks, rows, hidden))
    table = te.placeholder((blocks, rows, hidden), dtype, "table")
    ids = te.placeholder(tuple(ids_shape), id_dtype, "ids")
    offsets = te.placeholder((blocks,), id_dtype, "offsets")
    block = te.reduce_axis((tirx.IntImm("int64", 0), blocks), "block")

    def lookup(*index):
        *token, h = index
        local = ids[tuple(token)] - offsets[block]
        inside = tirx.all(local >= 0, local < tirx.const(int(rows), id_dtype))
        row = tirx.Cast("int64", tirx.max(tirx.min(local, tirx.const(int(rows) - 1, id_dtype)),
                                          tirx.const(0, id_dtype)))
        value = tirx.if_then_else(inside, table[block, row, h], tirx.const(0, dtype))
        return te.sum(value, axis=block)

    out = te.compute((*ids_shape, hidden), lookup, name="vocab_lookup")
    func = te.create_prim_func([table, ids, offsets, out])
    return func.without_attr("global_symbol").with_attr(KERNEL_ATTR, 1)


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, tables: dict[str, tuple[int, relax.Var]]) -> None:
        super().__init__(mod)
        self.tables = tables

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:  # noqa: D102
        call = binding.value
        if isinstance(binding.var, relax.DataflowVar) and self._chosen(call):
            # the lookup's result is named after its table (explain's row of the partial
            # sum says whose lookup it is); later uses read it directly, with no alias
            # between it and its consumers (an alias would keep a reduce-scatter apart)
            table = call.args[0]
            result = self.builder_.emit(self._lookup(call), name_hint=f"{table.name}_lookup")
            self.set_var_remap(binding.var, result)
            return
        super().visit_var_binding_(binding)

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: D102
        call = super().visit_call_(call)
        return self._lookup(call) if self._chosen(call) else call

    def _chosen(self, call) -> bool:
        if not _ir.is_call_to(call, "relax.take"):
            return False
        table = call.args[0]
        return isinstance(table, relax.Var) and table.name in self.tables and \
            call.attrs.axis is not None and int(call.attrs.axis) == 0

    def _lookup(self, call: relax.Call) -> relax.Expr:
        table = call.args[0]
        blocks, offsets = self.tables[table.name]
        vocab, hidden = _ir.static_shape(table.ty)
        ids = self.visit_expr(call.args[1])
        if str(ids.ty.dtype) != str(offsets.ty.dtype):
            ids = self.builder_.emit(relax.op.astype(ids, offsets.ty.dtype))
        rows = vocab // blocks
        table3 = self.builder_.emit(relax.op.reshape(table, (blocks, rows, hidden)),
                                    name_hint=f"{table.name}_blocks")
        ids_shape = list(ids.ty.shape)
        # the kernel binds each extent from its buffer: an extent that is an expression
        # (3 * seq, from flattening a batch of symbolic length) becomes a fresh variable
        kernel_shape = [d if isinstance(d, (tirx.IntImm, tirx.Var)) else
                        tirx.Var(f"n{axis}", "int64") for axis, d in enumerate(ids_shape)]
        kernel = _kernel(blocks, rows, hidden, kernel_shape, str(ids.ty.dtype),
                         str(table.ty.dtype))
        gv = self.builder_.add_func(kernel, "vocab_parallel_lookup")
        out_ty = relax.TensorType([*ids_shape, hidden], table.ty.dtype)
        return relax.call_tir(gv, [table3, ids, offsets], out_ty)


@module_pass(name="tvm_distx.VocabParallelEmbedding")
class VocabParallelEmbedding:
    """Rewrite the lookups of the named tables as vocabulary-parallel lookups.

    Parameters
    ----------
    tables : mapping of str to int
        Table parameter name -> the number of vocabulary blocks (the ranks of
        the mesh axis that splits it).
    function : str
        The public function whose lookups are rewritten.

    Raises
    ------
    RuleError
        If a named table is not a 2-D parameter looked up on axis 0, or its
        vocabulary does not divide into its blocks.

    Notes
    -----
    Run it before annotating; the table and its offsets parameter (named by
    :func:`offsets_name`, appended to the parameters) must then both be split
    ``S[0]`` on the same mesh axis. The pass is idempotent: a table already
    rewritten is no longer looked up by ``take``.
    """

    def __init__(self, tables: Mapping[str, int], function: str = "main") -> None:
        self.tables = dict(tables)
        self.function = function

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if not self.tables:
            return mod
        func = mod[self.function]
        lookups = embedding_lookups(func)
        params = {p.name: p for p in func.params}
        chosen: dict[str, tuple[int, relax.Var]] = {}
        made = []
        for name, blocks in self.tables.items():
            if name not in lookups:
                if name in vocab_lookups(mod, self.function):
                    continue  # rewritten already
                raise RuleError(f"VocabParallelEmbedding: '{name}' is not a 2-D parameter of "
                                f"'{self.function}' looked up by take(..., axis=0)",
                                function=self.function, var=name, placement="S[0]",
                                hint="name a token embedding table, or leave it replicated")
            vocab, _ = _ir.static_shape(params[name].ty)
            if vocab % blocks:
                raise RuleError(f"VocabParallelEmbedding: the {vocab} rows of '{name}' do not "
                                f"divide into {blocks} blocks", function=self.function,
                                var=name, placement="S[0]",
                                hint="keep the table replicated (placement 'R')")
            id_dtype = str(lookups[name][0].args[1].ty.dtype)
            offsets = relax.Var(offsets_name(name), relax.TensorType([blocks], id_dtype))
            chosen[name] = (blocks, offsets)
            made.append(BlockOffsets(offsets.name, vocab, blocks, id_dtype))
        if not chosen:
            return mod
        rewriter = _Rewriter(mod, chosen)
        body = rewriter.visit_expr(func)
        new_params = list(func.params) + [offsets for _, offsets in chosen.values()]
        new = relax.Function(new_params, body.body, body.ret_ty, body.is_pure, body.attrs,
                             body.span)
        out = rewriter.builder_.get()
        out[self.function] = new
        recorded = derivations_of(mod)
        recorded[self.function] = recorded.get(self.function, Derivations()).merged((), made)
        logger.info("%s: vocabulary-parallel lookups of %s", self.function,
                    ", ".join(f"{n} ({b} blocks)" for n, (b, _) in chosen.items()))
        text = json.dumps({name: d.to_json() for name, d in recorded.items() if d})
        return out.with_attr(ATTR, text)
