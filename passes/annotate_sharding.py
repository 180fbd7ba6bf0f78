"""``AnnotateSharding``: insert ``R.dist.annotate_sharding`` calls from rules.

Users of TVM's DistIR write ``R.dist.annotate_sharding`` by hand in TVMScript.
A module imported from a frontend has no place to write them, so this pass
inserts them from :class:`tvm_distx.ShardingRule` objects.

The pass works in two phases, in the style of TVM's own Python passes:

1. :class:`_SiteCollector` (a ``PyExprVisitor``) walks every Relax function in
   program order and records the bindings each rule matches, and the
   annotations the module already has. From these, :func:`_plan` decides what to
   insert, assigns meshes (cycling a rule's ``meshes`` over its sites),
   validates every placement against its mesh and tensor, and detects
   conflicts.
2. :class:`_Rewriter` (a ``PyExprMutator``) applies the plan.

The IR it writes, for an argument, a result and a parameter::

    x_ann = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="R")
    y_raw = cls.mlp(x_ann, A, B)
    y = R.dist.annotate_sharding(y_raw, device_mesh="mesh[0]", placement="S[0]")

and, for a parameter ``A``, a first binding block ``A_ann = annotate_sharding(A,
...)`` whose result replaces ``A`` everywhere in the function. The result
annotation keeps the original variable for the annotated value, so every later
use, dataflow outputs included, sees the annotated value.

The pass is idempotent: a value that already carries the requested annotation
(or already has that ``R.DTensor`` type) is left alone, and a different one is a
:class:`tvm_distx.errors.ShardingConflictError`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, PyExprVisitor, mutator, visitor

from tvm_distx.ir import helpers as _ir
from tvm_distx.ir.module_pass import module_pass
from tvm_distx.errors import (
    ArgumentTypeError,
    ShardingConflictError,
    ShardingError,
    UnknownMeshError,
    UnmatchedRuleError,
    UnsupportedValueError,
)
from tvm_distx.layout.mesh import DeviceMesh, resolve_mesh
from tvm_distx.layout import MeshTable, Placement
from tvm_distx.layout.rules import ShardingRule

__all__ = ["AnnotateSharding"]

logger = logging.getLogger(__name__)

_ANNOTATE = "relax.dist.annotate_sharding"


@dataclass(frozen=True)
class _Sharding:
    """One requested annotation: a mesh, a placement and the rule that asked."""

    mesh: DeviceMesh
    tvm_mesh: object = field(compare=False)
    placement: Placement
    rule: ShardingRule | None = field(compare=False, default=None)

    def same_as(self, mesh: DeviceMesh, placement: Placement) -> bool:
        return (self.mesh.shape, self.mesh.device_range, self.placement) == (
            mesh.shape,
            mesh.device_range,
            placement,
        )

    def describe(self) -> str:
        return f'"{self.placement}" on mesh {self.mesh.describe()}'


@dataclass
class _CallEdit:
    """What to insert around one call binding."""

    args: dict[int, _Sharding] = field(default_factory=dict)
    result: _Sharding | None = None


# --------------------------------------------------------------------------- phase 1
@visitor
class _SiteCollector(PyExprVisitor):
    """Collect the call bindings of one function and its existing annotations."""

    def __init__(self) -> None:
        self.calls: list[relax.VarBinding] = []
        # annotation variable -> (annotated value, mesh, placement)
        self.annotation_of: dict[relax.Var, tuple[relax.Expr, DeviceMesh, Placement]] = {}
        # annotated value -> [(mesh, placement)]
        self.annotations_on: dict[relax.Var, list[tuple[DeviceMesh, Placement]]] = {}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = binding.value
        if _ir.is_call_to(value, _ANNOTATE):
            mesh = DeviceMesh.from_tvm(value.attrs.device_mesh)
            placement = Placement.from_tvm(value.attrs.placement)
            source = value.args[0]
            self.annotation_of[binding.var] = (source, mesh, placement)
            if isinstance(source, relax.Var):
                self.annotations_on.setdefault(source, []).append((mesh, placement))
        elif isinstance(value, relax.Call):
            self.calls.append(binding)
        super().visit_var_binding_(binding)


class _Planner:
    """Turn rules into a per-binding plan, validating every site."""

    def __init__(self, mod: tvm.IRModule, rules: Sequence[ShardingRule]) -> None:
        self.mod = mod
        self.rules = list(rules)
        self.mesh_table = MeshTable(mod)
        self.meshes = self.mesh_table.as_dict()
        self.site_count = {id(rule): 0 for rule in self.rules}
        self.call_edits: dict[relax.Var, _CallEdit] = {}
        self.param_edits: dict[str, dict[relax.Var, _Sharding]] = {}
        self.touched: set[str] = set()  # functions with at least one edit

    # -- mesh assignment -------------------------------------------------------
    def _next_sharding(
        self, rule: ShardingRule, placement: Placement, function: str, var: str
    ) -> _Sharding:
        ref = rule.mesh_for_site(self.site_count[id(rule)])
        if ref is None:
            if len(self.meshes) != 1:
                raise UnknownMeshError(
                    f"{rule!r} names no mesh and the module has "
                    f"{len(self.meshes) or 'no'} meshes ({', '.join(self.meshes) or 'none'})",
                    function=function,
                    var=var,
                    hint="pass meshes='mesh[0]' (or a list to cycle over) to the rule",
                    cli_hint='give the rule "meshes": "mesh[0]" (or a list to cycle over)',
                )
            ref = next(iter(self.meshes))
        mesh, tvm_mesh = resolve_mesh(
            self.mod, ref, function=function, var=var, known=self.meshes
        )
        return _Sharding(mesh, tvm_mesh, placement, rule)

    # -- one function ------------------------------------------------------------
    def plan_function(self, name: str, func: relax.Function) -> None:
        sites = _SiteCollector()
        sites.visit_expr(func)
        by_name: dict[str, list[relax.Var]] = {}  # read once: a rule per weight is common
        for param in func.params:
            by_name.setdefault(str(param.name), []).append(param)
        for rule in self.rules:
            if rule.function is not None and rule.function != name:
                continue
            if rule.kind == "param":
                self._plan_param(rule, name, by_name.get(rule.param, ()), sites)
            else:
                for binding in sites.calls:
                    if self._matches(rule, binding.value):
                        self._plan_call(rule, name, binding, sites)

    @staticmethod
    def _matches(rule: ShardingRule, call: relax.Call) -> bool:
        if rule.kind == "callee":
            return _ir.callee_name(call) == rule.callee
        return isinstance(call.op, tvm.ir.Op) and call.op.name == rule.op

    def _plan_param(self, rule, name, params, sites) -> None:
        for param in params:
            sharding = self._next_sharding(rule, rule.result, name, param.name)
            self.site_count[id(rule)] += 1
            self._check_value(param, sharding, name, param.name)
            if self._already_annotated(param, sharding, sites, name, param.name):
                continue
            edits = self.param_edits.setdefault(name, {})
            self._merge(edits, param, sharding, name, param.name)
            self.touched.add(name)

    def _plan_call(self, rule, name, binding, sites) -> None:
        call: relax.Call = binding.value
        what = _ir.callee_name(call) or call.op.name
        edit = self.call_edits.get(binding.var) or _CallEdit()
        site_mesh: _Sharding | None = None
        for index, placement in rule.args.items():
            if index >= len(call.args):
                raise ShardingError(
                    f"{rule!r} annotates argument {index}, but this call of '{what}' has "
                    f"{len(call.args)} arguments",
                    function=name,
                    var=binding.var.name,
                    placement=str(placement),
                    hint=f"argument positions start at 0; use 0..{len(call.args) - 1}",
                )
            arg = call.args[index]
            var_name = arg.name if isinstance(arg, relax.Var) else f"argument {index}"
            if site_mesh is None:
                site_mesh = self._next_sharding(rule, placement, name, var_name)
            sharding = _Sharding(site_mesh.mesh, site_mesh.tvm_mesh, placement, rule)
            self._check_value(arg, sharding, name, var_name, call_of=what)
            if self._already_annotated(arg, sharding, sites, name, var_name):
                continue
            self._merge(edit.args, index, sharding, name, var_name)
        if rule.result is not None:
            var_name = binding.var.name
            if site_mesh is None:
                site_mesh = self._next_sharding(rule, rule.result, name, var_name)
            sharding = _Sharding(site_mesh.mesh, site_mesh.tvm_mesh, rule.result, rule)
            self._check_value(binding.var, sharding, name, var_name, call_of=what)
            if not self._already_annotated(binding.var, sharding, sites, name, var_name):
                slot = {0: edit.result} if edit.result is not None else {}
                self._merge(slot, 0, sharding, name, var_name)
                edit.result = slot[0]
        self.site_count[id(rule)] += 1
        if edit.args or edit.result is not None:
            self.call_edits[binding.var] = edit
            self.touched.add(name)

    # -- checks ------------------------------------------------------------------
    @staticmethod
    def _check_value(value, sharding: _Sharding, function, var, call_of=None) -> None:
        ty = value.ty
        if not _ir.is_tensor_type(ty):
            kind = type(ty).__name__.replace("Type", "").lower() or "value"
            raise UnsupportedValueError(
                f"only tensors can be sharded, but this {kind} has type {ty}",
                function=function,
                var=var,
                placement=str(sharding.placement),
                hint="annotate the tensors inside it instead, or drop it from args=",
                cli_hint='annotate the tensors inside it instead, or drop it from "args"',
            )
        if not isinstance(value, relax.Var):
            raise UnsupportedValueError(
                f"the argument of '{call_of}' is a constant, and a constant cannot be sharded",
                function=function,
                var=var,
                placement=str(sharding.placement),
                hint="pass the constant as a function parameter and annotate that",
            )
        sharding.placement.validate(
            sharding.mesh, _ir.static_shape(ty), function=function, var=var
        )

    def _named(self, mesh: DeviceMesh) -> DeviceMesh:
        """The module's own name for a mesh found in IR, when it has one."""
        return self.mesh_table.named(mesh)

    def _already_annotated(self, value, sharding: _Sharding, sites, function, var) -> bool:
        """True when ``value`` already carries ``sharding``; raise if it carries another."""
        existing: list[tuple[DeviceMesh, Placement]] = []
        typed = _ir.dtensor_sharding(value.ty)
        if typed is not None:
            existing.append(typed)
        if value in sites.annotation_of:
            _, mesh, placement = sites.annotation_of[value]
            existing.append((mesh, placement))
        existing.extend(sites.annotations_on.get(value, []))
        for mesh, placement in existing:
            if not sharding.same_as(mesh, placement):
                raise ShardingConflictError(
                    f"{sharding.rule!r} asks for {sharding.describe()}, but the value is "
                    f'already annotated "{placement}" on mesh {self._named(mesh).describe()}',
                    function=function,
                    var=var,
                    placement=str(sharding.placement),
                    hint="remove one of the two annotations, or express the change of "
                    "placement with R.dist.redistribute",
                )
        return bool(existing)

    @staticmethod
    def _merge(slots: dict, key, sharding: _Sharding, function, var) -> None:
        previous = slots.get(key)
        if previous is not None and previous != sharding:
            raise ShardingConflictError(
                f"{previous.rule!r} asks for {previous.describe()} and {sharding.rule!r} asks "
                f"for {sharding.describe()}",
                function=function,
                var=var,
                placement=str(sharding.placement),
                hint="make the rules agree, or restrict one of them with function=",
                cli_hint='make the rules agree, or restrict one of them with "function"',
            )
        slots[key] = sharding

    def check_all_matched(self) -> None:
        for rule in self.rules:
            if self.site_count[id(rule)] == 0:
                scope = f" in function '{rule.function}'" if rule.function else ""
                raise UnmatchedRuleError(
                    f"{rule!r} matched nothing{scope}",
                    function=rule.function,
                    hint=_unmatched_hint(self.mod, rule),
                )


