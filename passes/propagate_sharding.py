"""``PropagateSharding``: sharding flows through the whole module, calls included.

A drop-in superset of ``tvm.relax.distributed.transform.PropagateSharding``.
TVM's pass rewrites one function at a time and fails as soon as a sharded value
is passed to another Relax function. This pass:

* solves every function with :mod:`tvm_distx.passes.sharding_solver`, following
  calls into callees and results back out, in both directions;
* gives each distinct signature of a callee (mesh and placement of every
  parameter) one ``R.DTensor``-typed version, shared by every call site with
  that signature. Versions are named after the callee (``mlp``, ``mlp_1``, ...,
  in program order of their first call); the original private function is
  removed once no call to it remains, and public functions keep their names;
* inserts ``R.dist.redistribute`` wherever a value's sharding differs from what
  a use needs, including between pipeline stages on different meshes.

Functions that no sharding reaches are left as they are. A ``call_tir`` kernel
with a user's rule (:func:`tvm_distx.register_sharding_rule`) gets the rule
string as its attribute :data:`tvm_distx.ir.helpers.KERNEL_RULE_ATTR`, which
tells the local view to run it on each rank's shards as written.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import tvm
from tvm import relax
from tvm.relax.distributed import DTensorType

from tvm_distx.ir import helpers as _ir
from tvm_distx.ir.module_pass import module_pass
from tvm_distx.ir.rewriter import FunctionRewriter
from tvm_distx.errors import ShardingError, UnsupportedProgramError
from tvm_distx.layout import MeshTable, TensorSharding, replicated

from tvm_distx.passes.decisions import Decision, Strength, decide_operands, replicated_plan
from tvm_distx.passes.sharding_solver import FunctionAnalysis, ProgramAnalysis, _field_type, call_site
from tvm_distx.passes.user_rules import kernel_rule

__all__ = ["PropagateSharding", "PropagationResult", "propagate"]

logger = logging.getLogger(__name__)

_ANNOTATE = "relax.dist.annotate_sharding"
_REDISTRIBUTE = "relax.dist.redistribute"
_CALL_TIR = "relax.call_tir"


@dataclass(frozen=True)
class _Version:
    """One function to emit: a callee (or root) and its complete parameter shardings."""

    name: str
    params: tuple  # TensorSharding or None per parameter


@dataclass
class PropagationResult:
    """The propagated module and the analyses behind it (see :func:`tvm_distx.reports.explain`).

    Attributes
    ----------
    mod : tvm.IRModule
        The module with ``R.DTensor`` types.
    analyses : dict of str to FunctionAnalysis
        For each emitted function (by its new name), the solved analysis.
    unlegalized : list of (str, str, str)
        High-level operator calls left with sharded operands: (function,
        variable, operator).
    """

    mod: tvm.IRModule
    analyses: dict
    unlegalized: list = field(default_factory=list)


def propagate(mod: tvm.IRModule, *, require_legalized: bool = False,
              warn_unlegalized: bool = True) -> PropagationResult:
    """Propagate shardings through ``mod`` and keep the analyses.

    :class:`PropagateSharding` is this function as a pass; see it for the
    parameters.
    """
    result = _ModuleRewriter(mod).run()
    if result.unlegalized:
        sites = ", ".join(f"{op} at '{var}' in '{fn}'" for fn, var, op in result.unlegalized[:5])
        more = len(result.unlegalized) - 5
        text = (f"{len(result.unlegalized)} high-level operator calls now take sharded operands "
                f"({sites}{f' and {more} more' if more > 0 else ''}); relax.transform.LegalizeOps "
                "skips such calls, so legalizing after propagation loses collectives")
        if require_legalized:
            opaque = [site for site in result.unlegalized if not _legalizable(site[2])]
            if opaque:  # LegalizeOps cannot help: say so, instead of asking for it
                fn, var, op = opaque[0]
                raise UnsupportedProgramError(
                    f"{op} at '{var}' takes sharded operands, but it has no legalization "
                    "to TIR, so sharding propagation cannot see what it computes",
                    function=fn, var=var,
                    hint="keep its operands replicated (annotate them \"R\"), or write it "
                    "as a TIR function called with R.call_tir",
                )
            raise UnsupportedProgramError(
                text, function=result.unlegalized[0][0], var=result.unlegalized[0][1],
                hint="run relax.transform.LegalizeOps() before PropagateSharding "
                "(tvm_distx.lower_to_ranks does this for you)",
            )
        if warn_unlegalized:
            logger.warning("%s; run LegalizeOps before PropagateSharding", text)
    return result


@module_pass(name="tvm_distx.PropagateSharding")
class PropagateSharding:
    """Propagate shardings across the call graph and type the module with ``R.DTensor``.

    Parameters
    ----------
    require_legalized : bool, default False
        Refuse high-level operator calls (anything but ``call_tir`` and the
        distributed builtins) on sharded operands. TVM's ``LegalizeOps`` skips
        such calls, and a later lowering then drops the collectives a sharded
        reduction needs, silently giving wrong numbers. Pipelines that lower
        must pass True; without it, such calls are logged as a warning (which
        keeps the pass a drop-in replacement for TVM's).
    warn_unlegalized : bool, default True
        Log that warning. False for a module propagated only to be read (a
        high-level view of the shardings), never lowered.

    Raises
    ------
    ShardingError
        On recursion, on control flow inside a sharded function, on operators
        that TVM cannot type on DTensors (run ``LegalizeOps`` first), and on any
        invalid sharding; the message names the function.
    """

    def __init__(self, *, require_legalized: bool = False, warn_unlegalized: bool = True) -> None:
        self.require_legalized = require_legalized
        self.warn_unlegalized = warn_unlegalized

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return propagate(mod, require_legalized=self.require_legalized,
                         warn_unlegalized=self.warn_unlegalized).mod


class _ModuleRewriter:
    def __init__(self, mod: tvm.IRModule) -> None:
        self.mod = mod
        self.program = ProgramAnalysis(mod)
        self.meshes = MeshTable(mod)
        self.bb = relax.BlockBuilder()
        self.versions: dict[_Version, FunctionAnalysis] = {}
        self.reached: set[str] = set()  # names of the functions some version is of
        self.order: list[_Version] = []
        self.names: dict[_Version, str] = {}
        self.emitted: dict[_Version, tvm.ir.GlobalVar] = {}
        self.analyses: dict[str, FunctionAnalysis] = {}
        self.unlegalized: list[tuple[str, str, str]] = []  # (function, var, op)

    # ------------------------------------------------------------------ driver
    def run(self) -> PropagationResult:
        functions = list(_ir.relax_functions(self.mod))
        roots: list[_Version] = []
        untouched: list[str] = []
        for gv, func in functions:
            # Roots: public functions, and private ones that no root reaches but that
            # carry annotations of their own (TVM's pass rewrites those too).
            if not _is_public(func) and (gv.name_hint in self.reached or not _annotated(func)):
                continue
            analysis = self.program.final(gv.name_hint, (None,) * len(func.params))
            if not analysis.is_sharded():
                untouched.append(gv.name_hint)
                continue
            root = _Version(gv.name_hint, _param_shardings(analysis))
            self.versions[root] = analysis
            self.reached.add(root.name)
            roots.append(root)
            self._discover(root)

        kept = self._kept_originals(functions, untouched)
        self._assign_names(roots, kept)

        for root in roots:
            self._emit(root)

        # Functions emitted unchanged keep their GlobalVar objects, so that calls to
        # them (and call_tir references to TIR functions) stay valid.
        functions_out = dict(self.bb.get().functions.items())
        for gv, func in self.mod.functions.items():
            if isinstance(func, tvm.tirx.PrimFunc):
                functions_out[gv] = _with_user_rule(func, gv.name_hint)
            elif not isinstance(func, relax.Function) or gv.name_hint in kept:
                functions_out[gv] = func
        out = tvm.IRModule(functions_out, attrs=self.mod.attrs,
                           global_infos=self.mod.global_infos)
        return PropagationResult(out, self.analyses, self.unlegalized)

    def _discover(self, version: _Version) -> None:
        analysis = self.versions[version]
        for binding in analysis.bindings:
            callee = self.callee_of(binding.value)
            if callee is None:
                continue
            child = self.callee_version(analysis, binding, callee)
            if child not in self.versions:
                site = call_site(binding.var, analysis.name)
                self.versions[child] = self.program.final(
                    callee, tuple(_source(s, site) for s in child.params)
                )
                self.reached.add(child.name)
                self.order.append(child)
                self._discover(child)

    def callee_of(self, value) -> str | None:
        """The name of the Relax function ``value`` calls, or None."""
        if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.GlobalVar):
            if isinstance(self.mod[value.op], relax.Function):
                return value.op.name_hint
        return None

    def callee_version(self, analysis: FunctionAnalysis, binding, callee: str) -> _Version:
        args = binding.value.args
        known = [analysis.get(a) if isinstance(a, relax.Var) and analysis.tensor_slots(a) == 1
                 else None for a in args]
        passed = self.program.call_signature(known, call_site(binding.var, analysis.name))
        callee_analysis = self.program.final(callee, passed)
        return _Version(callee, _param_shardings(callee_analysis))

    def _kept_originals(self, functions, untouched) -> set[str]:
        """Functions emitted unchanged: unsharded roots, what they call, and the unreached."""
        kept: set[str] = set()
        stack = list(untouched)
        while stack:
            name = stack.pop()
            if name in kept:
                continue
            kept.add(name)
            stack.extend(_callees(self.mod[name]))
        specialised = {v.name for v in self.versions}
        for gv, func in functions:
            if gv.name_hint not in specialised and not _is_public(func):
                kept.add(gv.name_hint)
        return kept

    def _assign_names(self, roots, kept: set[str]) -> None:
        taken = {gv.name_hint for gv in self.mod.get_global_vars()}
        counters: dict[str, int] = {}
        for root in roots:  # roots keep their names; versions of them get suffixes
            self.names[root] = root.name
            counters[root.name] = 0
        for version in self.order:
            base = version.name
            if base not in kept and base not in counters:
                counters[base] = 0
                self.names[version] = base
                continue
            n = counters.get(base, 0)
            while True:
                n += 1
                name = f"{base}_{n}"
                if name not in taken:
                    break
            counters[base] = n
            taken.add(name)
            self.names[version] = name

    # ------------------------------------------------------------------ emission
    def _emit(self, version: _Version) -> tvm.ir.GlobalVar:
        if version in self.emitted:
            return self.emitted[version]
        analysis = self.versions[version]
        for binding in analysis.bindings:  # callees first
            callee = self.callee_of(binding.value)
            if callee is not None:
                self._emit(self.callee_version(analysis, binding, callee))
        name = self.names[version]
        # Roots keep their visibility; versions made for call sites are private.
        public = name == version.name and _is_public(analysis.func)
        gv = _FunctionEmitter(self, analysis, name, public).emit()
        self.emitted[version] = gv
        self.analyses[name] = analysis
        logger.debug("emitted %s as %s", version.name, name)
        return gv

    def tvm_mesh(self, mesh):
        return self.meshes.to_tvm(mesh)

    def dtensor_type(self, tensor_ty, sharding: TensorSharding) -> DTensorType:
        if isinstance(tensor_ty, DTensorType):
            tensor_ty = tensor_ty.tensor_ty
        return DTensorType(tensor_ty, self.tvm_mesh(sharding.mesh), sharding.placement.to_tvm())

    def redistribute(self, value: relax.Expr, sharding: TensorSharding) -> relax.Call:
        return relax.op.distributed.redistribute(
            value, self.tvm_mesh(sharding.mesh), sharding.placement.to_tvm()
        )


class _FunctionEmitter(FunctionRewriter):
    """Write one function with DTensor types from its solved analysis."""

    def __init__(
        self, owner: _ModuleRewriter, analysis: FunctionAnalysis, name: str, public: bool
    ) -> None:
        super().__init__(owner.bb, name)
        self.owner = owner
        self.public = public
        self.analysis = analysis
        # (block, value, sharding) -> its redistribute, shared by the uses in that block
        self._moves: dict[tuple, relax.Var] = {}

    def emit(self) -> tvm.ir.GlobalVar:
        func = self.analysis.func
        params = [relax.Var(p.name, self._new_type(p)) for p in func.params]
        return self.rewrite(func, params, self.public)

    def binding(self, index: int, binding, dataflow: bool) -> None:
        self._binding(self.analysis.bindings[index], dataflow)

    # -- types and values --------------------------------------------------------
    def _new_type(self, var: relax.Var):
        ty = var.ty
        if _ir.is_tensor_type(ty):
            d = self.analysis.get(var)
            return self.owner.dtensor_type(ty, d.sharding) if d is not None else ty
        if isinstance(ty, relax.TupleType):
            fields = []
            for slot, field_ty in enumerate(ty.fields):
                d = self.analysis.get(var, slot)
                fields.append(self.owner.dtensor_type(field_ty, d.sharding)
                              if d is not None and _ir.is_tensor_type(field_ty) else field_ty)
            return relax.TupleType(fields)
        return ty

    def _sharding(self, var, slot: int = 0) -> TensorSharding | None:
        d = self.analysis.get(var, slot)
        return d.sharding if d is not None else None

    def _moved(self, operand: relax.Expr, needed: TensorSharding) -> relax.Expr:
        """``operand`` (new IR) redistributed to ``needed`` when its sharding differs.

        Uses in one block that need the same sharding share one redistribute
        (the normalised activation feeding the q, k and v projections is
        gathered once).
        """
        current = self.use(operand)
        have = TensorSharding.from_type(current.ty) if isinstance(current, relax.Var) else None
        if have is None or have == needed:
            return current
        key = (self.block, current, needed)
        if key not in self._moves:
            name = operand.name if isinstance(operand, relax.Var) else "arg"
            self._moves[key] = self.bb.emit(self.owner.redistribute(current, needed),
                                            name_hint=f"{name}_redist")
        return self._moves[key]

    # -- bindings ------------------------------------------------------------------
    def _binding(self, b, dataflow: bool) -> None:
        value = b.value
        if b.cast is not None:
            self._match_cast(b, dataflow)
        elif isinstance(value, relax.Call) and (
            _ir.is_call_to(value, _ANNOTATE) or _ir.is_call_to(value, _REDISTRIBUTE)
        ):
            self._annotation(b, value, dataflow)
        elif isinstance(value, relax.Call) and self.owner.callee_of(value) is not None:
            self._call(b, value, dataflow)
        elif _ir.kv_builtin(value) is not None:
            self._kv_cache(b, value, dataflow)
        elif isinstance(value, relax.Call) and self.analysis.tensor_slots(b.var):
            self._operator(b, value, dataflow)
        else:
            self._plain(b, value, dataflow)

    def _match_cast(self, b, dataflow: bool) -> None:
        value = self.use(b.value)
        cast = b.cast
        sharding = self._sharding(b.var) if _ir.is_tensor_type(cast) else None
        if sharding is not None:
            cast = self.owner.dtensor_type(cast, sharding)
            have = TensorSharding.from_type(value.ty)
            if have is not None and have != sharding:
                value = self.bb.emit(self.owner.redistribute(value, sharding))
        self.match_cast(b.var, value, cast, dataflow)

    def _plain(self, b, value, dataflow: bool) -> None:
        if isinstance(value, relax.TupleGetItem):
            new = relax.TupleGetItem(self.use(value.tuple_value), value.index)
        elif isinstance(value, relax.Call):
            new = relax.Call(value.op, [self.use(a) for a in value.args], value.attrs,
                             value.ty_args, value.span)
        else:
            new = self.use(value)
        new = self.bb.normalize(new)
        want = self._sharding(b.var) if self.analysis.tensor_slots(b.var) == 1 else None
        if want is not None and isinstance(new, tvm.ir.Constant) and _ir.is_tensor_type(new.ty):
            # a constant bound to a variable (LegalizeOps folds arange and full into
            # one) is a DTensor like every other value its users read: replicated,
            # and split without communication where its users want it split
            new = self._constant(new, replicated(want.mesh), b.var)
        if want is not None and _ir.is_tensor_type(b.var.ty):
            have = TensorSharding.from_type(new.ty)
            if have is not None and have != want:
                raw = self.bb.emit(new)
                new = self.owner.redistribute(raw, want)
        self.bind(b.var, new, dataflow)

    def _annotation(self, b, call: relax.Call, dataflow: bool) -> None:
        source = call.args[0]
        want = self._sharding(b.var)
        current = self.use(source)
        have = TensorSharding.from_type(current.ty)
        if _ir.is_call_to(call, _ANNOTATE) and have == want:
            output = dataflow and not isinstance(b.var, relax.DataflowVar)
            if output and isinstance(current, relax.DataflowVar):
                self.bind(b.var, current, dataflow)
            else:
                self.remap[b.var] = current
            return
        self.bind(b.var, self.owner.redistribute(current, want), dataflow)

    def _call(self, b, call: relax.Call, dataflow: bool) -> None:
        callee = call.op.name_hint
        version = self.owner.callee_version(self.analysis, b, callee)
        gv = self.owner.emitted[version]
        args = []
        for arg, needed in zip(call.args, version.params):
            args.append(self._moved(arg, needed) if needed is not None else self.use(arg))
        new = self.bb.normalize(relax.Call(gv, args, call.attrs, call.ty_args, call.span))
        self._finish(b, new, dataflow)

    def _operator(self, b, call: relax.Call, dataflow: bool) -> None:
        sig, operands = self.analysis.operands_of(call)
        outputs = [(b.var, s) for s in range(self.analysis.tensor_slots(b.var))]
        known = [self.analysis.get(o) if isinstance(o, relax.Var) else None for o in operands]
        known += [self.analysis.get(v, s) for v, s in outputs]
        if sig is None:
            plan = replicated_plan(known, len(operands), len(outputs))
        else:
            # the outputs' shapes too, as in the analysis: a split that divides an
            # operand but not a result (a reshape of 12 into 3 x 4 on 4 devices)
            # must be dropped here as well, or the kernel gets an uneven shard
            shapes = [_ir.static_shape(o.ty) for o in operands] + [
                _ir.static_shape(_field_type(v.ty, s)) for v, s in outputs]
            plan = decide_operands(sig, known, shapes)
        if plan is None:  # nothing sharded reaches this call: it stays as it is
            self._plain(b, call, dataflow)
            return
        # One value may be several operands that need different shardings (x @ x
        # with x split on its columns: the left operand keeps the split, the right
        # one is split on its rows), so replacements are kept per occurrence, in
        # operand order, not one per value.
        moved: dict[relax.Expr, list[relax.Expr]] = {}
        for operand, needed in zip(operands, plan.operands):
            if isinstance(operand, relax.Var):
                moved.setdefault(operand, []).append(self._moved(operand, needed))
            elif isinstance(operand, tvm.ir.Constant):
                moved.setdefault(operand, []).append(self._constant(operand, needed, b.var))

        def replace(value):
            queue = moved.get(value)
            if not queue:
                return self.use(value)
            return queue.pop(0) if len(queue) > 1 else queue[0]

        new_call = _substitute(call, replace)
        if _ir.is_call_to(call, _CALL_TIR):
            new_call = self._typed_call_tir(new_call, plan, b.var)
        try:
            new = self.bb.normalize(new_call)
        except Exception as err:  # TVM reports type-inference failures as TVMError
            if isinstance(err, ShardingError):
                raise
            op_name = call.op.name if isinstance(call.op, tvm.ir.Op) else str(call.op)
            raise UnsupportedProgramError(
                f"TVM cannot type {op_name} on sharded operands: "
                f"{_ir.tvm_error_reason(err)}",
                function=self.name,
                var=b.var.name,
                hint="run relax.transform.LegalizeOps() before PropagateSharding; TVM 0.27 has "
                "distributed type rules for few high-level operators",
            ) from None
        if isinstance(call.op, tvm.ir.Op) and not call.op.name.startswith(("relax.call_tir",
                                                                            "relax.dist.")):
            self.owner.unlegalized.append((self.name, b.var.name, call.op.name))
        self._finish(b, new, dataflow)

    def _kv_cache(self, b, call: relax.Call, dataflow: bool) -> None:
        """A KV-cache builtin under its distributed name, as TVM's pass writes it.

        The appended tensor (or a created cache's initial data) is moved to what
        the cache holds (whole rows, see :meth:`FunctionAnalysis.kv_cache_sharding`);
        a view is typed as a DTensor of the global shape it is asked for.
        """
        role, _ = _ir.kv_builtin(call)
        args = [self.use(a) for a in call.args]
        ty_args = list(call.ty_args)
        if role != "view":
            held = self.analysis.kv_cache_sharding(b.var)
            if held is None:
                self._plain(b, call, dataflow)
                return
            written = 1 if role == "append" else 0
            args[written] = self._moved(call.args[written], held)
        else:
            want = self._sharding(b.var)
            # the view is what the cache holds; a use that wants it otherwise moves it
            held = self.analysis.kv_cache_sharding(call.args[0]) or want
            if held is None:
                self._plain(b, call, dataflow)
                return
            ty_args = [self.owner.dtensor_type(ty_args[0], held)]
            if want is not None and want != held:
                raw = self.bb.emit(_ir.kv_renamed(call, True, args, ty_args))
                self.bind(b.var, self.owner.redistribute(raw, want), dataflow)
                return
        new = self.bb.normalize(_ir.kv_renamed(call, True, args, ty_args))
        self.bind(b.var, new, dataflow)

    def _constant(self, const, needed: TensorSharding, var: relax.Var):
        """A constant operand: a replicated DTensor constant, sliced where a use splits it.

        Every rank holds the whole constant (it is part of the one program all
        ranks run); a split use reads its block through a local slice, which
        moves no data.
        """
        whole = tvm.ir.GenericConst(const.value,
                                    self.owner.dtensor_type(const.ty, replicated(needed.mesh)))
        if needed.placement.is_replicated():
            return whole
        bound = self.bb.emit(whole, name_hint=f"{var.name}_const")
        return self.bb.emit(self.owner.redistribute(bound, needed),
                            name_hint=f"{var.name}_const_redist")

    def _typed_call_tir(self, call: relax.Call, plan, var: relax.Var) -> relax.Call:
        out_ty = call.ty_args[0]
        if isinstance(out_ty, relax.TupleType):
            new_ty = relax.TupleType([self.owner.dtensor_type(t, s)
                                      for t, s in zip(out_ty.fields, plan.outputs)])
        else:
            new_ty = self.owner.dtensor_type(out_ty, plan.outputs[0])
        return relax.Call(call.op, call.args, call.attrs, [new_ty], call.span)

    def _finish(self, b, new: relax.Expr, dataflow: bool) -> None:
        """Bind a call's result, redistributing where its sharding is not the value's."""
        slots = self.analysis.tensor_slots(b.var)
        if slots == 1 and _ir.is_tensor_type(b.var.ty):
            want = self._sharding(b.var)
            have = TensorSharding.from_type(new.ty)
            if want is not None and have is not None and have != want:
                raw = self.bb.emit(new)
                new = self.owner.redistribute(raw, want)
        elif slots > 1 and isinstance(new.ty, relax.TupleType):
            fields = new.ty.fields
            mismatched = [
                s for s in range(slots)
                if self._sharding(b.var, s) is not None
                and TensorSharding.from_type(fields[s]) not in (None, self._sharding(b.var, s))
            ]
            if mismatched:
                raw = self.bb.emit(new)
                items = []
                for s in range(slots):
                    item = self.bb.emit(relax.TupleGetItem(raw, s))
                    if s in mismatched:
                        item = self.bb.emit(self.owner.redistribute(item, self._sharding(b.var, s)))
                    items.append(item)
                new = relax.Tuple(items)
        self.bind(b.var, new, dataflow)


# --------------------------------------------------------------------------- helpers
def _with_user_rule(func: tvm.tirx.PrimFunc, name: str) -> tvm.tirx.PrimFunc:
    """``func`` marked with the rule string a user declared for it, if any."""
    spec = kernel_rule(func, name)
    if spec is None:
        return func
    return func.with_attr(_ir.KERNEL_RULE_ATTR, spec.text)


def _legalizable(op_name: str) -> bool:
    """Whether ``relax.transform.LegalizeOps`` can lower this operator to TIR."""
    try:
        return tvm.ir.Op.get(op_name).get_attr("FLegalize") is not None
    except Exception:  # noqa: BLE001  (an unknown name: not legalizable)
        return False


def _is_public(func: relax.Function) -> bool:
    return func.attrs is not None and "global_symbol" in func.attrs


def _annotated(func: relax.Function) -> bool:
    found = []

    def visit(expr):
        if _ir.is_call_to(expr, _ANNOTATE):
            found.append(expr)

    relax.analysis.post_order_visit(func, visit)
    return bool(found)


def _param_shardings(analysis: FunctionAnalysis) -> tuple:
    out = []
    for param in analysis.func.params:
        d = analysis.get(param) if analysis.tensor_slots(param) == 1 else None
        out.append(d.sharding if d is not None else None)
    return tuple(out)


def _source(sharding: TensorSharding | None, site: str) -> Decision | None:
    if sharding is None:
        return None
    return Decision(sharding, Strength.SOURCE, f"signature of this version, from {site}")


def _callees(func) -> list[str]:
    found: list[str] = []

    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.GlobalVar):
            found.append(expr.op.name_hint)

    if isinstance(func, relax.Function):
        relax.analysis.post_order_visit(func, visit)
    return found


def _substitute(expr: relax.Expr, use) -> relax.Expr:
    """Rebuild a call (and nested tuples) with every Var and constant replaced by ``use``."""
    if isinstance(expr, (relax.Var, tvm.ir.Constant)):
        return use(expr)
    if isinstance(expr, relax.Tuple):
        return relax.Tuple([_substitute(f, use) for f in expr.fields])
    if isinstance(expr, relax.Call):
        return relax.Call(expr.op, [_substitute(a, use) for a in expr.args], expr.attrs,
                          expr.ty_args, expr.span)
    return expr
