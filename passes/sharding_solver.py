"""The sharding solver: which mesh and placement every value of a module gets.

This module only *analyses*; :mod:`tvm_distx.passes.propagate_sharding`
rewrites the IR from its answers.

Model
-----
Every tensor value has a :class:`~tvm_distx.passes.decisions.Decision`: a
sharding, how strongly it is held
(:class:`~tvm_distx.passes.decisions.Strength`) and why (a sentence shown by :func:`tvm_distx.reports.explain`).
A value with no decision is unknown; unknown is never read as replicated.

Sources are ``R.dist.annotate_sharding`` and ``R.dist.redistribute`` results,
``R.DTensor`` parameters, and the parameter shardings a caller passes into a
specialised callee. From them, decisions flow along bindings in both directions
until nothing changes (a worklist over bindings, in program order):

* an operator call is described by an einsum-like signature
  (:mod:`tvm_distx.passes.op_signatures`). Per mesh axis, the strongest operand
  that shards a label decides that the label is sharded on that mesh axis.
  Equally strong operands that shard different labels are a choice, made by
  modelled cost: the elements moved per rank (gathers, exchanges, the
  all-reduce of a partial result), then the elements held per rank; the choice
  and both costs go into the reason :func:`tvm_distx.reports.explain` shows. Replicated
  operands never decide, because a replicated operand can always be sliced
  locally: a call that only replicated values reached waits until nothing else
  is left to do, so that a split arriving later (a pipeline stage's annotation
  further down) still decides its other operands. Unknown operands and results
  then follow from the labels. A result is held as firmly as its
  operand when the operator only relayouts one operand (a transpose): the
  transposed weight of a ``Linear`` stays as strong as its annotation, so a
  matmul that meets it and an activation split elsewhere keeps the weight
  split and moves the activation.
* a label that no output has is a reduction (a sum): sharding it on mesh axis
  ``a`` leaves every rank of ``a`` with an addend of the result, a *partial sum*
  (``"P"`` on axis ``a``). The decision records it (:attr:`Decision.partial`);
  its sharding is what the value has once completed, replicated on ``a``, which
  is how TVM's types write it (``LowerGlobalViewToLocalView`` inserts the
  all-reduce). How it is completed is the consumer's choice: an operator whose
  only information is a partial operand (a bias added to a row-parallel
  matmul) is *deferred* until a later use decides its result. When that use
  wants the value split (``S[i]``) on ``a``, the partial sum is redistributed
  there, which legalization turns into one reduce-scatter instead of an
  all-reduce and a slice. An operator still undecided when the worklist runs
  dry is decided from its operands as usual (replicated: an all-reduce).
* a call of a Relax function is *specialised*: the callee is analysed with the
  shardings of the arguments that are known (memoised per signature), and its
  parameter and result shardings flow back to the caller. The callee lives on
  one mesh, the *home mesh* of the call: the mesh of its strongest known
  argument. Arguments on another mesh are not passed in; the caller moves them
  with a redistribute (this is how pipeline stages hand values over).
* an operator without a signature runs replicated on its operands' mesh
  (correct, possibly slow; it is logged).

When two decisions meet on one value the first one stays, and the rewrite
inserts an ``R.dist.redistribute`` where a use needs the other (annotations
are the strongest decisions, so annotations win). Values that no source reaches
are finally replicated on their function's home mesh, with that reason
recorded. A function that no source reaches at all is left unsharded.
"""

from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass
from typing import Iterator, Sequence

import tvm
from tvm import relax

from tvm_distx.ir import helpers as _ir
from tvm_distx.errors import CallGraphError, RuleError, UnsupportedProgramError
from tvm_distx.layout import MeshTable, Placement, Replicate, TensorSharding, replicated
from tvm_distx.layout.mesh import DeviceMesh

from tvm_distx.passes.decisions import (
    Decision,
    Strength,
    check_single_home,
    completes_a_partial_sum,
    decide_operands,
    only_replicated,
    partial_note,
    relayout_strength,
    replicated_plan,
)
from tvm_distx.passes.op_signatures import OpSignature, op_signature

__all__ = ["FunctionAnalysis", "ProgramAnalysis", "CallSummary", "call_site"]

logger = logging.getLogger(__name__)

_ANNOTATE = "relax.dist.annotate_sharding"
_REDISTRIBUTE = "relax.dist.redistribute"