def _unmatched_hint(mod: tvm.IRModule, rule: ShardingRule) -> str:
    names = sorted(gv.name_hint for gv, _ in _ir.relax_functions(mod))
    if rule.kind == "callee":
        return f"the module's functions are: {', '.join(names)}"
    if rule.kind == "param":
        params = sorted(
            {p.name for _, f in _ir.relax_functions(mod) for p in f.params}
        )
        return f"the module's parameters are: {', '.join(params)}"
    return "check the op name, e.g. 'relax.matmul'; pass strict=False to allow rules that match nothing"


# --------------------------------------------------------------------------- phase 2
@mutator
class _Rewriter(PyExprMutator):
    """Apply a plan to one function."""

    def __init__(self, mod: tvm.IRModule, call_edits: dict[relax.Var, _CallEdit]) -> None:
        super().__init__(mod)
        self.call_edits = call_edits
        self.param_bindings: dict[relax.Var, relax.Var] = {}  # annotation var -> param
        self._cache: dict[tuple, relax.Var] = {}

    def rewrite(self, func: relax.Function, params: dict[relax.Var, _Sharding]) -> relax.Function:
        if params:
            func = self._prepend_param_annotations(func, params)
        return self.visit_expr(func)

    def _prepend_param_annotations(self, func, params) -> relax.Function:
        # in parameter order, whatever the order of the rules that placed them
        bindings = []
        for param in (p for p in func.params if p in params):
            sharding = params[param]
            value = _annotate(param, sharding)
            ann = relax.Var(f"{param.name}_ann", param.ty)
            bindings.append(relax.VarBinding(ann, value))
            self.param_bindings[ann] = param
        body = func.body
        blocks = [relax.BindingBlock(bindings)] + list(body.blocks)
        new_body = relax.SeqExpr(blocks, body.body, body.span)
        return relax.Function(
            func.params, new_body, func.ret_ty, func.is_pure, func.attrs, func.span
        )

    def visit_binding_block_(self, block):
        self._cache.clear()  # annotations do not outlive their block
        return super().visit_binding_block_(block)

    def visit_dataflow_block_(self, block):
        self._cache.clear()
        return super().visit_dataflow_block_(block)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var in self.param_bindings:
            value = self.builder_.normalize(binding.value)
            self.builder_.emit_normalized(relax.VarBinding(binding.var, value))
            self.set_var_remap(self.param_bindings[binding.var], binding.var)
            return
        edit = self.call_edits.get(binding.var)
        if edit is None:
            super().visit_var_binding_(binding)
            return
        call = self.visit_expr(binding.value)
        args = list(call.args)
        for index, sharding in edit.args.items():
            args[index] = self._annotated(args[index], sharding)
        new_call = self.builder_.normalize(
            relax.Call(call.op, args, call.attrs, call.ty_args, call.span)
        )
        if edit.result is None:
            self.builder_.emit_normalized(relax.VarBinding(binding.var, new_call))
            return
        raw = self.builder_.emit(new_call, name_hint=f"{binding.var.name}_raw")
        annotated = self.builder_.normalize(_annotate(raw, edit.result))
        self.builder_.emit_normalized(relax.VarBinding(binding.var, annotated))

    def _annotated(self, value: relax.Expr, sharding: _Sharding) -> relax.Var:
        key = (value, sharding)
        if key not in self._cache:
            name = value.name if isinstance(value, relax.Var) else "arg"
            self._cache[key] = self.builder_.emit(
                _annotate(value, sharding), name_hint=f"{name}_ann"
            )
        return self._cache[key]


