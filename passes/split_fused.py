"""``SplitFusedProjections``: one weight parameter per segment of a fused projection.

A fused projection computes several projections with one matmul and cuts the
result apart afterwards: GPT-2's ``c_attn`` (q|k|v, a Conv1D weight stored
``(in, 3H)``), a gate|up MLP projection (``(2I, H)`` for ``nn.Linear``),
transformers' fused expert tensors (``(E, 2I, H)``). Split evenly across
ranks, such a weight puts a rank boundary inside a segment, and every layer
then gathers the result to cut it. This pass rewrites::

    lv  = R.matmul(x, R.permute_dims(W))        W: (2I, H)
    lv1 = R.add(lv, b)                          b: (2I,)
    s   = R.split(lv1, 2, axis=-1)
    g, u = s[0], s[1]

into one matmul per segment, each with its own parameters::

    g = R.add(R.matmul(x, R.permute_dims(W_seg0)), b_seg0)      W_seg0: (I, H)
    u = R.add(R.matmul(x, R.permute_dims(W_seg1)), b_seg1)

so the split disappears and each segment's weight can be split across the
ranks like any column-parallel weight: every rank gets its slice of every
segment, and nothing is gathered. The module stays plain Relax (DistIR).

What is recognised (from the graph, never from names)
-----------------------------------------------------
* A ``R.split`` along the last axis, or ``R.strided_slice`` calls (unit
  stride) along the last axis that together cover it, consuming a value that
  is produced by ``matmul``, optionally followed by one bias ``add`` and by
  reshapes that keep the last axis (GPT-2's ``addmm`` + ``view``).
* Slices on the heads axis of a reshape that cuts the features into
  ``(..., heads, head_dim)``: Falcon's multi-query ``view(b, s, heads + 2, d)``
  read as ``[..., :-2, :]``, ``[..., [-2], :]`` and ``[..., [-1], :]`` (a
  ``take`` of constant consecutive indices counts as a slice). Heads
  ``[lo, hi)`` are the features ``[lo * d, hi * d)``, and each segment is
  reshaped into its own heads, so its query heads split like any others while
  the one key/value head stays whole.
* The matmul's weight operand (and the bias) is a parameter of the function,
  possibly through ``permute_dims``, ``take`` or ``strided_slice`` on other
  axes (an expert picked out of a 3-D tensor).
* Every intermediate value has no other use, and the weight and the bias are
  read by such sites only, all cut alike (a fused expert tensor read once per
  expert is cut once): the fused weight disappears entirely. Only weights (the
  parameters after the function's ``num_input`` inputs; every parameter when
  it has no ``num_input``) of public functions are rewritten.

How a new parameter is cut from the user's weight is recorded as plain data
(:class:`tvm_distx.layout.derived.DerivedParam`) in the module attribute
:data:`ATTR` (see :func:`derivations_of`); ``tvm_distx.compile`` carries it to
the executable, which applies it to the weights given to ``run`` and
``export``, so users pass the weights as they have them.
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax
import tvm_ffi
from tvm.relax.expr_functor import PyExprMutator, mutator

from tvm_distx.ir import helpers as _ir
from tvm_distx.ir.module_pass import module_pass
from tvm_distx.layout.derived import DerivedParam, Derivations

__all__ = ["ATTR", "SplitFusedProjections", "derivations_of"]

logger = logging.getLogger(__name__)

#: The module attribute holding the derived parameters: a JSON string mapping
#: each public function's name to ``Derivations.to_json()``.
ATTR = "tvm_distx.derived_params"


def derivations_of(mod: tvm.IRModule) -> dict[str, Derivations]:
    """The derived parameters recorded in ``mod``, by public function name (empty if none)."""
    attrs = mod.attrs
    if attrs is None or ATTR not in attrs:
        return {}
    data = json.loads(str(attrs[ATTR]))
    return {name: Derivations.from_json(items) for name, items in data.items()}


# --------------------------------------------------------------------------- analysis
@dataclass
class _ParamPath:
    """A function parameter and the single-use calls that lead from it to an operand."""

    param: relax.Var
    user: relax.Var  # the binding that reads the parameter
    axis: int  # the parameter's axis that becomes the operand's feature axis
    steps: list[relax.Call]  # from the parameter outwards; each step's args[0] is the previous
    vars: list[relax.Var]  # the variables the steps are bound to


@dataclass
class _Site:
    """One fused projection: matmul -> [add bias] -> [reshapes] -> split into segments."""

    anchor: relax.Var  # the binding at which the segments are emitted
    bounds: list[tuple[int, int]]  # the segments on the feature axis
    consumers: dict[int, list[relax.Var]]  # segment -> the variables that held it
    matmul: relax.Call
    matmul_var: relax.Var
    weight: _ParamPath
    chain: list[tuple[relax.Var, relax.Call]]  # after the matmul, in program order
    bias: _ParamPath | None = None
    bias_first: bool = False  # the bias is the add's first operand
    dead: set[relax.Var] = field(default_factory=set)  # bindings not emitted again
    # cut by heads: the reshape of the features into (..., heads, head_dim) the
    # consumers slice on axis ``heads[0]``, and its shape (see _Analysis._heads_site)
    heads: tuple[int, list[int]] | None = None


class _Analysis:
    """Bindings and uses of one function, and the fused projections in it."""

    def __init__(self, func: relax.Function) -> None:
        self.func = func
        self.bound: dict[relax.Var, relax.Expr] = {}
        self.uses: dict[relax.Var, list[relax.Var | None]] = {}
        for block in func.body.blocks:
            for binding in block.bindings:
                value = binding.value if isinstance(binding, relax.VarBinding) else None
                if value is not None:
                    self.bound[binding.var] = value
                self._count(binding.value, binding.var)
        self._count(func.body.body, None)
        attrs = func.attrs or {}
        count = int(attrs["num_input"]) if "num_input" in attrs else 0
        self.weights = set(func.params[count:])

    def _count(self, expr: relax.Expr, user: relax.Var | None) -> None:
        def visit(e):
            if isinstance(e, relax.Var):
                self.uses.setdefault(e, []).append(user)

        relax.analysis.post_order_visit(expr, visit)

    def only_use(self, var: relax.Expr, user: relax.Var) -> bool:
        return isinstance(var, relax.Var) and self.uses.get(var, []) == [user]

    # -- sites ------------------------------------------------------------------
    def sites(self) -> list[_Site]:
        found, taken = [], set()
        for var, value in self.bound.items():
            site = None
            if _ir.is_call_to(value, "relax.split"):
                site = self._split_site(var, value)
            elif (_ir.is_call_to(value, "relax.strided_slice") or _constant_take(value)) \
                    and value.args[0] not in taken:
                site = self._slice_site(value.args[0])
                if site is not None:
                    taken.add(value.args[0])
            if site is not None:
                found.append(site)
        return self._consistent(found)

    def _consistent(self, sites: list[_Site]) -> list[_Site]:
        """The sites whose weights are read by these sites only, all cut alike.

        A fused parameter read by several sites (one fused expert tensor, each
        expert picked out of it by ``take``) is split once, so every one of its
        uses must be such a site, with the same segments on the same axis.
        """
        while True:
            reads: dict[relax.Var, list[tuple[_Site, _ParamPath]]] = {}
            for site in sites:
                for path in (site.weight, site.bias):
                    if path is not None:
                        reads.setdefault(path.param, []).append((site, path))
            bad = set()
            for param, items in reads.items():
                users = Counter(self.uses.get(param, []))
                cuts = {(path.axis, tuple(site.bounds)) for site, path in items}
                if users != Counter(path.user for _, path in items) or len(cuts) > 1:
                    bad |= {id(site) for site, _ in items}
            if not bad:
                return sites
            logger.debug("fused projections left whole: their weights have other uses or "
                         "are cut differently (%d site(s))", len(bad))
            sites = [site for site in sites if id(site) not in bad]

    def _split_site(self, var: relax.Var, call: relax.Call) -> _Site | None:
        source = call.args[0]
        extent = self._last_extent(source, int(call.attrs.axis))
        if extent is None or not self.only_use(source, var):
            return None
        sections = call.attrs.indices_or_sections
        if isinstance(sections, tvm.tirx.IntImm):
            k = int(sections.value)
            if k < 2 or extent % k:
                return None
            cuts = [extent * i // k for i in range(k + 1)]
        else:
            cuts = [0, *(int(i) for i in sections), extent]
        bounds = list(zip(cuts[:-1], cuts[1:]))
        if any(a >= b for a, b in bounds):
            return None
        consumers: dict[int, list[relax.Var]] = {}
        for user in self.uses.get(var, []):
            item = self.bound.get(user)
            if not isinstance(item, relax.TupleGetItem) or not item.tuple_value.same_as(var):
                return None  # the tuple itself escapes
            consumers.setdefault(int(item.index), []).append(user)
        return self._site(source, var, bounds, consumers, dead={var})

    def _slice_site(self, source: relax.Expr) -> _Site | None:
        """Slices of ``source`` on one axis that together cover it: on the last axis (the
        features), or on the heads axis of a reshape of the features (:meth:`_heads_site`)."""
        if not isinstance(source, relax.Var):
            return None
        shape = _ir.static_shape(source.ty)
        users = self.uses.get(source, [])
        if not shape or None in users or len(users) < 2:
            return None
        ranges: dict[tuple[int, int], list[relax.Var]] = {}
        axes = set()
        for user in users:
            cut = _axis_range(self.bound.get(user), shape)
            if cut is None:
                return None
            axes.add(cut[0])
            ranges.setdefault(cut[1:], []).append(user)
        if len(axes) != 1:
            return None  # slices on several axes
        axis, bounds = axes.pop(), sorted(ranges)
        if bounds[0][0] != 0 or bounds[-1][1] != shape[axis] or any(
                a[1] != b[0] for a, b in zip(bounds, bounds[1:])):
            return None  # not a partition of the axis
        first = next(u for u in self.bound if u in set(users))
        consumers = {i: ranges[b] for i, b in enumerate(bounds)}
        if axis == len(shape) - 1:
            return self._site(source, first, bounds, consumers, dead=set(users))
        return self._heads_site(source, axis, first, bounds, consumers, set(users))

    def _heads_site(self, source, axis, first, bounds, consumers, users) -> _Site | None:
        """Falcon's multi-query ``fused.view(b, s, heads + 2, d)[..., :-2, :]``, ``[[-2]]``,
        ``[[-1]]``: slices on the heads axis of a reshape that splits the features
        into ``(heads, d)``. Heads ``[lo, hi)`` are features ``[lo * d, hi * d)``."""
        reshape = self.bound.get(source)
        if not _ir.is_call_to(reshape, "relax.reshape") or not isinstance(reshape.args[1],
                                                                           relax.ShapeExpr):
            return None
        features = reshape.args[0]
        dims, before = list(reshape.args[1].values), _ir.static_shape(features.ty)
        trailing = _ir.static_shape(source.ty)[axis:]
        if not before or before[-1] is None or None in trailing or \
                not self.only_use(features, source):
            return None
        inner = math.prod(trailing[1:])
        leading = list(features.ty.shape.values)[:-1]
        same_leading = len(leading) == axis and all(
            tvm_ffi.structural_equal(a, b) for a, b in zip(leading, dims))
        if not same_leading or before[-1] != trailing[0] * inner:
            return None  # the reshape does more than cut the features into heads
        site = self._site(features, first, [(lo * inner, hi * inner) for lo, hi in bounds],
                          consumers, dead=users | {source})
        if site is not None:
            site.heads = (axis, dims)
        return site

    def _last_extent(self, value: relax.Expr, axis: int) -> int | None:
        shape = _ir.static_shape(value.ty)
        if not shape or axis % len(shape) != len(shape) - 1:
            return None
        return shape[-1]

    def _site(self, source, anchor, bounds, consumers, dead) -> _Site | None:
        """Walk from the split value back to its matmul; None unless the whole chain fits."""
        chain: list[tuple[relax.Var, relax.Call]] = []
        bias, bias_first = None, False
        value = source
        extent = bounds[-1][1]
        while True:
            call = self.bound.get(value)
            if not isinstance(call, relax.Call) or not isinstance(call.op, tvm.ir.Op):
                return None
            if _ir.is_call_to(call, "relax.matmul"):
                shape = _ir.static_shape(call.args[1].ty)
                if not shape or len(shape) < 2 or shape[-1] != extent:
                    return None  # the weight's last axis must be the output features
                weight = self._param_path(call.args[1], value, -1)
                if weight is None:
                    return None
                chain.reverse()
                site = _Site(anchor, bounds, consumers, call, value, weight, chain, bias,
                             bias_first)
                site.dead = dead | {value} | {v for v, _ in chain} | set(weight.vars)
                site.dead |= set(bias.vars) if bias else set()
                return site
            if _ir.is_call_to(call, "relax.reshape"):
                inner = call.args[0]
                shape = _ir.static_shape(inner.ty)
                if not shape or shape[-1] != extent or not isinstance(call.args[1],
                                                                       relax.ShapeExpr):
                    return None
            elif _ir.is_call_to(call, "relax.add") and bias is None:
                inner = None
                for first in (True, False):
                    cand, other = (call.args[0], call.args[1]) if first else call.args[1::-1]
                    path = self._bias_path(cand, value, extent, len(_ir.static_shape(value.ty)))
                    if path is not None and isinstance(other, relax.Var):
                        bias, bias_first, inner = path, first, other
                        break
                if inner is None:
                    return None
            else:
                return None
            chain.append((value, call))
            if not self.only_use(inner, value):
                return None
            value = inner

    def _bias_path(self, operand, user, extent: int, out_rank: int) -> _ParamPath | None:
        shape = _ir.static_shape(operand.ty)
        if not shape or shape[-1] != extent or len(shape) > out_rank or any(
                d != 1 for d in shape[:-1]):
            return None
        return self._param_path(operand, user, -1)

    def _param_path(self, operand, user, axis: int) -> _ParamPath | None:
        """The weight parameter behind ``operand``, whose ``axis`` is the feature axis."""
        steps, vars_ = [], []
        value = operand
        rank = len(_ir.static_shape(operand.ty) or ())
        if rank == 0:
            return None
        axis %= rank
        while True:
            if value in self.weights:  # its other uses are checked by _consistent
                if None in (_ir.static_shape(value.ty) or (None,)):
                    return None  # a weight with a run-time extent cannot be cut here
                steps.reverse()
                vars_.reverse()
                return _ParamPath(value, user, axis, steps, vars_)
            if not self.only_use(value, user):
                return None
            call = self.bound.get(value)
            if not isinstance(call, relax.Call):
                return None
            inner = call.args[0]
            inner_rank = len(_ir.static_shape(inner.ty) or ())
            if _ir.is_call_to(call, "relax.permute_dims"):
                axes = call.attrs.axes
                axis = (inner_rank - 1 - axis) if axes is None else int(axes[axis])
            elif _ir.is_call_to(call, "relax.take"):
                taken = int(call.attrs.axis) % inner_rank
                index_rank = rank - inner_rank + 1  # the output has the index's axes there
                if taken <= axis < taken + index_rank:
                    return None
                axis = axis if axis < taken else axis - index_rank + 1
            elif _ir.is_call_to(call, "relax.strided_slice"):
                sliced = _ints(call.args[1])
                if sliced is None or axis in {a % inner_rank for a in sliced}:
                    return None
            else:
                return None
            steps.append(call)
            vars_.append(value)
            user, value, rank = value, inner, inner_rank


# --------------------------------------------------------------------------- rewrite
@mutator
class _Splitter(PyExprMutator):
    """Emit each site's segments at its anchor and drop the fused bindings."""

    def __init__(self, mod: tvm.IRModule, sites: list[_Site],
                 segment_params: dict[int, dict[str, list[relax.Var]]]) -> None:
        super().__init__(mod)
        self.anchors = {s.anchor: (i, s) for i, s in enumerate(sites)}
        self.dead = set().union(*(s.dead for s in sites)) - set(self.anchors)
        self.dead |= {v for s in sites for vs in s.consumers.values() for v in vs}
        self.params = segment_params

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        site = self.anchors.get(binding.var)
        if site is not None:
            self._emit_segments(*site)
        elif binding.var not in self.dead:
            super().visit_var_binding_(binding)

    def _emit_segments(self, index: int, site: _Site) -> None:
        params = self.params[index]
        x = self.visit_expr(site.matmul.args[0])
        for j, (lo, hi) in enumerate(site.bounds):
            holders = site.consumers.get(j)
            if not holders:
                continue  # a segment nobody reads
            tag = f"seg{j}"
            weight = self._along(site.weight, params["weight"][j], tag)
            bias = self._along(site.bias, params["bias"][j], tag) if site.bias else None
            value = relax.Call(site.matmul.op, [x, weight], site.matmul.attrs,
                               site.matmul.ty_args)
            name = f"{site.matmul_var.name}_{tag}"
            for var, call in site.chain:
                value = self._emit(value, name)
                if _ir.is_call_to(call, "relax.add"):
                    args = [bias, value] if site.bias_first else [value, bias]
                else:  # a reshape keeping the feature axis last
                    dims = list(call.args[1].values)
                    args = [value, relax.ShapeExpr(dims[:-1] + [_int64(hi - lo)])]
                value = relax.Call(call.op, args, call.attrs, call.ty_args)
                name = f"{var.name}_{tag}"
            if site.heads is not None:  # back into (..., heads, head_dim), this segment's heads
                axis, dims = site.heads
                inner = math.prod(int(d) for d in dims[axis + 1:])
                dims = [*dims[:axis], _int64((hi - lo) // inner), *dims[axis + 1:]]
                value = relax.op.reshape(self._emit(value, name), dims)
            self._bind(holders, value)

    def _along(self, path: _ParamPath, param: relax.Var, tag: str) -> relax.Expr:
        value = param
        for call, var in zip(path.steps, path.vars):
            rest = [self.visit_expr(a) for a in call.args[1:]]
            value = self._emit(relax.Call(call.op, [value, *rest], call.attrs, call.ty_args),
                               f"{var.name}_{tag}")
        return value

    def _emit(self, expr: relax.Expr, name: str) -> relax.Var:
        return self.builder_.emit(expr, name_hint=name)

    def _bind(self, holders: list[relax.Var], value: relax.Call) -> None:
        """Bind the segment to the first variable that held it; the others alias it."""
        first = holders[0]
        self.builder_.emit_normalized(relax.VarBinding(first, self.builder_.normalize(value)))
        for other in holders[1:]:
            self.set_var_remap(other.vid, first)


@module_pass(name="tvm_distx.SplitFusedProjections")
class SplitFusedProjections:
    """Give each segment of a fused projection its own weight parameter.

    See the module documentation for what is recognised. Run it on the
    imported module, before annotating (presets run it inside ``apply``).
    The new parameters take the fused parameter's place in the signature and
    are named ``<weight>_seg<j>`` (``<bias>_seg<j>``); how each is cut from the
    user's weight is recorded in the module attribute :data:`ATTR`, read back
    by :func:`derivations_of`. The pass is idempotent.

    Examples
    --------
    >>> mod = SplitFusedProjections()(mod)                # doctest: +SKIP
    >>> derivations_of(mod)["main"].bind(weights)          # doctest: +SKIP
    """

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        recorded = derivations_of(mod)
        updated = mod
        for gv, func in _ir.relax_functions(mod):
            if func.attrs is None or "global_symbol" not in func.attrs:
                continue  # a private function's parameters are not the user's weights
            if any(_ir.dtensor_sharding(p.ty) is not None for p in func.params):
                logger.debug("%s already has DTensor parameters: left as it is", gv.name_hint)
                continue  # propagated already: run this pass before annotating
            sites = _Analysis(func).sites()
            if not sites:
                continue
            new_func, derived = _rewrite(mod, func, sites)
            if updated is mod:
                updated = mod.clone()
            updated[gv] = new_func
            name = gv.name_hint
            recorded[name] = recorded.get(name, Derivations()).merged(derived)
            logger.info("%s: %d fused projection(s) split into %d parameters", name,
                        len(sites), len(derived))
        if updated is mod:
            return mod
        text = json.dumps({name: d.to_json() for name, d in recorded.items() if d})
        return updated.with_attr(ATTR, text)


def _rewrite(mod: tvm.IRModule, func: relax.Function,
             sites: list[_Site]) -> tuple[relax.Function, list[DerivedParam]]:
    taken = {p.name for p in func.params}
    replaced: dict[relax.Var, list[relax.Var]] = {}
    derived: list[DerivedParam] = []
    per_site: dict[int, dict[str, list[relax.Var]]] = {}

    def segments(path: _ParamPath, bounds) -> list[relax.Var]:
        param = path.param
        if param in replaced:  # a fused tensor read by several sites is cut once
            return replaced[param]
        shape = _ir.static_shape(param.ty)
        out = []
        for j, (lo, hi) in enumerate(bounds):
            name = _fresh(f"{param.name}_seg{j}", taken)
            dims = [_int64(d) for d in shape]
            dims[path.axis] = _int64(hi - lo)
            out.append(relax.Var(name, relax.TensorType(dims, param.ty.dtype)))
            derived.append(DerivedParam(name, param.name, shape, path.axis, lo, hi))
        replaced[param] = out
        return out

    for index, site in enumerate(sites):
        per_site[index] = {"weight": segments(site.weight, site.bounds)}
        if site.bias is not None:
            per_site[index]["bias"] = segments(site.bias, site.bounds)
    body = _Splitter(mod, sites, per_site).visit_expr(func)
    params = [q for p in func.params for q in replaced.get(p, [p])]
    new = relax.Function(params, body.body, body.ret_ty, body.is_pure, body.attrs, body.span)
    return new, derived


def _constant_take(call) -> bool:
    """Whether ``call`` is a ``take`` of constant indices (a list of ints in ``forward``)."""
    return _ir.is_call_to(call, "relax.take") and isinstance(call.args[1], tvm.ir.Constant)


def _axis_range(call, shape: list[int]) -> tuple[int, int, int] | None:
    """``(axis, lo, hi)`` when ``call`` keeps ``[lo, hi)`` of one axis of a value of
    ``shape``: a unit-stride ``strided_slice`` with static bounds, or a ``take`` of
    consecutive constant indices."""
    rank = len(shape)
    axis = None
    if _constant_take(call):
        values = call.args[1].value.numpy()
        axis = int(call.attrs.axis) % rank
        if shape[axis] is None or values.ndim != 1 or not values.size or values[0] < 0 or \
                (values != values[0] + np.arange(values.size)).any() or \
                values[-1] >= shape[axis]:
            return None
        return axis, int(values[0]), int(values[-1]) + 1
    if not _ir.is_call_to(call, "relax.strided_slice") or len(call.args) < 4:
        return None
    axes, begin, end = (_ints(a) for a in call.args[1:4])
    strides = _ints(call.args[4]) if len(call.args) > 4 else [1]
    if None in (axes, begin, end, strides) or len(axes) != 1 or strides != [1]:
        return None  # symbolic bounds, several axes, a stride
    axis = axes[0] % rank
    extent = shape[axis]
    if extent is None:
        return None
    lo, hi = (b + extent if b < 0 else b for b in (begin[0], end[0]))
    lo, hi = max(lo, 0), min(hi, extent)
    return (axis, lo, hi) if 0 <= lo < hi else None


def _ints(expr: relax.Expr) -> list[int] | None:
    """The integers of a shape or tuple argument (``strided_slice``'s axes and bounds).

    None when one of them is symbolic.
    """
    items = expr.values if isinstance(expr, relax.ShapeExpr) else getattr(expr, "fields", None)
    if items is None:
        return None
    out = []
    for item in items:
        if not isinstance(item, tvm.tirx.IntImm):  # a PrimValue wrapping an integer
            item = getattr(item, "value", None)
        if not isinstance(item, tvm.tirx.IntImm):
            return None
        out.append(int(item.value))
    return out


def _int64(value: int) -> tvm.tirx.IntImm:
    return tvm.tirx.IntImm("int64", value)


def _fresh(name: str, taken: set[str]) -> str:
    out, n = name, 1
    while out in taken:
        out, n = f"{name}_{n}", n + 1
    taken.add(out)
    return out
