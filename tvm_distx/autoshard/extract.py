"""Reading a Relax function into a :class:`~tvm_distx.autoshard.graph.ShardGraph`.

This is the only part of automatic sharding that reads TVM. The module is
first legalized as :func:`tvm_distx.compile` legalizes it, except that attention
and the cache writes stay the operators that compute them
(:func:`tvm_distx.compiler.pipeline.legalize_operators` with ``fuse=False``: the
operator costs know them one by one), so the problem sees the kernels
propagation sees. Each binding of ``main`` becomes a
:class:`~tvm_distx.autoshard.graph.Node` with the labels of its operator rule
(:func:`tvm_distx.passes.op_signatures.op_signature`; for a ``call_tir``, the
kernel's access patterns); an operator with no rule becomes a node with no
labels (it runs replicated, as propagation runs it). Constants are replicated
everywhere and are left out.

Two facts the program does not state are read here: which inputs are
**state** (returned updated, as a key-value cache is: ``ShardGraph.state``),
and the example size of each **symbolic extent** (``sizes``, or the
variable's upper bound), recorded per node as ``Node.dynamic``.
"""

from __future__ import annotations

import logging
from typing import Mapping

from tvm import relax, tirx
import tvm

from tvm_distx import passes  # noqa: F401  (registers the operator rules)
from tvm_distx.autoshard.graph import Node, ShardGraph
from tvm_distx.compiler.pipeline import legalize_operators
from tvm_distx.errors import SymbolicExtentError, UnsupportedProgramError
from tvm_distx.ir import helpers as _ir
from tvm_distx.passes.op_signatures import op_signature

__all__ = ["check_sizes", "extract", "VIEW_OPS", "WRITE_KERNELS"]

logger = logging.getLogger(__name__)

#: Operators that only relabel memory: no arithmetic, no buffer of their own.
VIEW_OPS = frozenset({"relax.reshape", "relax.permute_dims", "relax.expand_dims",
                      "relax.squeeze"})
#: Kernel names (after legalization) of the same layout changes.
VIEW_KERNELS = ("reshape", "transpose", "expand_dims", "squeeze")


class _Sizes:
    """The example value of each symbolic variable of one function, to price the plan at."""

    def __init__(self, func, function: str, sizes: Mapping[str, int] | None) -> None:
        self.function = function
        self.given = dict(sizes or {})
        attrs = func.attrs if func.attrs is not None else {}
        bounds = attrs.get("tir_var_upper_bound") if hasattr(attrs, "get") else None
        self.bounds = {str(k): int(v) for k, v in (bounds or {}).items()}
        self.analyzer = tvm.sym.Analyzer()
        self.bound: dict[str, int] = {}
        self.used: dict[str, int] = {}

    def value(self, extent, var) -> int:

        for free in tirx.analysis.undefined_vars(extent):
            name = str(free.name)
            if name in self.bound:
                continue
            if name in self.given:
                value = int(self.given[name])
            elif name in self.bounds:
                value = self.bounds[name]
                logger.info("auto_shard: %s of %r priced at its upper bound %d (sizes= sets "
                            "it)", name, self.function, value)
            else:
                raise SymbolicExtentError(
                    f"auto_shard: {var.name!r} in {self.function!r} has the run-time extent "
                    f"{name!r}, with no example size and no upper bound",
                    hint=f"give the size to price the plan at: auto_shard(..., "
                    f"sizes={{{name!r}: 128}}); the rules it writes serve every size",
                    cli_hint=f"give the size to price the plan at: --size {name}=128")
            if value < 1:
                raise SymbolicExtentError(
                    f"auto_shard(sizes={{{name!r}: {value}}}): a size must be at least 1",
                    hint=f"sizes={{{name!r}: 128}}",
                    cli_hint=f"--size {name}=128")
            self.bound[name] = value
            self.used[name] = value
            self.analyzer.bind(free, value)
        return int(self.analyzer.simplify(extent))


def _tensor_info(var, function: str, sizes: _Sizes
                 ) -> tuple[tuple[int, ...], str, frozenset[int]] | None:
    """Shape (symbolic extents at their example sizes), dtype and the symbolic dimensions."""
    ty = var.ty
    if not isinstance(ty, relax.TensorType):
        return None
    shape = _ir.static_shape(ty)
    if shape is None:
        return None
    if all(d is not None for d in shape):
        return tuple(int(d) for d in shape), str(ty.dtype), frozenset()
    if not isinstance(ty.shape, relax.ShapeExpr):
        raise SymbolicExtentError(
            f"auto_shard: {var.name!r} in {function!r} has a shape of unknown extents {ty}",
            hint="give the function's tensors shapes, symbolic or static")
    values = list(ty.shape.values)
    dynamic = frozenset(i for i, d in enumerate(shape) if d is None)
    return (tuple(int(d) if d is not None else sizes.value(values[i], var)
                  for i, d in enumerate(shape)), str(ty.dtype), dynamic)


