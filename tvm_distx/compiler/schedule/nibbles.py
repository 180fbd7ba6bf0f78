"""The ``q4`` matrix-vector recipe for AVX-512: each nibble indexes a table of 16 values.

Decoding one token reads every weight once, so a ``q4`` matvec should run at the
speed of memory. :class:`~tvm_distx.compiler.schedule.matvec.MatvecRule` decodes a
nibble the way its definition reads: zero-extend the byte, mask or shift out
the nibble, convert it to float, then ``nibble * scale - 8 * scale``: five
vector instructions for every 16 weights besides the product itself, which
makes the kernel compute-bound on one core.

A group has one scale, so its nibbles take only 16 values, ``(n - 8) * scale``
for ``n = 0..15``: one AVX-512 register. :class:`NibbleTableRule` builds that
table once per group (one multiply) and decodes 16 nibbles with one
``vpermps``, which reads only the low four bits of each 32-bit index. So, per
group of 32 weights (16 bytes):

1. ``vpmovzxbd``: the 16 bytes as 16 indices (their low nibbles are the
   group's first 16 weights);
2. ``vmulps``: the table, ``[-8, -7, ..., 7] * scale``;
3. ``vpermps`` twice, the second after ``vpsrld 4`` (the high nibbles, the
   group's last 16 weights);
4. two ``vfmadd`` into the row's accumulators.

Seven instructions for 32 weights where the generic recipe takes twelve. The
table entries are the decoded weights exactly (``(n - 8) * scale``, rounded
once), so the products are those of the decoded weight.

The recipe writes the product loop itself (TIR with explicit vectors and the
``llvm.x86.avx512.permvar.sf.512`` intrinsic): one row of the weight per
iteration of a parallel loop, read front to back and prefetched ahead as the
generic recipe does, the row's four accumulators summed as a tree. The
epilogue blocks (a bias, ``silu`` times another product, a residual) keep
their own loops and are vectorized.

**What it applies to.** A matvec that the generic recipe would take, with one
row of activations read from a parameter, whose weight is decoded by its
prologue from a ``uint8`` parameter ``(n, k/2)`` and a ``float16`` parameter
``(n, k/32)``. The decode is then *evaluated* (:func:`_evaluate`, on random
bytes and scales at sample positions of every group offset) and must give
``q4``'s value (:mod:`tvm_distx.sources.formats`): ``(nibble - 8) * scale``
with the group's first 16 values in the low nibbles. A decode of the same
shapes that means something else keeps the generic recipe. Targets without
AVX-512 (AVX2, RISC-V) keep it too.
"""

from __future__ import annotations

from dataclasses import dataclass
import logging
import operator

import numpy as np
import tvm_ffi
from tvm import s_tir, tirx
from tvm.ir import Range
from tvm.ir.expr import Call, TensorLoad
from tvm.s_tir import Schedule
from tvm.tirx import Broadcast, BufferLoad, BufferStore, Cast, Ramp, const

from tvm_distx.compiler.schedule.base import (RULE_ATTR, Block, CPUTraits, describe_blocks,
                                           vectorize_innermost)
from tvm_distx.compiler.schedule.matmul import MatmulMatch
from tvm_distx.compiler.schedule.matvec import MatvecRule
from tvm_distx.sources.formats import GROUP

__all__ = ["NibbleTableRule"]

logger = logging.getLogger(__name__)

#: The AVX-512 permute whose index is the low four bits of each 32-bit lane.
_PERMUTE = "llvm.x86.avx512.permvar.sf.512"
_LANES = 16
#: Bytes of the weight prefetched ahead of the row being read (see ``matvec._prefetched``).
_AHEAD = 4096
#: Parallel tasks per core (a few, so that a core slowed by another process is caught up).
_TASKS_PER_CORE = 4


@dataclass(frozen=True)
class NibbleMatch:
    """A ``q4`` matvec: the generic match and the parameters the recipe reads."""

    matmul: MatmulMatch
    x: tirx.Buffer
    data: tirx.Buffer
    scale: tirx.Buffer
    rows: int
    depth: int


