"""The ``relax.call_tir`` signature rule: shardable axes from a PrimFunc's access patterns.

:func:`prim_func_signature` reads the ``SBlock`` statements of a destination-passing
``PrimFunc`` and labels its buffer dimensions so that equal labels are one
logical axis (see :mod:`tvm_distx.passes.op_signatures`): a dimension indexed
by exactly one iteration variable is related to that variable, a union-find
over all blocks chains the relations through intermediate buffers, and every
access the analysis cannot prove safe to split (a shifted or strided index, a
partial read, a reduction that is not a linear sum, ...) makes its axis
unshardable. The result is cached per PrimFunc.

This module owns that TIR analysis and registers it as the rule of
``relax.call_tir``; the Relax operator rules are in
:mod:`tvm_distx.passes.relax_op_rules`.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.s_tir.stmt import SBlock, SBlockRealize

from tvm_distx.passes.op_signatures import (Labels, OpSignature, is_tensor, output_types, register_signature,
                            static_int)

__all__ = ["prim_func_signature"]

logger = logging.getLogger(__name__)


#: Values that symbolic extents stand for while the access patterns are read (primes
#: near 2**16: products of three stay far inside int64).
_STAND_INS = (65521, 65519, 65497, 65479, 65449, 65447, 65437, 65423, 65419, 65413)


# --------------------------------------------------------------------------- call_tir
@register_signature("relax.call_tir")
def _call_tir(call: relax.Call, mod: tvm.IRModule) -> OpSignature | None:
    """``call_tir``: the signature of the called PrimFunc's access patterns."""
    callee, args = call.args[0], call.args[1]
    if not isinstance(callee, tvm.ir.GlobalVar) or not isinstance(args, relax.Tuple):
        return None
    try:
        func = mod[callee]
    except Exception:  # noqa: BLE001 - not in the module
        logger.debug("call_tir of %s, which the module does not have", callee.name_hint)
        return None
    if not isinstance(func, tirx.PrimFunc):
        return None
    outputs = output_types(call.ty_args[0]) if len(call.ty_args) else None
    # scalar arguments (an int for a PrimFunc's scalar parameter) are not buffers
    operands = [a for a in args.fields if not isinstance(a.ty, tvm.ir.PrimType)]
    if outputs is None or not all(is_tensor(o) for o in operands):
        return None
    template = prim_func_signature(func, len(operands))
    if template is None:
        return None
    in_labels, out_labels, unshardable = template
    if len(out_labels) != len(outputs):
        return None
    return OpSignature(tuple(operands), in_labels, out_labels, unshardable)


@functools.lru_cache(maxsize=1024)
def prim_func_signature(
    func: tirx.PrimFunc, num_inputs: int
) -> tuple[tuple[Labels, ...], tuple[Labels, ...], frozenset[str]] | None:
    """Labels of a destination-passing-style PrimFunc's buffer parameters.

    Parameters
    ----------
    func : tirx.PrimFunc
        The function; its first ``num_inputs`` buffer parameters are inputs, the
        other buffer parameters outputs.
    num_inputs : int
        How many buffer parameters are inputs.

    Returns
    -------
    tuple or None
        ``(input_labels, output_labels, unshardable)``, or None when the
        function cannot be analysed.

    Notes
    -----
    Every ``SBlock`` relates each buffer dimension indexed by exactly one of
    its iteration variables to that variable; a union-find over all blocks
    turns the relations into labels, chaining through intermediate buffers.
    A class of related dims is unshardable when any member is unsafe: a dim
    indexed by anything other than a bare iteration variable (``i + 1``,
    ``i // 2``, a constant), an iteration variable used outside an index or
    whose domain differs from the dim's extent, a spatial variable missing from
    the block's write, a buffer used other than by loads and stores, or a
    class holding two dims of one buffer. A class with reduction variables is
    shardable (as a reduction label) only when every such block is a sum
    (``init`` zero, ``W[I] = W[I] + e``) whose result reaches the outputs
    through linear scaling only; it is unshardable if it reaches an output dim.
    """
    try:
        return _PrimFuncAnalysis(func, num_inputs).run()
    except Exception:  # noqa: BLE001 - unknown IR shapes: no signature
        logger.debug("call_tir analysis failed", exc_info=True)
        return None