def extract(mod: tvm.IRModule, mesh_shape: tuple[int, ...], function: str = "main", *,
            legalized: bool = False, sizes: Mapping[str, int] | None = None) -> ShardGraph:
    """The sharding problem of ``mod[function]`` on a mesh of ``mesh_shape``.

    With ``legalized`` the module is taken as legalized already
    (:func:`tvm_distx.compiler.pipeline.legalize_operators`, ``fuse=False``). The graph's ``variables`` are the Relax variables of its nodes.

    A symbolic extent (``seq``) is priced at ``sizes[name]``, or at the
    variable's upper bound (the function's ``tir_var_upper_bound``, which
    ``from_torch`` writes from ``torch.export.Dim(max=...)``) when ``sizes``
    does not name it; a node records its symbolic dimensions
    (:attr:`~tvm_distx.autoshard.graph.Node.dynamic`), which no strategy splits
    and no collective moves, so that the plan serves every size.

    Raises
    ------
    UnsupportedProgramError
        When the function has control flow or no dataflow at all.
    SymbolicExtentError
        When a run-time extent has neither a size in ``sizes`` nor an upper bound.
    """

    if not legalized:
        mod = legalize_operators(mod, fuse=False)
    func = mod[function]
    _check_names(func, function, sizes or {})
    known = _Sizes(func, function, sizes)
    variables: list = []
    nodes: list[Node] = []
    ids: dict = {}
    tuples: dict = {}
    num_input = func.attrs.get("num_input") if func.attrs is not None else None
    num_input = len(func.params) if num_input is None else int(num_input)
    for position, param in enumerate(func.params):
        info = _tensor_info(param, function, known)
        if info is None:
            continue
        ids[param] = len(nodes)
        variables.append(param)
        nodes.append(Node(str(param.name), info[0], info[1],
                          "input" if position < num_input else "param", dynamic=info[2]))
    body = func.body
    if not isinstance(body, relax.SeqExpr):
        raise UnsupportedProgramError(f"auto_shard: {function!r} has no binding blocks")
    for block in body.blocks:
        for binding in block.bindings:
            if not isinstance(binding, relax.VarBinding):
                raise UnsupportedProgramError(
                    f"auto_shard: {function!r} binds {binding.var.name!r} by matching a "
                    "shape", hint="plan the function as from_torch exports it")
            var, value = binding.var, binding.value
            if isinstance(value, relax.TupleGetItem) and isinstance(value.tuple_value,
                                                                    relax.Tuple):
                value = value.tuple_value.fields[value.index]  # a field of a literal tuple
            if isinstance(value, relax.Var):
                if value in ids:
                    ids[var] = ids[value]
                if value in tuples:
                    tuples[var] = tuples[value]
                continue
            if isinstance(value, relax.Tuple):  # the results, gathered (gv = lv1, lv2)
                tuples[var] = list(value.fields)
                continue
            if isinstance(value, relax.If):
                raise UnsupportedProgramError(
                    f"auto_shard: {function!r} has control flow at {var.name!r}",
                    hint="plan a function without R.If")
            info = _tensor_info(var, function, known)
            if info is None:
                if not isinstance(value, relax.Call):
                    continue
                info = ((), "float32", frozenset())  # a tuple of results: operands arrive whole
            node = _op_node(value, str(var.name), info, ids, mod, op_signature)
            ids[var] = len(nodes)
            variables.append(var)
            nodes.append(node)
    result = body.body
    fields = list(result.fields) if isinstance(result, relax.Tuple) else \
        tuples.get(result, [result])
    outputs = tuple(ids[f] for f in fields if isinstance(f, relax.Var) and f in ids)
    graph = ShardGraph(nodes, outputs, tuple(int(n) for n in mesh_shape))
    graph.variables = variables
    graph.state = _state(nodes, outputs)
    graph.sizes = dict(known.used)
    if graph.state:
        logger.info("state of %r (returned updated): %s", function,
                    ", ".join(nodes[i].name for i in graph.state))
    return graph


