"""A model's structure as the plans read it: its linears, their heads, and each weight's role.

:class:`ModelGraph` reads one dataflow function of a module as
:func:`tvm_distx.from_torch` imports it (before ``LegalizeOps``): its bindings,
their users, and every *linear* (a ``matmul`` of an activation with a weight
parameter, with an optional bias). The plans of this package ask it which
linears write a residual branch, which read a block's input, and which are cut
into attention heads; :class:`WeightRole` is the answer they record for each
weight. It is pure analysis: nothing here changes the module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import tvm
from tvm import relax

from tvm_distx.ir import helpers as _ir

__all__ = ["LinearSite", "ModelGraph", "WeightRole", "attention_heads", "linear_outputs",
           "tied_weights", "ELEMENTWISE"]

#: Operators computed feature by feature. A chain of them between two linears (an MLP's
#: nonlinearity, a gated MLP's product) keeps each rank's share of the features.
ELEMENTWISE = frozenset(f"relax.{name}" for name in (
    "nn.relu", "nn.gelu", "nn.gelu_tanh", "nn.silu", "nn.leakyrelu", "nn.softplus", "nn.selu",
    "sigmoid", "tanh", "exp", "erf", "sqrt", "rsqrt", "square", "negative", "abs", "clip",
    "astype", "add", "subtract", "multiply", "divide", "power", "maximum", "minimum"))


@dataclass(frozen=True)
class WeightRole:
    """What the plan does with one weight.

    Attributes
    ----------
    param : str
        The parameter of ``main``.
    role : str
        ``"column"``, ``"row"``, ``"lm_head"``, ``"vocab"`` (a vocabulary-parallel
        embedding table, or its offsets) or ``"replicated"``.
    axis : int or None
        The weight axis split on the model mesh axis (None when replicated).
    reason : str
        Why, in one line.
    bias : bool
        Whether the parameter is a linear's bias (or a table's offsets).
    lookup : bool
        Whether the weight is a vocabulary-parallel embedding table (an LM head
        tied to one too): its lookups cost one all-reduce each.
    found : bool
        False for a weight kept whole because the plan found no block around it
        (its structure was not recognised): a split the plan may be missing.
        True for every weight whose role the plan chose, whole by design included.
    nbytes : int
        The weight's bytes.
    """

    param: str
    role: str
    axis: int | None
    reason: str
    bias: bool = False
    lookup: bool = False
    found: bool = True
    nbytes: int = 0


@dataclass
class LinearSite:
    """A matmul of an activation with a weight parameter (internal, holds IR)."""

    weight: str
    out_axis: int       # the weight axis of the output features
    bias: str | None
    source: relax.Expr  # the activation operand
    result: relax.Var   # after the bias
    matmul: relax.Var   # the matmul itself


class ModelGraph:
    """Bindings, users and linears of one dataflow function."""

    def __init__(self, func: relax.Function) -> None:
        self.func = func
        self.params = {p.name: p for p in func.params}
        self.value: dict = {}
        self.users: dict = {}
        for block in func.body.blocks:
            for binding in block.bindings:
                self.value[binding.var] = binding.value
                for operand in _ir.operand_vars(binding.value):
                    self.users.setdefault(operand, []).append(binding.var)
        self.outputs = set(_ir.operand_vars(func.body.body)) | {func.body.body}
        self.linears: dict = {}  # matmul var (and bias-add var) -> LinearSite
        for var, value in self.value.items():
            linear = self._linear(var, value)
            if linear is not None:
                self.linears[linear.result] = linear

    def _param_name(self, expr) -> str | None:
        if isinstance(expr, relax.Var) and expr.name in self.params and \
                self.params[expr.name].same_as(expr) and _ir.static_shape(expr.ty) and \
                len(_ir.static_shape(expr.ty)) == 2:
            return expr.name
        return None

    def is_bias(self, expr) -> bool:
        """A 1-D parameter (a bias)."""
        return isinstance(expr, relax.Var) and expr.name in self.params and \
            len(_ir.static_shape(expr.ty) or ()) == 1

    def only_used_by(self, param: str, linear: LinearSite) -> bool:
        """Whether the weight ``param`` feeds nothing but ``linear`` (it is not tied)."""
        users = self.users.get(self.params[param], [])
        matmul = linear.matmul
        return all(u.same_as(matmul) or (
            _ir.is_call_to(self.value[u], "relax.permute_dims") and
            [v.same_as(matmul) for v in self.users.get(u, [])] == [True]) for u in users)

    def _linear(self, var, value) -> LinearSite | None:
        if not _ir.is_call_to(value, "relax.matmul"):
            return None
        source, other = value.args
        weight, out_axis = self._param_name(other), 1
        if weight is None and isinstance(other, relax.Var) and \
                _ir.is_call_to(self.value.get(other), "relax.permute_dims"):
            transpose = self.value[other]
            axes = transpose.attrs.axes
            if axes is None or [int(a) for a in axes] == [1, 0]:
                weight, out_axis = self._param_name(transpose.args[0]), 0
        if weight is None:
            return None
        result, bias = var, None
        users = self.users.get(var, [])
        if len(users) == 1 and _ir.is_call_to(self.value[users[0]], "relax.add"):
            add = self.value[users[0]]
            other_operand = add.args[1] if add.args[0].same_as(var) else add.args[0]
            name = (other_operand.name if isinstance(other_operand, relax.Var) and
                    other_operand.name in self.params else None)
            if name is not None and len(_ir.static_shape(other_operand.ty) or ()) == 1:
                result, bias = users[0], name
        return LinearSite(weight, out_axis, bias, source, result, var)

    def is_output_projection(self, linear: LinearSite) -> bool:
        """Whether the linear's result is the function's output.

        Through layout operators and elementwise ones of that result alone
        (a final logit softcap, ``tanh(x / c) * c``): they commute with the
        gather of a vocabulary split.
        """
        region, frontier = {linear.result}, [linear.result]
        while frontier:
            node = frontier.pop()
            if node in self.outputs:
                return True
            for user in self.users.get(node, []):
                if user in self.outputs:  # a tuple of the outputs holds it, say
                    return True
                value = self.value[user]
                inputs = [v for v in _ir.operand_vars(value) if v not in self.params.values()]
                if user in region or not isinstance(value, (relax.Call, relax.Var)) or \
                        _ir.is_call_to(value, "relax.matmul") or \
                        any(v not in region for v in inputs):
                    continue
                region.add(user)
                frontier.append(user)
        return False

    def residual_add(self, var, limit: int = 64) -> relax.Var | None:
        """The ``add`` that joins ``var`` (a linear's result) to the residual stream, or None.

        The branch from ``var`` to that add may hold layout changes, scalings,
        casts, a norm, a softcap or dropout: anything but another product. Every
        value of the branch must lead only to the add (nothing else reads the
        branch, and it is not an output), and the add's other operand is an
        activation computed without ``var`` (not a bias, not a constant).
        A partial sum entering the branch is completed at the first operation
        that is not linear (propagation puts the all-reduce there); one add,
        one all-reduce.
        """
        region, frontier, found, steps = {var}, [var], None, 0
        while frontier:
            node = frontier.pop(0)
            if node in self.outputs:
                return None
            for user in self.users.get(node, []):
                if user in region or user is found:
                    continue
                steps += 1
                value = self.value[user]
                if steps > limit or _ir.is_call_to(value, "relax.matmul"):
                    return None
                if _ir.is_call_to(value, "relax.add") and len(value.args) == 2:
                    inside = [a for a in value.args if isinstance(a, relax.Var) and a in region]
                    other = [a for a in value.args if not (isinstance(a, relax.Var)
                                                            and a in region)]
                    if len(inside) == 1 and len(other) == 1 and \
                            isinstance(other[0], relax.Var) and not self.is_bias(other[0]):
                        if found is not None:
                            return None
                        found = user
                        continue
                region.add(user)
                frontier.append(user)
        return found

    def elementwise_columns(self, row: LinearSite) -> list[LinearSite] | None:
        """The linears whose results reach ``row``'s input through elementwise operators only.

        ``relu(x @ A) @ B`` (an MLP whose result is not added to a residual
        stream: a function's output, or the next block's input), or a gated MLP's
        ``(silu(x @ G) * (x @ U)) @ D``: every value on the way is computed feature
        by feature (:data:`ELEMENTWISE`) from linears' results, scalars and
        constants, and nothing but that way reads it. Split on their output
        features, those linears and the elementwise work run on each rank's share,
        and ``row``, split on its input features, ends the block with one
        all-reduce. None when the walk meets anything else.
        """
        found, region, stack = [], set(), [row.source]
        while stack:
            node = stack.pop()
            if not isinstance(node, relax.Var) or node in region:
                continue
            if node in self.linears:
                region.add(node)
                if self.linears[node].matmul.same_as(row.matmul):
                    return None
                found.append(self.linears[node])
                continue
            value = self.value.get(node)
            if value is None:  # a parameter: a scalar is fine, an activation ends the chain
                if _ir.static_shape(node.ty) == ():
                    continue
                return None
            if not isinstance(value, relax.Call) or _ir.operator_name(value) not in ELEMENTWISE:
                return None
            region.add(node)
            stack.extend(a for a in value.args if isinstance(a, relax.Var))
        for node in region:  # read by nothing but the chain and row
            if node in self.outputs or any(u not in region and not u.same_as(row.matmul)
                                           for u in self.users.get(node, [])):
                return None
        return found or None

    def forward_to(self, var, stop, limit: int = 32) -> relax.Var | None:
        """The first value downstream of ``var`` for which ``stop`` holds, before any product.

        Walks every use, breadth first, through any operator but a ``matmul``:
        layout changes, casts, elementwise operations and a norm (OLMo2
        normalises its queries over all heads before it cuts them into heads).
        None when no such value comes within ``limit`` bindings.
        """
        region, frontier, steps = {var}, [var], 0
        while frontier:
            node = frontier.pop(0)
            for user in self.users.get(node, []):
                if user in region:
                    continue
                value = self.value[user]
                if stop(user, value):
                    return user
                steps += 1
                if steps > limit or _ir.is_call_to(value, "relax.matmul"):
                    continue
                region.add(user)
                frontier.append(user)
        return None

    def reaches(self, var, op_name: str, depth: int = 6) -> bool:
        """Whether a call to ``op_name`` uses ``var`` within ``depth`` bindings downstream."""
        frontier, seen = [var], set()
        for _ in range(depth):
            following = []
            for node in frontier:
                for user in self.users.get(node, []):
                    if user in seen:
                        continue
                    seen.add(user)
                    if _ir.is_call_to(self.value[user], op_name):
                        return True
                    following.append(user)
            frontier = following
        return False

    def linears_behind(self, expr) -> list[LinearSite]:
        """The linears reached walking back from ``expr`` without crossing a linear."""
        found, stack, seen = [], [expr], set()
        while stack:
            node = stack.pop()
            if not isinstance(node, relax.Var) or node in seen:
                continue
            seen.add(node)
            if node in self.linears:
                found.append(self.linears[node])
                continue
            value = self.value.get(node)
            if value is not None:
                stack.extend(_ir.operand_vars(value))
        return found

    def heads_of(self, linear: LinearSite) -> tuple[int, int] | None:
        """``(heads, head_dim)`` if the linear's result is reshaped to them, else None.

        The heads reshape is the first one downstream (:meth:`forward_to`) that cuts
        the last axis of what it reshapes in two, ``(..., width) -> (...,
        heads, head_dim)`` (or in three, BLOOM's fused ``(..., heads, 3, head_dim)``:
        its heads then count ``3 * head_dim`` features each), the leading axes holding the same elements in any
        arrangement (multi-head latent attention reshapes ``(batch, 1, seq,
        width)`` to ``(batch, seq, heads, head_dim)``). A reshape that keeps
        the last axis (unflattening ``(tokens, width)`` to ``(batch, seq,
        width)``, whose leading extents may be 1 when one token is decoded) is
        passed.
        """
        def cut(user, value) -> int:
            """How many axes the reshape cuts the last axis into (0: not a heads reshape)."""
            if not _ir.is_call_to(value, "relax.reshape"):
                return 0
            src, dst = _ir.static_shape(value.args[0].ty), _ir.static_shape(user.ty)
            if src is None or dst is None or src[-1] is None:
                return 0
            for parts in (2, 3):  # (heads, head_dim), or BLOOM's (heads, 3, head_dim)
                if len(dst) < parts or None in dst[-parts:] or dst[-1] == src[-1] or \
                        math.prod(dst[-parts:]) != src[-1]:
                    continue
                if None in (*src[:-1], *dst[:-parts]):  # a symbolic token count
                    if len(dst) == len(src) + parts - 1:
                        return parts
                elif math.prod(dst[:-parts]) == math.prod(src[:-1]):
                    return parts
            return 0

        found = self.forward_to(linear.result, lambda user, value: cut(user, value) > 0)
        if found is None:
            return None
        dst = _ir.static_shape(found.ty)
        parts = cut(found, self.value[found])
        return dst[-parts], math.prod(dst[-parts + 1:])


def attention_heads(mod: tvm.IRModule,
                    function: str = "main") -> dict[str, tuple[int, str | None]]:
    """Every linear whose result is reshaped into heads: weight -> ``(heads, bias)``.

    Read from the graph (the reshape to ``(..., heads, head_dim)``), as
    :func:`tensor_parallel` reads it; other plans ask it which projections
    cannot be split by whole heads.
    """
    graph = ModelGraph(mod[function])
    out = {}
    for linear in graph.linears.values():
        heads = graph.heads_of(linear)
        if heads is not None:
            out[linear.weight] = (heads[0], linear.bias)
    return out


def tied_weights(mod: tvm.IRModule, function: str = "main") -> set[str]:
    """The linears' weights that something else reads too (an LM head tied to the embedding).

    :func:`tensor_parallel` keeps such a weight whole, and :func:`tvm_distx.plans.presets.from_hf`
    asks it which splits of transformers' plan to drop.
    """
    graph = ModelGraph(mod[function])
    return {linear.weight for linear in graph.linears.values()
            if not graph.only_used_by(linear.weight, linear)}


def linear_outputs(mod: tvm.IRModule, function: str = "main") -> dict[str, str]:
    """Every linear's weight -> the name of its matmul's result (names survive lowering)."""
    graph = ModelGraph(mod[function])
    return {linear.weight: linear.matmul.name for linear in graph.linears.values()}