# --------------------------------------------------------------------------- one function
@dataclass
class _Binding:
    index: int
    var: relax.Var
    value: relax.Expr
    cast: object = None  # the target type of a MatchCast binding (it acts as an alias)


@dataclass
class CallSummary:
    """What a specialised callee says about its parameters and result."""

    params: tuple[Decision | None, ...]
    result: tuple[Decision | None, ...]  # one per result tensor (tuple results: per field)


class FunctionAnalysis:
    """Solve the shardings of one function for one signature.

    Parameters
    ----------
    program : ProgramAnalysis
        The module-wide analysis (for calls, memoisation and meshes).
    name : str
        The function's name.
    func : relax.Function
    params : sequence of Decision or None
        Shardings fixed by the caller, one per parameter (None: free).
    finalize : bool
        Replicate whatever stays unknown (on the function's home mesh), so that
        every tensor is decided. Summaries for callers are computed without it.
    """

    def __init__(
        self,
        program: "ProgramAnalysis",
        name: str,
        func: relax.Function,
        params: Sequence[Decision | None],
        finalize: bool,
    ) -> None:
        self.program = program
        self.name = name
        self.func = func
        self.decisions: dict[tuple[relax.Var, int], Decision] = {}
        self.bindings = list(self._flatten(func))
        self.defs: dict[relax.Var, int] = {b.var: b.index for b in self.bindings}
        self.users: dict[relax.Var, list[int]] = {}
        for b in self.bindings:
            for var in _vars_in(b.value):
                self.users.setdefault(var, []).append(b.index)
        self._queue: list[int] = []
        self._queued: set[int] = set()
        # operator bindings waiting for a use to decide how a partial sum is completed
        self._deferred: set[int] = set()
        # operator bindings that only replicated values reached so far (see _operator)
        self._waiting: set[int] = set()

        for param, given in zip(func.params, params):
            typed = TensorSharding.from_type(param.ty)
            if typed is not None:
                self._set(param, 0, Decision(typed, Strength.SOURCE, "declared R.DTensor type"))
            elif given is not None:
                self._set(param, 0, given)
        for b in self.bindings:
            # Sources: annotations, and calls, whose callees may hold annotations.
            if (_ir.is_call_to(b.value, _ANNOTATE) or _ir.is_call_to(b.value, _REDISTRIBUTE)
                    or self._is_function_call(b.value)):
                self._push(b.index)
        self._solve()
        self._resolve_deferred()
        if finalize:
            self._default_unknowns()

    # -- structure ---------------------------------------------------------------
    def _flatten(self, func: relax.Function) -> Iterator[_Binding]:
        body = func.body
        if not isinstance(body, relax.SeqExpr):
            return
        index = 0
        for block in body.blocks:
            for binding in block.bindings:
                value = binding.value
                if isinstance(value, (relax.If, relax.Function, relax.SeqExpr)):
                    raise UnsupportedProgramError(
                        f"{type(value).__name__} inside a function is not supported by "
                        "sharding propagation yet",
                        function=self.name,
                        var=binding.var.name,
                        hint="move the branch or the inner function into a separate "
                        "private function, or inline it",
                    )
                cast = binding.ty if isinstance(binding, relax.MatchCast) else None
                yield _Binding(index, binding.var, value, cast)
                index += 1

    def tensor_slots(self, var: relax.Var) -> int:
        """How many tensors a value holds (1, the fields of a tuple, or 0)."""
        ty = var.ty
        if _ir.is_tensor_type(ty):
            return 1
        if isinstance(ty, relax.TupleType):
            return len(ty.fields)
        return 0

    # -- decisions -------------------------------------------------------------
    def get(self, var: relax.Expr, slot: int = 0) -> Decision | None:
        """The decision for a value (``slot``: tuple field), None when unknown."""
        if not isinstance(var, relax.Var):
            return None
        return self.decisions.get((var, slot))

    def _set(self, var: relax.Var, slot: int, decision: Decision) -> bool:
        key = (var, slot)
        if key in self.decisions:
            return False
        self.decisions[key] = decision
        if var in self.defs:
            self._push(self.defs[var])
        for user in self.users.get(var, ()):
            self._push(user)
        return True

    def _push(self, index: int) -> None:
        if index not in self._queued:
            self._queued.add(index)
            heapq.heappush(self._queue, index)

    def _solve(self) -> None:
        while self._queue:
            index = heapq.heappop(self._queue)
            self._queued.discard(index)
            self._step(self.bindings[index])

    def _resolve_deferred(self) -> None:
        """Decide the deferred and waiting operators that nothing else decided, in order."""
        while self._deferred or self._waiting:
            index = min(self._deferred | self._waiting)
            self._deferred.discard(index)
            self._waiting.discard(index)
            b = self.bindings[index]
            self._operator(b, b.value, defer=False)
            self._solve()

    def _default_unknowns(self) -> None:
        home = self.home_mesh()
        if home is None:
            return
        while True:
            missing = next(self._unknown_values(), None)
            if missing is None:
                return
            var, slot = missing
            self._set(
                var,
                slot,
                Decision(replicated(home), Strength.DEFAULT,
                         "no annotation reaches it: replicated by default"),
            )
            self._solve()

    def _unknown_values(self) -> Iterator[tuple[relax.Var, int]]:
        for var in list(self.func.params) + [b.var for b in self.bindings]:
            for slot in range(self.tensor_slots(var)):
                if _tensor_field(var.ty, slot) and (var, slot) not in self.decisions:
                    yield var, slot

    def home_mesh(self) -> DeviceMesh | None:
        """The mesh of the strongest decision in the function (first in program order)."""
        best = None
        for var in list(self.func.params) + [b.var for b in self.bindings]:
            for slot in range(self.tensor_slots(var)):
                d = self.decisions.get((var, slot))
                if d is not None and (best is None or d.strength > best.strength):
                    best = d
        return best.sharding.mesh if best is not None else None

    def is_sharded(self) -> bool:
        """True when any value of the function has a decision."""
        return bool(self.decisions)

    def result_decisions(self) -> tuple[Decision | None, ...]:
        body = self.func.body.body if isinstance(self.func.body, relax.SeqExpr) else None
        if isinstance(body, relax.Var):
            return tuple(self.get(body, s) for s in range(self.tensor_slots(body)))
        if isinstance(body, relax.Tuple):
            return tuple(self.get(f) if isinstance(f, relax.Var) else None for f in body.fields)
        return ()

    def summary(self) -> CallSummary:
        return CallSummary(
            params=tuple(self.get(p) if self.tensor_slots(p) == 1 else None
                         for p in self.func.params),
            result=self.result_decisions(),
        )

    # -- one binding ---------------------------------------------------------------
    def _step(self, b: _Binding) -> None:
        value = b.value
        if isinstance(value, relax.Var):
            self._alias(b.var, value, f"alias of '{value.name}'")
        elif isinstance(value, relax.TupleGetItem):
            self._tuple_get(b, value)
        elif isinstance(value, relax.Tuple):
            self._tuple(b, value)
        elif isinstance(value, relax.Call):
            if _ir.is_call_to(value, _ANNOTATE) or _ir.is_call_to(value, _REDISTRIBUTE):
                self._annotation(b, value)
            elif self._is_function_call(value):
                self._call(b, value)
            elif _ir.kv_builtin(value) is not None:
                self._kv_cache(b, value)
            else:
                self._operator(b, value)

    def _is_function_call(self, value) -> bool:
        return (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.GlobalVar)
                and isinstance(self.program.mod[value.op], relax.Function))

    def _alias(self, var: relax.Var, source: relax.Var, reason: str) -> None:
        for slot in range(self.tensor_slots(var)):
            mine, theirs = self.get(var, slot), self.get(source, slot)
            if mine is None and theirs is not None:
                self._set(var, slot, Decision(theirs.sharding, theirs.strength, reason))
            elif theirs is None and mine is not None:
                self._set(source, slot, Decision(mine.sharding, Strength.PROPAGATED,
                                                 f"used as '{var.name}'"))

    def _tuple_get(self, b: _Binding, value: relax.TupleGetItem) -> None:
        source = value.tuple_value
        if not isinstance(source, relax.Var) or self.tensor_slots(b.var) != 1:
            return
        mine, theirs = self.get(b.var), self.get(source, value.index)
        if mine is None and theirs is not None:
            self._set(b.var, 0, Decision(theirs.sharding, theirs.strength,
                                         f"field {value.index} of '{source.name}'"))
        elif theirs is None and mine is not None:
            self._set(source, value.index, Decision(mine.sharding, Strength.PROPAGATED,
                                                    f"field {value.index} used as '{b.var.name}'"))

    def _tuple(self, b: _Binding, value: relax.Tuple) -> None:
        for slot, item in enumerate(value.fields):
            if not isinstance(item, relax.Var) or self.tensor_slots(item) != 1:
                continue
            mine, theirs = self.get(b.var, slot), self.get(item)
            if mine is None and theirs is not None:
                self._set(b.var, slot, Decision(theirs.sharding, theirs.strength,
                                                f"'{item.name}' in a tuple"))
            elif theirs is None and mine is not None:
                self._set(item, 0, Decision(mine.sharding, Strength.PROPAGATED,
                                            f"field {slot} of tuple '{b.var.name}'"))

    def _annotation(self, b: _Binding, call: relax.Call) -> None:
        mesh = self.program.meshes.lookup(call.attrs.device_mesh)
        placement = Placement.from_tvm(call.attrs.placement)
        what = "annotate_sharding" if _ir.is_call_to(call, _ANNOTATE) else "redistribute"
        # written in the IR directly, it has not been checked yet (TVM accepts "S[2]"
        # on a 2-D mesh); checked before the TensorSharding is built, to name the site.
        # () is a scalar's shape, not an unknown one: a scalar cannot be sharded
        placement.validate(mesh, _ir.static_shape(b.var.ty), function=self.name, var=b.var.name)
        sharding = TensorSharding(mesh, placement)
        self._set(b.var, 0, Decision(sharding, Strength.SOURCE, f"{what} {sharding} in '{self.name}'"))
        source = call.args[0]
        if what == "annotate_sharding" and isinstance(source, relax.Var):
            self._set(source, 0, Decision(sharding, Strength.PROPAGATED,
                                          f"annotated as '{b.var.name}'"))

    def operands_of(self, call: relax.Call) -> tuple[OpSignature | None, list[relax.Expr]]:
        """The call's signature and its tensor operands."""
        try:
            sig = op_signature(call, self.program.mod)
        except RuleError as err:  # a user's rule that does not fit: say where
            raise RuleError(err.message, function=self.name, hint=err.hint) from None
        if sig is not None:
            return sig, list(sig.operands)
        return None, [a for a in _flat_args(call) if _ir.is_tensor_type(a.ty)]

    def _operator(self, b: _Binding, call: relax.Call, defer: bool = True) -> None:
        sig, operands = self.operands_of(call)
        outputs = [(b.var, s) for s in range(self.tensor_slots(b.var))]
        known = [self.get(o) for o in operands] + [self.get(v, s) for v, s in outputs]
        what = call.op.name if isinstance(call.op, tvm.ir.Op) else "call"
        check_single_home(known, [_name(o) for o in operands] + [v.name for v, _ in outputs],
                          function=self.name, site=f"{what} at '{b.var.name}'")
        if sig is None:
            plan = replicated_plan(known, len(operands), len(outputs))
            reason = f"{what} has no sharding rule: replicated"
        else:
            shapes = [_ir.static_shape(o.ty) for o in operands] + [
                _ir.static_shape(_field_type(v.ty, s)) for v, s in outputs
            ]
            plan = decide_operands(sig, known, shapes)
            reason = f"{what} at '{b.var.name}'"
            if plan is not None and plan.choice:
                reason += f" ({plan.choice})"
        if plan is None:
            return
        if defer and sig is not None and completes_a_partial_sum(plan, known[:len(operands)],
                                                                  known[len(operands):]):
            self._deferred.add(b.index)
            return
        if defer and sig is not None and only_replicated(known):
            # a replicated operand says nothing about the others (it can be sliced
            # locally): wait for a split to reach the call from elsewhere (an
            # annotation further down, say) before replicating the unknown ones
            self._waiting.add(b.index)
            return
        self._deferred.discard(b.index)
        self._waiting.discard(b.index)
        for operand, needed in zip(operands, plan.operands):
            if isinstance(operand, relax.Var) and self.get(operand) is None:
                self._set(operand, 0, Decision(needed, Strength.PROPAGATED, f"operand of {reason}"))
        strength = relayout_strength(sig, known[:len(operands)])
        for (var, slot), produced, partial in zip(outputs, plan.outputs,
                                                  plan.partial or ((),) * len(outputs)):
            existing = self.get(var, slot)
            if existing is None:
                self._set(var, slot, Decision(produced, strength,
                                              f"result of {reason}" + partial_note(partial),
                                              partial))
            elif partial and not existing.partial and existing.sharding == produced:
                # decided by a use first; the operator still leaves a partial sum
                self.decisions[(var, slot)] = Decision(
                    existing.sharding, existing.strength, existing.reason + partial_note(partial),
                    partial)

    def kv_sources(self, cache: relax.Expr) -> list[relax.Var]:
        """The tensors written into the KV cache object ``cache`` in this function, latest first.

        Each append adds its value to the cache it is given; a cache created by
        ``vm.builtin.attention_kv_cache_create`` starts with its initial data. A
        cache from a parameter has no sources.
        """
        sources: list[relax.Var] = []
        while isinstance(cache, relax.Var) and cache in self.defs:
            value = self.bindings[self.defs[cache]].value
            builtin = _ir.kv_builtin(value)
            if builtin is None or builtin[0] == "view":
                break
            written = value.args[1] if builtin[0] == "append" else value.args[0]
            if isinstance(written, relax.Var):
                sources.append(written)
            if builtin[0] == "create":
                break
            cache = value.args[0]
        return sources

    def kv_cache_sharding(self, cache: relax.Expr) -> TensorSharding | None:
        """What each rank's part of the cache ``cache`` holds: its sources' sharding, whole rows.

        The cache grows along dimension 0 (the sequence): a rank's shard of it
        must be a block of whole rows, so a split of dimension 0 is gathered
        before the append. Every source is moved to this sharding.
        """
        for source in self.kv_sources(cache):
            decision = self.get(source)
            if decision is not None:
                return kv_rows_whole(decision.sharding)
        return None

    def _kv_cache(self, b: _Binding, call: relax.Call) -> None:
        """TVM's KV-cache builtins: a view holds what was written into its cache.

        A create or an append gives a cache object (no tensor): the tensors
        written into one cache all get the sharding of the first one decided,
        and the users of the object (views, later appends) are looked at again.
        A view gets that sharding; a view decided first (by a use) decides the
        latest tensor written. A cache that nothing in the function writes (a
        parameter) is whatever the view's uses want, as in TVM.
        """
        role = _ir.kv_builtin(call)[0]
        if role != "view":
            held = self.kv_cache_sharding(b.var)
            if held is not None:
                sources = self.kv_sources(b.var)
                first = next(s for s in sources if self.get(s) is not None)
                for source in sources:
                    if self.get(source) is None:
                        self._set(source, 0, Decision(
                            held, Strength.PROPAGATED,
                            f"written into the KV cache that '{first.name}' is written into"))
            for user in self.users.get(b.var, ()):
                self._push(user)
            return
        sources = self.kv_sources(call.args[0])
        if not sources:
            return
        held, mine = self.kv_cache_sharding(call.args[0]), self.get(b.var)
        if mine is None and held is not None:
            written = next(s for s in sources if self.get(s) is not None)
            self._set(b.var, 0, Decision(held, self.get(written).strength,
                                         f"view of the cache '{written.name}' is written into"))
        elif held is None and mine is not None:
            self._set(sources[0], 0, Decision(mine.sharding, Strength.PROPAGATED,
                                              f"written into the cache viewed as '{b.var.name}'"))

    def _call(self, b: _Binding, call: relax.Call) -> None:
        callee = call.op.name_hint
        args = list(call.args)
        known = [self.get(a) if isinstance(a, relax.Var) and self.tensor_slots(a) == 1 else None
                 for a in args]
        check_single_home(known, [_name(a) for a in args], function=self.name,
                          site=f"the call of '{callee}' at '{b.var.name}'")
        passed = self.program.call_signature(known, call_site(b.var, self.name))
        summary = self.program.summary(callee, passed, caller=self.name)
        for arg, param in zip(args, summary.params):
            if isinstance(arg, relax.Var) and param is not None and self.get(arg) is None:
                self._set(arg, 0, Decision(param.sharding, Strength.PROPAGATED,
                                           f"parameter of '{callee}' called at '{b.var.name}'"))
        for slot, result in enumerate(summary.result):
            if result is not None and self.get(b.var, slot) is None:
                self._set(b.var, slot, Decision(result.sharding, Strength.PROPAGATED,
                                                f"result of '{callee}'"))