class NibbleTableRule(MatvecRule):
    """``q4`` matrix-vector products on AVX-512, decoding nibbles through a table.

    Matches what :class:`~tvm_distx.compiler.schedule.matvec.MatvecRule` matches
    when the weight is ``q4`` and there is one row of activations (the module
    doc says how that is established); other targets keep the generic recipe
    (:meth:`supports`).
    """

    name = "matvec-nibbles"

    def __repr__(self) -> str:
        return "NibbleTableRule()"

    def supports(self, cpu: CPUTraits) -> bool:
        return cpu.vector_bits >= 512

    def match(self, blocks: list[Block]) -> NibbleMatch | None:
        found = super().match(blocks)
        return _q4_operands(found) if found is not None else None

    def apply(self, sch: Schedule, found: NibbleMatch, cpu: CPUTraits) -> Schedule:
        func = sch.mod["main"]
        mm = found.matmul
        removed = {b.stmt.name_hint for b in mm.prologue} | {mm.block.name}
        tasks = cpu.cores * _TASKS_PER_CORE if cpu.cores > 1 else 1
        kernel = _row_loop(found, mm.block.output, tasks)
        root = func.body.block
        nests = list(root.body.seq) if isinstance(root.body, tirx.SeqStmt) else [root.body]
        body, placed = [], False
        for nest in nests:
            names = _block_names(nest)
            if not names & removed:
                body.append(nest)
            elif not placed:
                if not names <= removed:  # a nest shared with another block: the generic
                    fallback = super().apply(sch, mm, cpu)  # recipe, labelled as such
                    return Schedule(fallback.mod["main"].with_attr(RULE_ATTR, MatvecRule.name))
                body.append(kernel)
                placed = True
        kept = [buf for buf in root.alloc_buffers
                if not any(buf.same_as(b.output) for b in mm.prologue)]
        new_root = s_tir.SBlock(root.iter_vars, root.reads, root.writes, root.name_hint,
                                body[0] if len(body) == 1 else tirx.SeqStmt(body), root.init,
                                kept, root.match_buffers,
                                root.annotations)
        realize = s_tir.SBlockRealize(func.body.iter_values, func.body.predicate, new_root)
        out = Schedule(func.with_body(realize))
        # what reads the product: its other operands inlined, each block vectorized
        blocks = {b.name: b for b in describe_blocks(out)}
        for side in mm.side:
            out.compute_inline(blocks[side.name].rv)
        for block in mm.epilogue:
            vectorize_innermost(out, out.get_sblock(block.name),
                                cpu.lanes(str(block.output.dtype)))
        return out


# --------------------------------------------------------------------------- recognition


