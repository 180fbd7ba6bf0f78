"""VocabParallelEmbedding in TVM's test form: a ``Before`` module, an ``Expected`` one by hand.

A token table of 16 rows split in 2 vocabulary blocks: its lookup becomes the table
reshaped into blocks and one masked, offset lookup kernel summed over the blocks, with
the blocks' first rows as a new parameter (recorded in the module attribute). A table
not named, looked up beside it, is left as it is; a module already rewritten is left as
it is.
"""

from __future__ import annotations

import json

import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tvm_distx.passes import VocabParallelEmbedding
from tvm_distx.passes.split_fused import ATTR


def rewrite(mod: tvm.IRModule, tables: dict) -> tvm.IRModule:
    out = VocabParallelEmbedding(tables)(mod)
    relax.analysis.well_formed(out)
    return out


@I.ir_module
class TwoLookups:
    @R.function
    def main(ids: R.Tensor((4,), "int32"), pos_ids: R.Tensor((4,), "int32"),
             tok: R.Tensor((16, 8), "float32"), pos: R.Tensor((4, 8), "float32")
             ) -> R.Tensor((4, 8), "float32"):
        R.func_attr({"num_input": 2})
        with R.dataflow():
            t = R.take(tok, ids, axis=0)
            p = R.take(pos, pos_ids, axis=0)
            out = R.add(t, p)
            R.output(out)
        return out


#: the offsets parameter is made from the layout alone: block b starts at row 8 * b
TOK_OFFSETS = json.dumps({"main": [{"kind": "block_offsets", "name": "tok_vocab_offsets",
                                    "extent": 16, "blocks": 2, "dtype": "int32"}]})


@I.ir_module
class TwoLookupsTokSplit:
    I.module_attrs({ATTR: TOK_OFFSETS})

    @T.prim_func(private=True, s_tir=True)
    def vocab_parallel_lookup(table: T.Buffer((T.int64(2), T.int64(8), T.int64(8)), "float32"),
                              ids: T.Buffer((T.int64(4),), "int32"),
                              offsets: T.Buffer((T.int64(2),), "int32"),
                              vocab_lookup: T.Buffer((T.int64(4), T.int64(8)), "float32")):
        T.func_attr({"tvm_distx.vocab_lookup": 1, "tirx.noalias": True})
        for t, h, block in T.grid(T.int64(4), T.int64(8), T.int64(2)):
            with T.sblock("vocab_lookup"):
                # te.compute starts its spatial axes at an int32 0, whatever their extents
                vt = T.axis.spatial((0, T.int64(4)), t)
                vh = T.axis.spatial((0, T.int64(8)), h)
                vb = T.axis.reduce(T.int64(2), block)
                with T.init():
                    vocab_lookup[vt, vh] = T.float32(0.0)
                # rows [8 b, 8 b + 8) live in block b: the other ids read nothing (0). The
                # pass clips the row it reads to [0, 8); under the guard the clip is the
                # identity, and te.create_prim_func simplifies it away (and writes x >= 0
                # as 0 <= x): the read stays in bounds because if_then_else evaluates only
                # the branch it takes.
                vocab_lookup[vt, vh] = vocab_lookup[vt, vh] + T.if_then_else(
                    0 <= ids[vt] - offsets[vb] and ids[vt] - offsets[vb] < 8,
                    table[vb, T.Cast("int64", ids[vt]) - T.Cast("int64", offsets[vb]), vh],
                    T.float32(0.0))

    @R.function
    def main(ids: R.Tensor((4,), "int32"), pos_ids: R.Tensor((4,), "int32"),
             tok: R.Tensor((16, 8), "float32"), pos: R.Tensor((4, 8), "float32"),
             tok_vocab_offsets: R.Tensor((2,), "int32")) -> R.Tensor((4, 8), "float32"):
        R.func_attr({"num_input": 2})
        cls = TwoLookupsTokSplit
        with R.dataflow():
            tok_blocks = R.reshape(tok, R.shape([2, 8, 8]))
            tok_lookup = R.call_tir(cls.vocab_parallel_lookup, (tok_blocks, ids, tok_vocab_offsets),
                                    out_ty=R.Tensor((4, 8), "float32"))
            p = R.take(pos, pos_ids, axis=0)
            out = R.add(tok_lookup, p)
            R.output(out)
        return out


def test_named_table_lookup_becomes_the_blocked_masked_lookup_and_the_other_stays_a_take():
    """tok (16, 8) in 2 blocks: tok is reshaped to (2, 8, 8), its take becomes a call of the
    masked, offset lookup kernel (summed over the blocks: a partial sum once the blocks are
    split) reading tok_vocab_offsets, a new last parameter recorded as block offsets in the
    module attribute; the position table pos, not named, keeps its take."""
    tvm.ir.assert_structural_equal(rewrite(TwoLookups, {"tok": 2}), TwoLookupsTokSplit)


def test_module_already_rewritten_is_left_as_it_is():
    """The rewritten module, rewritten again for the same table: unchanged (no take of tok
    is left; its lookup is recognised as vocabulary-parallel already)."""
    tvm.ir.assert_structural_equal(rewrite(TwoLookupsTokSplit, {"tok": 2}), TwoLookupsTokSplit)


def test_no_table_named_leaves_the_module_as_it_is():
    """An empty table mapping: both takes stay, no parameter and no attribute is added."""
    tvm.ir.assert_structural_equal(rewrite(TwoLookups, {}), TwoLookups)
