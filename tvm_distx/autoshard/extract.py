"""Reading a Relax function into a :class:`~tvm_distx.autoshard.graph.ShardGraph`.

This is the only part of automatic sharding that reads TVM. The module is
first legalized as :func:`tvm_distx.compile` legalizes it
(:func:`tvm_distx.pipeline.legalize_ops`), so the problem sees the kernels
propagation sees. Each binding of ``main`` becomes a
:class:`~tvm_distx.autoshard.graph.Node` with the labels of its operator rule
(:func:`tvm_distx.passes.op_signatures.op_signature`; for a ``call_tir``, the
kernel's access patterns); an operator with no rule becomes a node with no
labels (it runs replicated, as propagation runs it). Constants are replicated
everywhere and are left out.
"""

from __future__ import annotations

import logging

import tvm
from tvm import relax

from .. import _ir
from ..errors import SymbolicExtentError, UnsupportedProgramError
from .graph import Node, ShardGraph

__all__ = ["extract", "VIEW_OPS", "WRITE_KERNELS"]

logger = logging.getLogger(__name__)

#: Operators that only relabel memory: no arithmetic, no buffer of their own.
VIEW_OPS = frozenset({"relax.reshape", "relax.permute_dims", "relax.expand_dims",
                      "relax.squeeze"})
#: Kernel names (after legalization) of the same layout changes.
VIEW_KERNELS = ("reshape", "transpose", "expand_dims", "squeeze")


def _tensor_info(var, function: str) -> tuple[tuple[int, ...], str] | None:
    ty = var.ty
    if not isinstance(ty, relax.TensorType):
        return None
    shape = _ir.static_shape(ty)
    if shape is None:
        return None
    if any(d is None for d in shape):
        raise SymbolicExtentError(
            f"auto_shard: {var.name!r} in {function!r} has a run-time extent {ty}",
            hint="plan with a static example shape (from_torch without dynamic_shapes); the "
            "rules it writes serve every size")
    return tuple(int(d) for d in shape), str(ty.dtype)


def extract(mod: tvm.IRModule, mesh_shape: tuple[int, ...], function: str = "main", *,
            legalized: bool = False) -> ShardGraph:
    """The sharding problem of ``mod[function]`` on a mesh of ``mesh_shape``.

    With ``legalized`` the module is taken as :func:`tvm_distx.pipeline.legalize_ops`
    left it. The graph's ``variables`` are the Relax variables of its nodes.

    Raises
    ------
    UnsupportedProgramError
        When the function has control flow or no dataflow at all.
    SymbolicExtentError
        When a tensor has a run-time extent.
    """
    from .. import passes  # noqa: F401  (registers the operator rules)
    from ..passes.op_signatures import op_signature
    from ..pipeline import legalize_ops

    if not legalized:
        mod = legalize_ops(mod)
    func = mod[function]
    variables: list = []
    nodes: list[Node] = []
    ids: dict = {}
    tuples: dict = {}
    num_input = func.attrs.get("num_input") if func.attrs is not None else None
    num_input = len(func.params) if num_input is None else int(num_input)
    for position, param in enumerate(func.params):
        info = _tensor_info(param, function)
        if info is None:
            continue
        ids[param] = len(nodes)
        variables.append(param)
        nodes.append(Node(str(param.name), info[0], info[1],
                          "input" if position < num_input else "param"))
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
            info = _tensor_info(var, function)
            if info is None:
                if not isinstance(value, relax.Call):
                    continue
                info = ((), "float32")  # a tuple of results: its operands arrive whole
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
    if graph.state:
        logger.info("state of %r (returned updated): %s", function,
                    ", ".join(nodes[i].name for i in graph.state))
    return graph


def _state(nodes: list[Node], outputs: tuple[int, ...]) -> dict[int, int]:
    """Input -> the result returning its new value (a cache written out of place).

    A returned input is its own new value. Otherwise a result is traced back
    through values of its shape and element type to a write
    (:data:`WRITE_KERNELS`: ``where(written, new, key_0)``, a scatter) that
    takes an input of that shape whole: that input is state, and the result
    its new value. A residual sum of an input is no write: the input stays
    an activation.
    """
    state: dict[int, int] = {}
    for out in outputs:
        node = nodes[out]
        if node.kind == "input":
            state.setdefault(out, out)
            continue
        queue, seen, found = [out], {out}, None
        while queue and found is None:
            current = queue.pop(0)
            same = [o for o in nodes[current].operands if nodes[o].shape == node.shape
                    and nodes[o].dtype == node.dtype and nodes[o].kind != "param"]
            if _is_write(nodes[current].op):
                found = next((o for o in same if nodes[o].kind == "input" and o not in state),
                             None)
            for operand in same:
                if operand not in seen:
                    seen.add(operand)
                    queue.append(operand)
        if found is not None:
            state[found] = out
    return state


#: Kernels (and operators) that write some positions of a tensor and keep the others.
WRITE_KERNELS = ("where", "scatter", "scatter_elements", "scatter_nd", "index_put",
                 "dynamic_update_slice", "index_copy", "slice_scatter")


def _is_write(op: str) -> bool:
    return op.removeprefix("relax.").rstrip("0123456789_") in WRITE_KERNELS


def _op_node(value, name: str, info, ids: dict, mod, op_signature) -> Node:
    shape, dtype = info
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
                        tuple(sig.output[0]), frozenset(sig.unshardable), view)
    args = list(value.args) if isinstance(value, relax.Call) else []
    if isinstance(value, relax.TupleGetItem):
        args = [value.tuple_value]
    if args and isinstance(args[0], tvm.ir.GlobalVar) and len(args) > 1 and \
            isinstance(args[1], relax.Tuple):
        args = list(args[1].fields)
    operands = [ids[a] for a in args if isinstance(a, relax.Var) and a in ids]
    logger.info("auto_shard: %s (%s) has no sharding rule here; it runs replicated", name, op)
    return Node(name, shape, dtype, "op", op, tuple(operands))