def check_sizes(func, function: str, given) -> None:
    """Before any work: every name of ``sizes`` is a symbolic extent of the function, and
    every symbolic extent of its parameters has a size or an upper bound.

    Raises
    ------
    SymbolicExtentError
    """
    _check_names(func, function, given)
    sizes = _Sizes(func, function, given)
    for param in func.params:
        _tensor_info(param, function, sizes)


def _check_names(func, function: str, given) -> None:
    """Every name of ``sizes`` is a symbolic extent of the function."""
    found = sorted({str(v.name) for v in relax.analysis.defined_symbolic_vars(func)})
    unknown = sorted(set(given) - set(found))
    if unknown:
        raise SymbolicExtentError(
            f"auto_shard(sizes=...): {function!r} has no symbolic extent "
            f"{', '.join(map(repr, unknown))}",
            hint=("its symbolic extents: " + ", ".join(found)) if found else
            f"{function!r} has static shapes only: leave sizes out",
            cli_hint=("its symbolic extents: " + ", ".join(found)) if found else
            f"{function!r} has static shapes only: leave --size out")


def _state(nodes: list[Node], outputs: tuple[int, ...]) -> dict[int, int]:
    """Input -> the result returning its new value (a cache written out of place).

    A returned input is its own new value. Otherwise a result is traced back
    through values of its shape and element type to a write
    (:data:`WRITE_KERNELS`: ``where(written, new, key_0)``, a scatter) that
    takes an input of that shape whole: that input is state, and the result
    its new value. A residual sum of an input is no write: the input stays
    an activation.
    """
    state: dict[int, int] = {out: out for out in outputs if nodes[out].kind == "input"}
    for out in outputs:
        node = nodes[out]
        if node.kind == "input":
            continue
        queue, seen, found = [out], {out}, None
        while queue and found is None:
            current = queue.pop(0)
            same = [o for o in nodes[current].operands if nodes[o].shape == node.shape
                    and nodes[o].dtype == node.dtype and nodes[o].kind != "param"]
            if _is_write(nodes[current].op):
                kept = [o for o in same if nodes[o].kind == "input" and o not in state]
                if kept:  # where(written, new, old) keeps its last operand; a scatter its first
                    found = kept[-1] if _is_write(nodes[current].op, ("where",)) else kept[0]
            for operand in same:
                if operand not in seen:
                    seen.add(operand)
                    queue.append(operand)
        if found is not None:
            state[found] = out
    return state


#: Kernels (and operators) that write some positions of a tensor and keep the others.
WRITE_KERNELS = ("where", "scatter", "scatter_elements", "scatter_nd", "index_put", "cache_write",
                 "dynamic_update_slice", "index_copy", "slice_scatter")


def _is_write(op: str, kinds: tuple[str, ...] = WRITE_KERNELS) -> bool:
    return op.removeprefix("relax.").rstrip("0123456789_") in kinds


def _op_node(value, name: str, info, ids: dict, mod, op_signature) -> Node:
    shape, dtype, dynamic = info
    op = value.op.name if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) \
        else type(value).__name__
    view = op in VIEW_OPS
    if op == "relax.call_tir" and isinstance(value.args[0], tvm.ir.GlobalVar):
        op = str(value.args[0].name_hint)
        view = op.rstrip("0123456789_").endswith(VIEW_KERNELS)
    sig = op_signature(value, mod) if isinstance(value, relax.Call) else None
    if sig is not None and len(sig.output) == 1:
        operands, labels = [], []
        for expr, lab in zip(sig.operands, sig.labels):
            if isinstance(expr, relax.Var) and expr in ids:
                operands.append(ids[expr])
                labels.append(tuple(lab))
            elif isinstance(expr, relax.Var):  # a tensor we do not track
                logger.debug("operand %s of %s is not a tensor of the function; replicated",
                             expr, name)
                break
        else:
            return Node(name, shape, dtype, "op", op, tuple(operands), tuple(labels),
                        tuple(sig.output[0]), frozenset(sig.unshardable), view, dynamic)
    args = list(value.args) if isinstance(value, relax.Call) else []
    if isinstance(value, relax.TupleGetItem):
        args = [value.tuple_value]
    if args and isinstance(args[0], tvm.ir.GlobalVar) and len(args) > 1 and \
            isinstance(args[1], relax.Tuple):
        args = list(args[1].fields)
    operands = [ids[a] for a in args if isinstance(a, relax.Var) and a in ids]
    logger.info("auto_shard: %s (%s) has no sharding rule here; it runs replicated", name, op)
    return Node(name, shape, dtype, "op", op, tuple(operands), dynamic=dynamic)