_normalize_to_iter_sum = tvm.sym.iter_affine_map.normalize_to_iter_sum
_WALK_SKIP = tvm_ffi.WalkResult.SKIP
_DATA_PAR = int(tirx.IterVar.DataPar)
_COMM_REDUCE = int(tirx.IterVar.CommReduce)


def _is_buffer(value) -> bool:
    return tirx.is_buffer_var(value)


def _is_zero(expr) -> bool:
    return isinstance(expr, (tirx.IntImm, tirx.FloatImm)) and float(expr.value) == 0.0


def _is_float(expr) -> bool:
    ty = getattr(expr, "ty", None)
    dtype = getattr(ty, "dtype", None)
    return dtype is not None and str(dtype).startswith(("float", "bfloat"))


def _has_load(expr) -> bool:
    found = []
    tvm_ffi.structural_walk(expr, [(tvm.ir.TensorLoad, lambda _: found.append(True))])
    return bool(found)


@dataclass
class _BlockInfo:
    """What one SBlock does, as seen by the analysis.

    An iteration variable ``v`` appears in an index as a *major* part (``v``
    itself, or ``v // L`` covering all of ``v``: the dim is ``v``'s extent / L
    and sharding ``v`` in p contiguous pieces shards the dim the same way) or
    as a *minor* part (``v % m``, ``v // l % e``, or a non-leading term of a
    fused index ``u * s + v``), which only keeps its meaning on a shard of
    ``v`` when the shard size is a multiple of ``l * e``.
    """

    block: SBlock | None
    iter_nodes: list = field(default_factory=list)  # node per iteration variable
    iter_types: list[int] = field(default_factory=list)
    dom_map: dict = field(default_factory=dict)  # iteration Var -> Range
    loads: list = field(default_factory=list)  # buffer indices read
    stores: list = field(default_factory=list)  # buffer indices written
    majors: dict = field(default_factory=dict)  # node -> set of L of single-part majors
    fused: list = field(default_factory=list)  # nodes leading a fused index
    minors: list = field(default_factory=list)  # (node, l * e)
    store_major: list = field(default_factory=list)  # per store: nodes it indexes by (major)
    store_any: list = field(default_factory=list)  # per store: nodes in its indices at all


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict = {}

    def find(self, node):
        self.parent.setdefault(node, node)
        root = node
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[node] != root:
            self.parent[node], node = root, self.parent[node]
        return root

    def union(self, a, b) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra


class _PrimFuncAnalysis:
    """Union-find over (buffer, dim) and (block, iteration variable) nodes.

    Buffers are identified by their position in :attr:`buffers` (parameters
    first), so nodes are plain hashable tuples: ``("b", buffer_index, dim)``
    and ``("v", block_index, var_index)``.
    """

    def __init__(self, func: tirx.PrimFunc, num_inputs: int) -> None:
        self.func = func
        self.params = [p for p in func.params if _is_buffer(p)]
        self.num_inputs = num_inputs
        self.buffers: list = []
        self.buffer_index: dict = {}
        for p in self.params:
            self._buffer(p)
        self.uf = _UnionFind()
        self.unsafe: set = set()
        self.blocks: list[_BlockInfo] = []
        self.iter_var_node: dict = {}  # iteration Var -> node
        self.escaped: set[int] = set()  # buffers used other than by loads/stores
        self.loose: set[int] = set()  # buffers accessed outside any block
        self.analyzer = tvm.sym.Analyzer()
        self._bind_extents()

    def _bind_extents(self) -> None:
        """Every symbolic extent of the buffers stands for a distinct large prime.

        A legalized reshape over a run-time extent ``s`` indexes with
        ``((h * s + i) // s) % 4``, which folds to ``h`` only when the analyzer
        can compare ``i`` with ``s``; it cannot for a symbol. With ``s`` bound
        to a large prime, the analyzer folds the index exactly as it does for
        a static extent, and a prime folds nothing that holds only for some
        sizes (it divides no other extent, so no spurious fusion appears).
        """
        free = []
        for p in self.params:
            for dim in self.buffers[self.buffer_index[p]].ty.shape:
                if isinstance(dim, tvm.ir.Var) and not any(dim.same_as(f) for f in free):
                    free.append(dim)
        for dim, value in zip(free, _STAND_INS):
            self.analyzer.bind(dim, tirx.IntImm(str(dim.ty.dtype), value))

    # -- buffers
    def _buffer(self, var) -> int:
        index = self.buffer_index.get(var)
        if index is None:
            index = len(self.buffers)
            self.buffers.append(var)
            self.buffer_index[var] = index
        return index

    def _shape(self, index: int) -> list:
        return list(self.buffers[index].ty.shape)

    def _dim_node(self, index: int, dim: int):
        node = ("b", index, dim)
        self.uf.find(node)
        return node

    # -- walking
    def run(self):
        if self.num_inputs > len(self.params) or self.num_inputs < 0:
            return None
        self._walk(self.func.body, None)
        if not any(info.iter_nodes for info in self.blocks):
            return None  # no schedulable block: nothing learnt
        self._finish_blocks()
        return self._labels()

    def _walk(self, node, block: _BlockInfo | None) -> None:
        def on_realize(realize):
            if not (isinstance(realize.predicate, tirx.IntImm) and int(realize.predicate.value) == 1):
                self._walk(realize.predicate, block)
                self._block(realize.block, safe=False)
            else:
                self._block(realize.block, safe=True)
            for value in realize.iter_values:
                self._walk(value, block)
            return _WALK_SKIP

        def on_block(blk):  # an SBlock outside an SBlockRealize
            self._block(blk, safe=False)
            return _WALK_SKIP

        def on_load(load):
            self._access(load.source, list(load.indices), block, store=False)
            return _WALK_SKIP

        def on_store(store):
            self._access(store.buffer, list(store.indices), block, store=True)
            self._walk(store.value, block)
            return _WALK_SKIP

        def on_alloc(alloc):
            self._buffer(alloc.buffer)
            return _WALK_SKIP

        def on_var(var):
            self._other_use(var)
            return _WALK_SKIP

        tvm_ffi.structural_walk(
            node,
            [
                (SBlockRealize, on_realize),
                (SBlock, on_block),
                (tvm.ir.TensorLoad, on_load),
                (tirx.BufferStore, on_store),
                (tirx.AllocBuffer, on_alloc),
                (tvm.ir.Var, on_var),
            ],
            order="pre",
        )

    def _other_use(self, var) -> None:
        """A variable used outside an index position."""
        node = self.iter_var_node.get(var)
        if node is not None:
            self.unsafe.add(node)
        elif _is_buffer(var):
            self.escaped.add(self._buffer(var))

    def _block(self, blk: SBlock, safe: bool) -> None:
        info = _BlockInfo(blk)
        bid = len(self.blocks)
        self.blocks.append(info)
        for k, iv in enumerate(blk.iter_vars):
            node = ("v", bid, k)
            self.uf.find(node)
            info.iter_nodes.append(node)
            info.iter_types.append(int(iv.iter_type))
            self.iter_var_node[iv.var] = node
            info.dom_map[iv.var] = iv.dom
            try:  # the ranges let ``v % extent`` simplify to ``v``
                self.analyzer.bind(iv.var, iv.dom)
            except Exception:  # noqa: BLE001 - an unbindable range only loses precision
                logger.debug("cannot bind the range of %s", iv.var)
            if not safe or int(iv.iter_type) not in (_DATA_PAR, _COMM_REDUCE):
                self.unsafe.add(node)
            if static_int(iv.dom.min) != 0:
                self.unsafe.add(node)
        for alloc in blk.alloc_buffers:
            self._buffer(alloc)
        for match in blk.match_buffers:
            self.escaped.add(self._buffer(match.buffer))
            self._walk(match.source, info)  # the source buffer var escapes
        if blk.init is not None:
            self._walk(blk.init, info)
        self._walk(blk.body, info)

    def _iter_dom(self, node):
        _, bid, k = node
        return self.blocks[bid].block.iter_vars[k].dom

    def _access(self, var, indices: list, block: _BlockInfo | None, store: bool) -> None:
        index = self._buffer(var)
        shape = self._shape(index)
        if block is None:
            self.loose.add(index)
        else:
            (block.stores if store else block.loads).append(index)
        nodes = [self._dim_node(index, d) for d in range(len(shape))]
        major: set = set()
        anywhere: set = set()
        if store and block is not None:
            block.store_major.append(major)
            block.store_any.append(anywhere)
        if len(indices) != len(shape) or block is None:
            self.unsafe.update(nodes)
            for expr in indices:
                self._walk(expr, block)
            return
        for d, expr in enumerate(indices):
            simple = self._simplify(expr)
            node = self.iter_var_node.get(simple) if isinstance(simple, tvm.ir.Var) else None
            if node is not None and node in block.iter_nodes:  # a bare variable
                self.uf.union(nodes[d], node)
                if not self._equal(self._iter_dom(node).extent, shape[d]):
                    self.unsafe.add(nodes[d])
                    self.unsafe.add(node)
                block.majors.setdefault(node, set()).add(1)
                major.add(node)
                anywhere.add(node)
                continue
            parts = None if _has_load(expr) else self._affine_parts(simple, block)
            if not parts:  # a constant, a load, or not affine in this block's variables
                self.unsafe.add(nodes[d])
                # every iteration variable the index really uses becomes unsafe
                self._walk(expr if _has_load(expr) else simple, block)
                continue
            anywhere.update(p[0] for p in parts)
            if not self._is_mixed_radix(parts, shape[d]):
                self.unsafe.add(nodes[d])
                self.unsafe.update(p[0] for p in parts)
                continue
            lead, lower, extent, _ = parts[0]
            if lower * extent == self._number(self._iter_dom(lead).extent):
                self.uf.union(nodes[d], lead)
                major.add(lead)
                if len(parts) == 1:
                    block.majors.setdefault(lead, set()).add(lower)
                elif lower == 1:
                    block.fused.append(lead)
                else:
                    self.unsafe.add(nodes[d])
                    self.unsafe.add(lead)
            else:
                self.unsafe.add(nodes[d])
                block.minors.append((lead, lower * extent))
            for node, lower, extent, _ in parts[1:]:
                block.minors.append((node, lower * extent))

    def _affine_parts(self, expr, block: _BlockInfo) -> list | None:
        """``expr`` as ``sum(((v // lower) % extent) * scale)`` over this block's variables.

        Returns ``[(node, lower, extent, scale), ...]`` by decreasing scale, ``[]``
        for a constant, None when ``expr`` has another form (an offset, other
        variables, symbolic factors).
        """
        if not block.dom_map:
            return None
        try:
            iter_sum = _normalize_to_iter_sum(expr, block.dom_map, self.analyzer)
        except Exception:  # noqa: BLE001 - not an affine index
            return None
        if static_int(iter_sum.base) != 0:
            return None
        parts = []
        for split in iter_sum.args:
            source = split.source.source
            node = self.iter_var_node.get(source) if isinstance(source, tvm.ir.Var) else None
            numbers = [self._number(split.lower_factor), self._number(split.extent),
                       self._number(split.scale)]
            if node is None or node not in block.iter_nodes or None in numbers:
                return None
            parts.append((node, *numbers))
        parts.sort(key=lambda p: -p[3])
        return parts

    def _number(self, expr) -> int | None:
        """``expr`` as an int, a symbolic extent counted as its stand-in; None otherwise.

        A reshape that merges or splits a run-time extent ``s`` with a static one
        (``(4, s, 64) -> (4 * s, 64)``, experts by tokens) reads ``v // s`` over a
        range of ``4 * s``: its factors and extents are the stand-ins' products,
        compared as numbers as a static reshape's are.
        """
        number = static_int(expr)
        if number is None and isinstance(expr, tvm.ir.Expr):
            try:
                number = static_int(self.analyzer.simplify(expr))
            except Exception:  # noqa: BLE001 - not simplifiable: not a number
                return None
        return number

    def _is_mixed_radix(self, parts: list, dim_extent) -> bool:
        """The parts tile ``[0, dim_extent)`` exactly, like the digits of a number."""
        extent = self._number(dim_extent)
        if extent is None or parts[-1][3] != 1:
            return False
        for (_, _, _, scale), (_, _, inner_extent, inner_scale) in zip(parts, parts[1:]):
            if scale != inner_scale * inner_extent:
                return False
        return parts[0][3] * parts[0][2] == extent

    def _simplify(self, expr):
        """``expr`` simplified with the known iteration ranges (itself on failure)."""
        if isinstance(expr, (tvm.ir.Var, tirx.IntImm)):
            return expr
        try:
            return self.analyzer.simplify(expr)
        except Exception:  # noqa: BLE001 - not simplifiable: keep it as written
            return expr

    def _equal(self, a, b) -> bool:
        sa, sb = static_int(a), static_int(b)
        if sa is not None and sb is not None:
            return sa == sb
        if tvm_ffi.structural_equal(a, b):
            return True
        try:
            return bool(self.analyzer.can_prove_equal(a, b))
        except Exception:  # noqa: BLE001 - dtype mismatch and the like
            return False

    # -- after the walk
    def _finish_blocks(self) -> None:
        for info in self.blocks:
            for node, kind in zip(info.iter_nodes, info.iter_types):
                written = [node in indexed for indexed in info.store_major]
                if kind == _DATA_PAR and not (written and all(written)):
                    self.unsafe.add(node)  # a store that does not depend on it: no sharding
                if kind == _COMM_REDUCE and any(node in indexed for indexed in info.store_any):
                    self.unsafe.add(node)
            # A minor part ``v // l % e`` reads the same on a shard of ``v`` only when
            # the shard size is a multiple of ``l * e``. A shard of ``v`` is a multiple
            # of every L of its majors (the solver divides each related dim, whose
            # extent is extent(v) / L), so ``l * e`` must divide the largest L.
            for node, period in info.minors:
                factors = info.majors.get(node)
                if not factors or max(factors) % period:
                    self.unsafe.add(node)
            # A fused index ``v * s + ...`` stays aligned only when shards of ``v``
            # divide extent(v): some dim related to ``v`` must have that extent.
            for node in info.fused:
                if 1 not in info.majors.get(node, set()):
                    self.unsafe.add(node)
        for index in self.escaped:
            for d in range(len(self._shape(index))):
                self.unsafe.add(self._dim_node(index, d))

    def _classes(self) -> dict:
        classes: dict = {}
        for node in list(self.uf.parent):
            classes.setdefault(self.uf.find(node), []).append(node)
        return classes

    def _labels(self):
        outputs = set(range(self.num_inputs, len(self.params)))
        classes = self._classes()
        unsafe_roots = set()
        for root, members in classes.items():
            dims_of = [n[1] for n in members if n[0] == "b"]
            vars_of = [n[1] for n in members if n[0] == "v"]
            reduce_nodes = [n for n in members
                            if n[0] == "v" and self.blocks[n[1]].iter_types[n[2]] == _COMM_REDUCE]
            if (any(n in self.unsafe for n in members)
                    or len(dims_of) != len(set(dims_of))
                    or len(vars_of) != len(set(vars_of))):
                unsafe_roots.add(root)
                continue
            in_output = any(b in outputs for b in dims_of)
            if reduce_nodes:
                if in_output or not self._partial_sum_ok(reduce_nodes, outputs):
                    unsafe_roots.add(root)
            elif not in_output:
                unsafe_roots.add(root)  # an input axis the outputs do not depend on
        # name the classes in order of first appearance over the parameters
        names: dict = {}
        unshardable: set[str] = set()
        counter = [0]

        def fresh() -> str:
            label = f"d{counter[0]}"
            counter[0] += 1
            return label

        per_param = []
        for index in range(len(self.params)):
            labels = []
            for d in range(len(self._shape(index))):
                root = self.uf.find(("b", index, d))
                label = names.get(root)
                if label is None:
                    label = names[root] = fresh()
                    if root in unsafe_roots:
                        unshardable.add(label)
                if label in labels:  # cannot happen for a safe class
                    label = fresh()
                    unshardable.add(label)
                labels.append(label)
            per_param.append(tuple(labels))
        return (
            tuple(per_param[: self.num_inputs]),
            tuple(per_param[self.num_inputs:]),
            frozenset(unshardable),
        )

    # -- partial sums
    def _partial_sum_ok(self, reduce_nodes: list, outputs: set[int]) -> bool:
        """Whether sharding the reduction in these blocks gives a partial sum of the outputs."""
        writers: dict[int, set[int]] = {}
        readers: dict[int, set[int]] = {}
        for bid, info in enumerate(self.blocks):
            for b in info.stores:
                writers.setdefault(b, set()).add(bid)
            for b in info.loads:
                readers.setdefault(b, set()).add(bid)
        pending = []
        for node in reduce_nodes:
            bid = node[1]
            target = self._sum_target(bid)
            if target is None:
                return False
            pending.append((target, bid))
        seen = set()
        while pending:
            buffer, writer = pending.pop()
            if (buffer, writer) in seen:
                continue
            seen.add((buffer, writer))
            if (buffer in self.escaped or buffer in self.loose
                    or writers.get(buffer, set()) != {writer}):
                return False
            # a partial buffer may only be scaled into other partial buffers (an
            # output, or an intermediate that is itself only scaled or dead)
            for reader in readers.get(buffer, set()) - {writer}:
                target = self._scale_target(reader, buffer)
                if target is None:
                    return False
                pending.append((target, reader))
        return True

    def _sum_target(self, bid: int) -> int | None:
        """The buffer a block sums into (``init`` 0, ``W[I] = W[I] + e``), else None."""
        blk = self.blocks[bid].block
        body, init = blk.body, blk.init
        if not isinstance(body, tirx.BufferStore) or not isinstance(init, tirx.BufferStore):
            return None
        if not init.buffer.same_as(body.buffer) or not _is_zero(init.value):
            return None
        if not tvm_ffi.structural_equal(list(init.indices), list(body.indices)):
            return None
        value = body.value
        if not isinstance(value, tirx.Add):
            return None
        for acc, other in ((value.a, value.b), (value.b, value.a)):
            if (isinstance(acc, tvm.ir.TensorLoad) and acc.source.same_as(body.buffer)
                    and tvm_ffi.structural_equal(list(acc.indices), list(body.indices))
                    and not self._loads_buffer(other, body.buffer)):
                return self.buffer_index.get(body.buffer)
        return None

    def _scale_target(self, bid: int, source: int) -> int | None:
        """The buffer a spatial block writes as ``c * source[I]`` (c free of loads), else None."""
        info = self.blocks[bid]
        blk = info.block
        if blk is None or blk.init is not None or _COMM_REDUCE in info.iter_types:
            return None
        body = blk.body
        if not isinstance(body, tirx.BufferStore):
            return None
        if info.loads.count(source) != 1 or len(info.loads) != 1:
            return None
        if not self._linear_in_load(body.value):
            return None
        return self.buffer_index.get(body.buffer)

    def _linear_in_load(self, expr) -> bool:
        """``expr`` is ``load``, ``load * c``, ``c * load``, float ``load / c`` or a float cast.

        Integer division and casts to or from integers truncate, so a sum of
        their partial results differs from the result of the sum.
        """
        if isinstance(expr, tvm.ir.TensorLoad):
            return True
        if isinstance(expr, tirx.Cast):
            return (_is_float(expr) and _is_float(expr.value)
                    and self._linear_in_load(expr.value))
        if isinstance(expr, tirx.Mul):
            if not _has_load(expr.b):
                return self._linear_in_load(expr.a)
            if not _has_load(expr.a):
                return self._linear_in_load(expr.b)
            return False
        if isinstance(expr, tirx.Div):
            return _is_float(expr) and not _has_load(expr.b) and self._linear_in_load(expr.a)
        return False

    @staticmethod
    def _loads_buffer(expr, buffer) -> bool:
        found = []

        def on_load(load):
            if load.source.same_as(buffer):
                found.append(True)

        tvm_ffi.structural_walk(expr, [(tvm.ir.TensorLoad, on_load)])
        return bool(found)