def kv_rows_whole(sharding: TensorSharding) -> TensorSharding:
    """``sharding`` with dimension 0 (a KV cache's growing axis) replicated."""
    entries = [Replicate() if e.is_shard(0) else e for e in sharding.placement.entries]
    return TensorSharding(sharding.mesh, Placement(tuple(entries)))


def call_site(var: relax.Var, function: str) -> str:
    """How messages and reasons name a call site."""
    return f"the call at '{var.name}' in '{function}'"


def _name(expr: relax.Expr) -> str:
    return expr.name if isinstance(expr, relax.Var) else type(expr).__name__.lower()


def _flat_args(call: relax.Call) -> list[relax.Expr]:
    out = []
    for arg in call.args:
        if isinstance(arg, relax.Tuple):
            out.extend(arg.fields)
        else:
            out.append(arg)
    return out


def _vars_in(expr: relax.Expr) -> list[relax.Var]:
    found = []
    if isinstance(expr, relax.Var):
        found.append(expr)
    elif isinstance(expr, relax.Call):
        for arg in expr.args:
            found.extend(_vars_in(arg))
    elif isinstance(expr, relax.Tuple):
        for item in expr.fields:
            found.extend(_vars_in(item))
    elif isinstance(expr, relax.TupleGetItem):
        found.extend(_vars_in(expr.tuple_value))
    return found