def _annotate(value: relax.Expr, sharding: _Sharding) -> relax.Call:
    return relax.op.distributed.annotate_sharding(
        value, sharding.tvm_mesh, sharding.placement.to_tvm()
    )


# --------------------------------------------------------------------------- the pass
@module_pass(name="tvm_distx.AnnotateSharding")
class AnnotateSharding:
    """Insert ``R.dist.annotate_sharding`` calls as the rules say.

    Parameters
    ----------
    rules : sequence of ShardingRule
        The rules, applied together. Two rules that ask different shardings of
        the same site are a conflict.
    strict : bool, default True
        Raise :class:`tvm_distx.errors.UnmatchedRuleError` when a rule matches nothing
        (usually a typo in a name). With ``strict=False`` it is logged instead.

    Raises
    ------
    ShardingError
        For a bad placement, an unknown mesh, a conflict, a non-tensor value, or
        (in strict mode) a rule that matches nothing; the message names the
        function and the variable.

    Examples
    --------
    >>> rules = [ShardingRule(callee="mlp", args={0: "R"}, meshes=["mesh[0]", "mesh[1]"])]
    >>> mod = AnnotateSharding(rules)(mod)  # doctest: +SKIP
    """

    def __init__(self, rules: Iterable[ShardingRule], *, strict: bool = True) -> None:
        self.rules = list(rules)
        for rule in self.rules:
            if not isinstance(rule, ShardingRule):
                raise ArgumentTypeError(
                    f"AnnotateSharding takes ShardingRule objects, got {type(rule).__name__}",
                    hint="build each rule with tvm_distx.ShardingRule(...)",
                )
        self.strict = strict

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        planner = _Planner(mod, self.rules)
        functions = list(_ir.relax_functions(mod))
        for gv, func in functions:
            planner.plan_function(gv.name_hint, func)
        if self.strict:
            planner.check_all_matched()
        else:
            for rule in self.rules:
                if planner.site_count[id(rule)] == 0:
                    logger.warning("%r matched nothing", rule)

        updated = mod.clone()
        for gv, func in functions:
            if gv.name_hint not in planner.touched:
                continue
            params = planner.param_edits.get(gv.name_hint, {})
            updated[gv] = _Rewriter(mod, planner.call_edits).rewrite(func, params)
            logger.debug("annotated function %s", gv.name_hint)
        return updated