def _q4_operands(found: MatmulMatch) -> NibbleMatch | None:
    """The parameters of a ``q4`` matvec with one row of activations; None otherwise."""
    mm = found.block
    extents = {iv.var: iv.dom.extent for iv in mm.stmt.iter_vars}
    if any(int(extents[v]) != 1 for v in mm.spatial[:-1]) or not mm.spatial[-1].same_as(found.j):
        return None
    made = {b.output for b in found.prologue}
    if any(found.lhs.source.same_as(buf) for buf in made) or not all(b.decode for b in found.prologue):
        return None
    if str(found.lhs.source.dtype) != "float32" or str(mm.output.dtype) != "float32":
        return None
    if not _is_product_sum(mm, found):
        return None
    rows, depth = int(extents[found.j]), int(extents[found.k])
    if depth % GROUP or not all(isinstance(i, tirx.IntImm) and int(i) == 0 or i.same_as(found.k)
                                or any(i.same_as(v) for v in mm.spatial[:-1])
                                for i in found.lhs.indices):
        return None
    params = {}
    for block in found.prologue:
        for load in block.loads:
            if not any(load.source.same_as(buf) for buf in made):
                params[load.source] = None
    data = [b for b in params if str(b.dtype) == "uint8" and _shape(b) == (rows, depth // 2)]
    scale = [b for b in params if str(b.dtype) == "float16"
             and _shape(b) == (rows, depth // GROUP)]
    if len(params) != 2 or len(data) != 1 or len(scale) != 1:
        return None
    if not _decodes_q4(found, data[0], scale[0], rows, depth):
        logger.debug("schedule: a uint8 weight of q4's shapes decodes to something else")
        return None
    return NibbleMatch(found, found.lhs.source, data[0], scale[0], rows, depth)


def _is_product_sum(mm: Block, found: MatmulMatch) -> bool:
    """Whether the update is ``C + A * B``, nothing converted."""
    value = mm.store.value
    if not isinstance(value.a, TensorLoad) or not value.a.source.same_as(mm.output):
        return False
    product = value.b
    if not isinstance(product, tirx.Mul):
        return False
    pair = (product.a, product.b)
    return any(a.same_as(found.lhs) and b.same_as(found.rhs) for a, b in (pair, pair[::-1]))


def _shape(buf: tirx.Buffer) -> tuple | None:
    if not all(isinstance(d, tirx.IntImm) for d in buf.shape):
        return None
    return tuple(int(d) for d in buf.shape)


def _decodes_q4(found: MatmulMatch, data: tirx.Buffer, scale: tirx.Buffer, rows: int,
                depth: int) -> bool:
    """Whether the decoded weight is ``q4``'s value, evaluated on random parts.

    Every offset within a group is checked in the first, the last and one
    middle group, for the first and the last row.
    """
    rng = np.random.default_rng(0)
    values = {data: rng.integers(0, 256, size=(rows, depth // 2), dtype=np.uint8),
              scale: (rng.uniform(0.5, 2.0, size=(rows, depth // GROUP))
                      * rng.choice([-1, 1], size=(rows, depth // GROUP))).astype(np.float16)}
    producers = {b.output: b for b in found.prologue}
    groups = sorted({0, depth // GROUP // 2, depth // GROUP - 1})
    for n in sorted({0, rows - 1}):
        for g in groups:
            for offset in range(GROUP):
                k = g * GROUP + offset
                half, byte = divmod(offset, GROUP // 2)
                nibble = int(values[data][n, g * GROUP // 2 + byte]) >> (4 * half) & 15
                want = np.float32(nibble - 8) * np.float32(values[scale][n, g])
                env = {found.j: n, found.k: k}
                env.update({v: 0 for v in found.block.spatial[:-1]})
                try:
                    got = _evaluate(found.rhs, env, values, producers)
                except (ArithmeticError, IndexError, TypeError, ValueError):
                    return False
                if abs(float(got) - float(want)) > 1e-6 * max(1.0, abs(float(want))):
                    return False
    return True


def _unknown(what) -> ValueError:
    """The error for an expression the evaluator does not know (the decode is not q4's)."""
    return ValueError(f"not evaluated: {what}")


_BINARY = {tirx.Add: operator.add, tirx.Sub: operator.sub, tirx.Mul: operator.mul,
           tirx.FloorDiv: operator.floordiv, tirx.FloorMod: operator.mod,
           tirx.Min: min, tirx.Max: max, tirx.EQ: operator.eq, tirx.NE: operator.ne,
           tirx.LT: operator.lt, tirx.LE: operator.le, tirx.GT: operator.gt,
           tirx.GE: operator.ge, tirx.And: lambda a, b: bool(a) and bool(b),
           tirx.Or: lambda a, b: bool(a) or bool(b), tirx.BitwiseAnd: operator.and_,
           tirx.BitwiseOr: operator.or_, tirx.BitwiseXor: operator.xor,
           tirx.RShift: operator.rshift, tirx.LShift: operator.lshift}


_IF_THEN_ELSE = ("prim.if_then_else", "tirx.if_then_else")


def _dtype(expr) -> str:
    return str(expr.ty)


def _scalar(value, dtype: str):
    if dtype == "bool":
        return bool(value)
    if dtype.startswith(("int", "uint")):
        if dtype in ("int64", "int32"):
            return int(value)
        return np.array(value).astype(dtype)[()]
    if dtype in ("float16", "float32", "float64"):
        return np.array(value).astype(dtype)[()]
    raise _unknown(dtype)


def _evaluate(expr, env: dict, values: dict, producers: dict):
    """The value of a scalar TIR expression of a decode, with numpy's arithmetic.

    ``env`` binds iteration variables, ``values`` holds the parameters' contents
    and ``producers`` the blocks that compute the other buffers read.
    """
    def ev(e):
        if isinstance(e, tirx.IntImm):
            return _scalar(e.value, _dtype(e))
        if isinstance(e, tirx.FloatImm):
            return _scalar(e.value, _dtype(e))
        if isinstance(e, tirx.Var):
            for var, value in env.items():
                if var.same_as(e):
                    return value
            raise _unknown(e)
        if isinstance(e, TensorLoad):
            index = tuple(int(ev(i)) for i in e.indices)
            for buf, array in values.items():
                if buf.same_as(e.source):
                    return array[index]
            for buf, block in producers.items():
                if buf.same_as(e.source):
                    return _produced(block, index, values, producers)
            raise _unknown(e.source)
        if isinstance(e, tirx.Cast):
            return _scalar(ev(e.value), _dtype(e))
        if type(e) in _BINARY:
            return _scalar(_BINARY[type(e)](ev(e.a), ev(e.b)), _dtype(e))
        if isinstance(e, tirx.Not):
            return not ev(e.a)
        if isinstance(e, tirx.Select):
            return ev(e.true_value) if ev(e.condition) else ev(e.false_value)
        if isinstance(e, Call) and getattr(e.op, "name", None) in _IF_THEN_ELSE:
            return ev(e.args[1]) if ev(e.args[0]) else ev(e.args[2])
        raise _unknown(type(e).__name__)

    return ev(expr)


def _produced(block: Block, index: tuple, values: dict, producers: dict):
    """The value ``block`` stores at ``index`` of its output."""
    if block.store is None or len(block.store.indices) != len(index):
        raise _unknown(block.name)
    env = {}
    for position, var in zip(index, block.store.indices):
        if not isinstance(var, tirx.Var):
            raise _unknown(block.name)
        env[var] = position
    return _evaluate(block.store.value, env, values, producers)


# --------------------------------------------------------------------------- the kernel


def _block_names(stmt) -> set[str]:
    names: set[str] = set()
    tvm_ffi.structural_walk(stmt, [(s_tir.SBlock, lambda block: names.add(block.name_hint))])
    return names


def _row_loop(found: NibbleMatch, out: tirx.Buffer, tasks: int) -> tirx.Stmt:
    """``out[.., j] = x . decode(weight row j)`` for every ``j``, in ``tasks`` parallel runs."""
    rows, depth = found.rows, found.depth
    groups, row_bytes = depth // GROUP, depth // 2
    i64 = "int64"
    j = tirx.Var("j", i64)
    acc = tirx.decl_buffer((4 * _LANES,), "float32", "acc", scope="local")
    scales = tirx.decl_buffer((groups,), "float32", "row_scales", scope="local")
    x_prefix = [const(0, i64)] * (len(found.x.shape) - 1)
    out_prefix = [const(0, i64)] * (len(out.shape) - 1)

    def lanes(start, count=_LANES):
        return Ramp(tirx.Cast(i64, start) if not isinstance(start, int) else const(start, i64),
                    const(1, i64), count)

    def loop(var, extent, body, kind=tirx.ForKind.SERIAL):
        return tirx.For(var, const(0, i64), const(extent, i64), kind, body)

    table = Cast("float32x16", Ramp(const(-8, "int32"), const(1, "int32"), _LANES))

    def group(g, slot: int) -> list:
        """Decode group ``g`` into the accumulators ``slot`` and ``slot + 1``."""
        indices = Cast("int32x16", BufferLoad(found.data, [j, lanes(g * (GROUP // 2))]))
        scaled = table * Broadcast(BufferLoad(scales, [g]), _LANES)
        high = tirx.shift_right(indices, Broadcast(const(4, "int32"), _LANES))
        stores = []
        for half, nibbles in enumerate((indices, high)):
            weights = tirx.call_llvm_pure_intrin("float32x16", _PERMUTE, scaled, nibbles)
            into = lanes((slot + half) * _LANES)
            x = BufferLoad(found.x, x_prefix + [lanes(g * GROUP + half * _LANES)])
            stores.append(BufferStore(acc, BufferLoad(acc, [into]) + weights * x, [into]))
        return stores

    body = [BufferStore(acc, Broadcast(const(0.0, "float32"), _LANES), [lanes(u * _LANES)])
             for u in range(4)]
    # the row's scales in float32, once
    io = tirx.Var("io", i64)
    body.append(loop(io, groups // _LANES, BufferStore(
        scales, Cast("float32x16", BufferLoad(found.scale, [j, lanes(io * _LANES)])),
        [lanes(io * _LANES)])))
    for g in range(groups // _LANES * _LANES, groups):
        body.append(BufferStore(scales, Cast("float32", BufferLoad(found.scale, [j, const(g, i64)])),
                                [const(g, i64)]))
    # two groups per iteration, prefetching the bytes _AHEAD further in the weight
    pair = tirx.Var("pair", i64)
    last = const(rows * row_bytes - 1, i64)
    ahead = tirx.min(j * row_bytes + pair * GROUP + _AHEAD, last)
    prefetch = tirx.Evaluate(tirx.call_intrin(
        "void", "tirx.prefetch",
        tirx.address_of(BufferLoad(found.data, [ahead // row_bytes, ahead % row_bytes])), 0, 3, 1))
    body.append(loop(pair, groups // 2, tirx.SeqStmt(
        [prefetch] + group(pair * 2, 0) + group(pair * 2 + 1, 2))))
    if groups % 2:
        body += group(const(groups - 1, i64), 0)
    # the accumulators summed as a tree, then the lanes: halves added until one is left
    vectors = [BufferLoad(acc, [lanes(u * _LANES)]) for u in range(4)]
    body.append(BufferStore(acc, (vectors[0] + vectors[1]) + (vectors[2] + vectors[3]),
                            [lanes(0)]))
    width = _LANES // 2
    while width > 1:
        body.append(BufferStore(acc, BufferLoad(acc, [lanes(0, width)])
                                + BufferLoad(acc, [lanes(width, width)]), [lanes(0, width)]))
        width //= 2
    body.append(BufferStore(out, BufferLoad(acc, [const(0, i64)]) + BufferLoad(acc, [const(1, i64)]),
                            out_prefix + [j]))
    # each task allocates its accumulators once and takes a run of rows (a parallel loop's
    # body is a task of its own: buffers allocated in it would be allocated per row)
    tasks = min(rows, tasks)
    per_task = -(-rows // tasks)
    tasks = -(-rows // per_task)
    task, row = tirx.Var("task", i64), tirx.Var("row", i64)
    one_row = tirx.SeqStmt(body)
    if rows % per_task:
        one_row = tirx.IfThenElse(j < rows, one_row, None)
    runs = loop(row, per_task, tirx.SeqStmt([tirx.Bind(j, task * per_task + row), one_row]))
    # reads and writes are the whole buffers; the block is opaque to the schedule
    block = s_tir.SBlock([], _whole(found.x, found.data, found.scale), _whole(out),
                         "nibble_matvec_rows", runs, alloc_buffers=[acc, scales])
    kind = tirx.ForKind.PARALLEL if tasks > 1 else tirx.ForKind.SERIAL
    return loop(task, tasks, s_tir.SBlockRealize([], const(True, "bool"), block), kind)


def _whole(*buffers: tirx.Buffer) -> list:
    return [tirx.BufferRegion(buf, [Range.from_min_extent(const(0, str(d.ty)), d)
                                    for d in buf.shape]) for buf in buffers]