def _field_type(ty, slot: int):
    if isinstance(ty, relax.TupleType):
        return ty.fields[slot]
    return ty


def _tensor_field(ty, slot: int) -> bool:
    return _ir.is_tensor_type(_field_type(ty, slot))


# --------------------------------------------------------------------------- the program
class ProgramAnalysis:
    """Module-wide sharding analysis with memoised callee specialisation.

    Parameters
    ----------
    mod : tvm.IRModule
        The annotated global-view module.
    """

    def __init__(self, mod: tvm.IRModule) -> None:
        self.mod = mod
        self.meshes = MeshTable(mod)
        self._summaries: dict[tuple, CallSummary] = {}
        self._finals: dict[tuple, FunctionAnalysis] = {}
        self._stack: list[str] = []

    def mesh_named(self, mesh: DeviceMesh) -> DeviceMesh:
        """The module's own (named) mesh equal to ``mesh``, or ``mesh`` itself."""
        return self.meshes.named(mesh)

    @staticmethod
    def call_signature(known: Sequence[Decision | None],
                       site: str = "its call site") -> tuple[Decision | None, ...]:
        """The argument decisions passed into a callee, homed on one mesh.

        The strongest known argument (first on ties) names the home mesh.
        Arguments on other meshes are not passed in: the callee decides them
        on its home mesh and the caller redistributes.
        """
        decided = [(i, d) for i, d in enumerate(known) if d is not None]
        if not decided:
            return tuple(known)
        home = max(decided, key=lambda item: (int(item[1].strength), -item[0]))[1].sharding.mesh
        passed = []
        for d in known:
            if d is None or d.sharding.mesh != home:
                passed.append(None)
            else:
                passed.append(Decision(d.sharding, Strength.SOURCE,
                                       f"signature of this version, from {site}"))
        return tuple(passed)

    def _key(self, callee: str, passed: Sequence[Decision | None]) -> tuple:
        return (callee, tuple(d.sharding if d is not None else None for d in passed))

    def _function(self, callee: str, caller: str | None) -> relax.Function:
        try:
            func = self.mod[callee]
        except (KeyError, ValueError, tvm.error.TVMError):
            raise CallGraphError(f"call of unknown function '{callee}'", function=caller) from None
        return func

    def _enter(self, callee: str, caller: str | None) -> None:
        if callee in self._stack:
            cycle = " -> ".join(self._stack[self._stack.index(callee):] + [callee])
            raise CallGraphError(
                f"recursive call cycle {cycle}; sharding propagation needs an acyclic call graph",
                function=caller,
                hint="unroll the recursion, or shard the recursive function by hand with "
                "R.DTensor types",
            )
        self._stack.append(callee)

    def summary(self, callee: str, passed: Sequence[Decision | None],
                caller: str | None = None) -> CallSummary:
        """What ``callee`` says about its parameters and result, given ``passed``."""
        key = self._key(callee, passed)
        if key not in self._summaries:
            func = self._function(callee, caller)
            self._enter(callee, caller)
            try:
                analysis = FunctionAnalysis(self, callee, func, passed, finalize=False)
            finally:
                self._stack.pop()
            self._summaries[key] = analysis.summary()
        return self._summaries[key]

    def final(self, name: str, passed: Sequence[Decision | None]) -> FunctionAnalysis:
        """The complete analysis of ``name`` for one signature (every value decided)."""
        key = self._key(name, passed)
        if key not in self._finals:
            func = self._function(name, None)
            self._enter(name, None)
            try:
                self._finals[key] = FunctionAnalysis(self, name, func, passed, finalize=True)
            finally:
                self._stack.pop()
        return self._finals[key]
