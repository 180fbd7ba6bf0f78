"""``quantize``: weights stored in a smaller format, decoded where each one is read.

Decoding a token reads every weight a rank holds once, so its time is the
weights' bytes. :func:`quantize` stores weights in one of the formats of
:mod:`tvm_distx.sources.formats` (16-bit floats, or int8/int4 groups of 32
values with a float16 scale each) and decodes them **in the program**, as Relax
operators, right before each use::

    w_decoded = reshape(astype(w, "float32"), (m, k/32, 32)) * reshape(astype(w_scale,
                "float32"), (m, k/32, 1))     # q8; q4 unpacks two nibbles per byte first
    y = matmul(x, permute_dims(reshape(w_decoded, (m, k))))

Three things follow from writing the decoding as operators:

* **Sharding needs nothing new.** Propagation reads the decode like any other
  operators: a column-parallel weight ``S[0]`` splits its scales by rows, a
  row-parallel ``S[1]`` splits its groups (the scales' axis 1 is the group
  index). An annotation on the weight is moved onto its stored parts, which
  share its placement. Where a split of the last axis would cut a group, the
  error names the weight, the group size and the rank count.
* **Every use decodes for itself.** A table read by a lookup and by a tied LM
  head gets one decode per use, so that each is fused into its kernel (the
  lookup decodes only the rows it reads; the matrix-vector kernel decodes each
  group in registers) and no float copy of a weight is ever made.
* **Arithmetic stays float32.** Only the stored bytes change; activations,
  caches and sums are what they were.

The weights given with the module become the stored parts: the data part keeps
the weight's name, the scale part is ``<name>_scale``. A value that is a float
array (or a lazy checkpoint tensor) becomes :class:`~tvm_distx.sources.formats.EncodedPart`
objects: nothing is encoded until a rank's block is read, so each rank encodes
only its own slice. A value already encoded (an object with ``format`` and
``parts``, as a GGUF file's tensors are) is used as stored.

Which weights are quantized: every 2-D float weight whose last axis is its
reduction axis (a linear's ``(out, in)`` weight read through ``permute_dims``,
or a table read by lookups) and a multiple of the group; the others keep their
dtype, or take ``dtype=``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from tvm_distx.sources.formats import FORMATS, EncodedPart, WeightFormat, weight_format
from tvm_distx.errors import ArgumentError
from tvm_distx.ir import helpers as _ir
from tvm_distx.layout.derived import is_deferred
from tvm_distx.layout.mesh import DeviceMesh
from tvm_distx.layout.placement import Placement, Shard

__all__ = ["quantize", "weight_formats", "SCALE_SUFFIX"]

logger = logging.getLogger(__name__)

#: The name of a weight's scale part: ``<weight><SCALE_SUFFIX>``.
SCALE_SUFFIX = "_scale"
_ANNOTATE = "relax.dist.annotate_sharding"
#: Module attribute recording each stored weight's format: ``{param: format}``.
FORMATS_ATTR = "tvm_distx.weight_formats"


@dataclass(frozen=True)
class _Stored:
    """How one weight parameter is stored (internal)."""

    name: str
    fmt: WeightFormat
    shape: tuple[int, ...]
    dtype: str            # the dtype the program computes with (the original param's)
    data: relax.Var
    scale: relax.Var | None


def quantize(mod: tvm.IRModule, weights: Mapping, fmt="q8", *, dtype: str | None = None,
             functions=None) -> tuple[tvm.IRModule, dict]:
    """Store ``mod``'s weights in ``fmt`` and decode them in the program where they are read.

    Parameters
    ----------
    mod : tvm.IRModule
        A module whose functions take the weights as parameters (by the names of
        ``weights``), annotated with shardings or not.
    weights : mapping of str to array
        The weights by parameter name: float arrays, lazy checkpoint tensors, or
        values already encoded (with ``format`` and ``parts``).
    fmt : str or mapping of str to str
        ``"q8"``, ``"q4"``, ``"bf16"``, ``"f16"`` or ``"f32"``: the format of
        the weights it suits (see the module doc). A mapping gives each weight's
        format by name (the others keep theirs, or take ``dtype``).
    dtype : str, optional
        The 16-bit format of every other float weight (``"bf16"`` or ``"f16"``;
        norms, biases, weights whose last axis is no multiple of the group).
        By default a 16-bit ``fmt`` applies to every float weight and a
        quantized one leaves the others as they are.
    functions : sequence of str, optional
        The functions to rewrite; every function that takes a weight by default.

    Returns
    -------
    (tvm.IRModule, dict)
        The module, whose weight parameters are the stored parts, and the
        weights for it by parameter name.

    Raises
    ------
    ArgumentError
        For an unknown format, a weight that cannot be stored in it, or a split
        of a quantized weight that would cut its groups.

    Examples
    --------
    >>> mod, weights = td.quantize(annotated, weights, "q4", dtype="bf16")   # doctest: +SKIP
    >>> exe = td.compile(mod)                                                # doctest: +SKIP
    """
    explicit = fmt if isinstance(fmt, Mapping) else None
    default = None if explicit is not None else weight_format(fmt, "quantize(fmt")
    rest = weight_format(dtype, "quantize(dtype") if dtype is not None else (
        default if default is not None and not default.quantized else None)
    if rest is not None and rest.quantized:
        raise ArgumentError(f"quantize(dtype={dtype!r}): the other weights take a float format",
                            hint='quantize(mod, weights, "q4", dtype="bf16")')
    funcs = {gv: f for gv, f in _ir.relax_functions(mod)
             if functions is None or gv.name_hint in functions}
    order = _callers_first(funcs)
    chosen, stored_in, inherited = _choose_formats(funcs, order, weights, explicit, default,
                                                   rest)
    passes = {gv: {i for i, p in enumerate(funcs[gv].params) if p in stored_in.get(gv, {})
                   and (gv, i) in inherited} for gv in funcs}
    _check_calls(funcs, stored_in, passes)
    out, renamed = mod, {}
    for gv in reversed(order):  # callees first: a caller's call then meets their new parameters
        if stored_in.get(gv):
            out, renamed[gv] = _Decode(out, gv, stored_in[gv], passes, renamed).run(out[gv])
    out = _with_global_vars(out, renamed)
    new_weights = dict(weights)
    for name, f in chosen.items():
        for part, value in _parts(name, weights[name], f).items():
            new_weights[name if part == "data" else name + SCALE_SUFFIX] = value
    counted = {f.name: sum(1 for c in chosen.values() if c == f) for f in chosen.values()}
    logger.info("quantize: %s", ", ".join(f"{n} weights {k}" for k, n in counted.items())
                or "no weight to store differently")
    formats = dict(weight_formats(out))
    formats.update({name: f.name for name, f in chosen.items() if f.name != "f32"})
    return out.with_attr(FORMATS_ATTR, formats), new_weights


def _choose_formats(funcs: dict, order: list, weights: Mapping, explicit, default, rest):
    """Each function's stored weight parameters, callers before callees.

    A parameter named in ``weights`` takes the format its reads suit (see
    :func:`_choose`); a parameter a caller passes a stored weight to takes that
    weight's format. Returns ``(chosen, stored_in, inherited)``: the format of
    each weight by name, ``{function: {param: _Stored}}``, and ``{(callee,
    index): (format, the caller's weight)}``.
    """
    uses_of = _CalleeUses(funcs)
    chosen: dict[str, WeightFormat] = {}            # by weight name
    inherited: dict[tuple, tuple] = {}              # (callee, index) -> (format, from where)
    stored_in: dict = {}                            # function -> {param: _Stored}
    for gv in order:
        func = funcs[gv]
        named = {p: p for p in func.params if p.name in weights and _is_float(p)}
        uses = _weight_uses(func, named, uses_of)
        formats: dict = {}
        for param, use in uses.items():
            choice = _choose(param, use, weights[param.name], explicit, default, rest)
            if choice is None:
                continue
            if chosen.setdefault(param.name, choice) != choice:
                raise ArgumentError(f"weight '{param.name}' is read differently by two "
                                    "functions, so it takes no single format",
                                    hint="give it a format in a mapping: quantize(mod, weights, "
                                    f"{{'{param.name}': 'f32'}})")
            formats[param] = choice
        for index, param in enumerate(func.params):
            passed = inherited.get((gv, index))
            if passed is None:
                continue
            if param in formats and formats[param] != passed[0]:
                raise ArgumentError(
                    f"parameter '{param.name}' of function '{gv.name_hint}' is given weight "
                    f"'{passed[1]}' in {passed[0].name} but would be stored in "
                    f"{formats[param].name} by its own name",
                    hint="give both the same format in a mapping: quantize(mod, weights, "
                    f"{{'{param.name}': ..., '{passed[1]}': ...}})")
            formats[param] = passed[0]
        stored = {p: _stored(p, f) for p, f in formats.items() if not _unchanged(p, f)}
        for var, call in _annotations(func):
            if call.args[0] in stored:
                _check_groups(gv.name_hint, stored[call.args[0]], var.name, call)
        for callee, index, arg in _passed_weights(func, funcs):
            if arg not in stored:
                continue
            fmt, before = stored[arg].fmt, inherited.get((callee, index))
            if before is not None and before[0] != fmt:
                raise ArgumentError(
                    f"function '{callee.name_hint}' takes weights of two formats as its "
                    f"parameter {index}: '{before[1]}' ({before[0].name}) and '{arg.name}' "
                    f"({fmt.name})", hint="give them one format in a mapping: quantize(mod, "
                    f"weights, {{'{before[1]}': '{fmt.name}', '{arg.name}': '{fmt.name}'}})")
            inherited[(callee, index)] = (fmt, arg.name)
        stored_in[gv] = stored
    return chosen, stored_in, inherited


def weight_formats(mod: tvm.IRModule) -> dict[str, str]:
    """The format of each weight :func:`quantize` stored, by parameter name (``{}``: none)."""
    attrs = mod.attrs
    if attrs is None or FORMATS_ATTR not in attrs:
        return {}
    return {str(k): str(v) for k, v in attrs[FORMATS_ATTR].items()}


# ---------------------------------------------------------------------- choosing formats
def _is_float(param: relax.Var) -> bool:
    return _ir.is_tensor_type(param.ty) and str(param.ty.dtype).startswith(("float", "bfloat"))


def _weight_uses(func: relax.Function, params, uses_of: "_CalleeUses") -> dict[relax.Var, str]:
    """Each of ``params`` (weight parameters of ``func``) and how it is read.

    ``"reduce-last"``: every read (through its annotation) is a ``permute_dims``
    feeding a matmul as its right operand, a lookup, or a reshape (the blocks of
    a vocabulary-parallel table), so its last axis is what a linear sums over or
    what a lookup returns; a weight passed to another function of the module is
    read as that function reads its parameter. ``"other"`` otherwise.
    """
    values, users = {}, {}
    for block in func.body.blocks:
        for b in block.bindings:
            values[b.var] = b.value
            for v in _ir.operand_vars(b.value):
                users.setdefault(v, []).append(b.var)
    uses = {}
    for param in params:
        reads, seen = [], [param]
        while seen:
            var = seen.pop()
            for user in users.get(var, []):
                if _ir.is_call_to(values[user], _ANNOTATE):
                    seen.append(user)
                else:
                    reads.append((var, values[user]))
        last = len(_ir.static_shape(param.ty) or ()) == 2 and reads and all(
            _reads_last_axis(r, users, values) if not uses_of.is_call(r) else
            all(uses_of(r.op, i) == "reduce-last" for i, a in enumerate(r.args) if a.same_as(v))
            for v, r in reads)
        uses[param] = "reduce-last" if last else "other"
    return uses


class _CalleeUses:
    """How each function of the module reads each of its parameters (memoized)."""

    def __init__(self, funcs: dict) -> None:
        self.funcs, self.memo = funcs, {}

    def is_call(self, value) -> bool:
        """A call of one of the module's functions (a weight passed on, not read)."""
        return isinstance(value, relax.Call) and value.op in self.funcs

    def __call__(self, gv, index: int) -> str:
        key = (gv, index)
        if key not in self.memo:
            self.memo[key] = "other"  # a recursive call reads it as "other"
            param = self.funcs[gv].params[index]
            self.memo[key] = _weight_uses(self.funcs[gv], [param], self)[param]
        return self.memo[key]


def _callers_first(funcs: dict) -> list:
    """The functions, each before every function it calls (cycles broken by name order)."""
    calls = {gv: {c for c, _, _ in _passed_weights(f, funcs, every=True)}
             for gv, f in funcs.items()}
    order, placed = [], set()

    def called_by_unplaced(gv) -> bool:
        return any(gv in callees for caller, callees in calls.items()
                   if caller not in placed and caller != gv)

    pending = sorted(funcs, key=lambda g: g.name_hint)
    while pending:
        ready = [g for g in pending if not called_by_unplaced(g)] or pending[:1]
        for gv in ready:
            order.append(gv)
            placed.add(gv)
        pending = [g for g in pending if g not in placed]
    return order


def _passed_weights(func: relax.Function, funcs: dict, every: bool = False):
    """``(callee, index, parameter)`` for each parameter of ``func`` (or its annotation)
    passed as argument ``index`` of a call to a module function (``every``: any argument,
    parameter or not, with ``None``)."""
    origin = {p: p for p in func.params}
    for block in func.body.blocks:
        for b in block.bindings:
            value = b.value
            if _ir.is_call_to(value, _ANNOTATE) and value.args[0] in origin:
                origin[b.var] = origin[value.args[0]]
            if isinstance(value, relax.Call) and value.op in funcs:
                for index, arg in enumerate(value.args):
                    if arg in origin or every:
                        yield value.op, index, origin.get(arg)


def _annotations(func: relax.Function):
    """The ``(var, call)`` of every sharding annotation of a parameter in ``func``."""
    for block in func.body.blocks:
        for b in block.bindings:
            if _ir.is_call_to(b.value, _ANNOTATE) and b.value.args[0] in func.params:
                yield b.var, b.value


def _reads_last_axis(call, users, values) -> bool:
    if _ir.is_call_to(call, "relax.take"):
        return int(call.attrs.axis) == 0
    if _ir.is_call_to(call, "relax.reshape"):
        return True
    if _ir.is_call_to(call, "relax.permute_dims"):
        axes = call.attrs.axes
        return axes is None or [int(a) for a in axes] == [1, 0]
    return False


def _choose(param: relax.Var, use: str, value, explicit, default, rest) -> WeightFormat | None:
    """The format ``param`` is stored in, or None to leave it as it is."""
    shape = tuple(int(d) for d in _ir.static_shape(param.ty) or ())
    if hasattr(value, "parts") and hasattr(value, "format"):  # stored already: as it is
        return weight_format(value.format, f"the format of '{param.name}'")
    if explicit is not None:
        if param.name not in explicit:
            return rest
        choice = weight_format(explicit[param.name], f"the format of '{param.name}'")
        choice.check_shape(param.name, shape)
        return choice
    if default.quantized and (use != "reduce-last" or shape[-1] % default.group):
        return rest
    return default if default.name != "f32" or rest is None else rest


def _unchanged(param: relax.Var, fmt: WeightFormat) -> bool:
    """Whether storing ``param`` in ``fmt`` leaves the program as it is (float32 as float32)."""
    return fmt.name == "f32" and str(param.ty.dtype) == "float32"


def _stored(param: relax.Var, fmt: WeightFormat) -> _Stored:
    shape = tuple(int(d) for d in _ir.static_shape(param.ty) or ())
    if None in shape:
        raise ArgumentError(f"weight '{param.name}' has a symbolic shape; only static weights "
                            "are stored in another format", hint="leave it out of the mapping")
    data = relax.Var(param.name, relax.TensorType(fmt.part_shape("data", shape),
                                                  fmt.data_dtype))
    scale = (relax.Var(param.name + SCALE_SUFFIX,
                       relax.TensorType(fmt.part_shape("scale", shape), "float16"))
             if fmt.quantized else None)
    return _Stored(param.name, fmt, shape, str(param.ty.dtype), data, scale)


def _parts(name: str, value, fmt: WeightFormat) -> dict:
    """The stored parts of weight ``name`` given ``value``."""
    if hasattr(value, "parts") and hasattr(value, "format"):
        return dict(value.parts)
    if fmt.name == "f32" and np.dtype(getattr(value, "dtype", "float32")) == np.float32:
        return {"data": value}
    if not fmt.quantized and is_deferred(value) and hasattr(value, "astype"):
        # a checkpoint's tensor read in the 16-bit dtype (as it is stored, for a bfloat16
        # checkpoint served in bfloat16): a rank's link then reads its block as it is
        return {"data": value.astype(fmt.part_dtype("data"))}
    return {part: EncodedPart(value, fmt, part) for part in fmt.parts}


def _check_groups(function: str, s: _Stored, var: str, call: relax.Call) -> None:
    """A split of a quantized weight's last axis must hold whole groups on every rank."""
    if not s.fmt.quantized:
        return
    mesh = DeviceMesh.from_tvm(call.attrs.device_mesh)
    placement = Placement.from_tvm(call.attrs.placement)
    last = len(s.shape) - 1
    parts = 1
    for axis, entry in enumerate(placement.entries):
        if isinstance(entry, Shard) and entry.dim == last:
            parts *= mesh.shape[axis]
    groups = s.shape[last] // s.fmt.group
    if groups % parts:
        raise ArgumentError(
            f"in function '{function}', weight '{s.name}' ({s.fmt.name}, groups of "
            f"{s.fmt.group}) is annotated {placement} at '{var}': its {s.shape[last]} "
            f"inputs are {groups} groups, which {parts} ranks cannot split without cutting one",
            hint=f"split '{s.name}' on its rows (S[0]), run it on a rank count that divides "
            f"{groups}, or leave it out of the quantization")


def _check_calls(funcs: dict, stored_in: dict, passes: dict) -> None:
    """Every call passes a stored parameter of a function a weight stored in its format."""
    for gv, func in funcs.items():
        for callee, index, arg in _passed_weights(func, funcs, every=True):
            if index not in passes.get(callee, ()):
                continue
            want = stored_in[callee][funcs[callee].params[index]]
            got = stored_in.get(gv, {}).get(arg) if arg is not None else None
            if got is None or got.fmt != want.fmt:
                raise ArgumentError(
                    f"function '{gv.name_hint}' calls '{callee.name_hint}' with "
                    f"{'a value' if arg is None else repr(arg.name)} as parameter "
                    f"'{want.name}', which takes a weight stored in {want.fmt.name}",
                    hint="pass weights of one format in that position, or leave "
                    f"'{callee.name_hint}' out: quantize(..., functions=[...])")


def _with_global_vars(mod: tvm.IRModule, renamed: dict) -> tvm.IRModule:
    """``mod`` with each function of ``renamed`` (old -> new GlobalVar) under its new one.

    A GlobalVar carries its function's signature, and a function whose weight
    parameters became stored parts has another; every call of it is retargeted.
    """
    renamed = {old: new for old, new in renamed.items() if not new.same_as(old)}
    if not renamed:
        return mod
    out = tvm.IRModule({}, attrs=mod.attrs, global_infos=mod.global_infos)
    retarget = _Retarget(renamed)
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function):
            out[renamed.get(gv, gv)] = retarget.visit_expr(func)
        else:
            out[gv] = func
    return out


@mutator
class _Retarget(PyExprMutator):
    """Replaces GlobalVars (old -> new)."""

    def __init__(self, renamed: dict) -> None:
        super().__init__()
        self.renamed = renamed

    def visit_global_var_(self, gv):
        return self.renamed.get(gv, gv)


# ------------------------------------------------------------------------- the rewrite
class _Decode:
    """Rewrite one function: weights become their stored parts, decoded before each read."""

    def __init__(self, mod: tvm.IRModule, gv: tvm.ir.GlobalVar, stored: dict,
                 passes: dict, renamed: dict) -> None:
        self.mod, self.gv, self.stored, self.passes = mod, gv, stored, passes
        self.renamed = renamed  # callees rewritten before: old -> new GlobalVar

    def run(self, func: relax.Function) -> tuple[tvm.IRModule, tvm.ir.GlobalVar]:
        """The module with ``func`` rewritten, and the GlobalVar its callers call it by."""
        params = []
        for p in func.params:
            s = self.stored.get(p)
            params += [p] if s is None else [s.data] + ([s.scale] if s.scale is not None else [])
        rewriter = _Rewriter(self.mod, self.gv.name_hint, self.stored, self.passes,
                             self.renamed)
        body = rewriter.visit_with_new_scope(func.body)
        new = relax.Function(params, body, func.ret_ty, func.is_pure, func.attrs)
        out = rewriter.builder_.get().clone()  # the builder's module is the caller's
        out[self.gv] = new
        # a function its callers pass stored weights to gets a GlobalVar of its new signature
        if not self.passes.get(self.gv):
            return out, self.gv
        typed = tvm.ir.GlobalVar(self.gv.name_hint)
        relax.expr._update_type(typed, new.ty)  # a fresh variable: the caller's keeps its type
        return out, typed


@mutator
class _Rewriter(PyExprMutator):
    """Moves annotations onto the stored parts and decodes each read of a weight."""

    def __init__(self, mod: tvm.IRModule, function: str, stored: dict, passes: dict,
                 renamed: dict) -> None:
        super().__init__(mod)
        self.function = function
        self.stored = stored   # parameter -> _Stored
        self.aliases = {}      # an annotation of a stored weight -> _Stored of the annotated parts
        self.passes = passes   # callee -> the indices of its parameters stored as passed
        self.renamed = renamed  # callee -> its GlobalVar of the new signature

    def visit_call_(self, call):
        taken = self.passes.get(call.op) if isinstance(call.op, tvm.ir.GlobalVar) else None
        if not taken:
            return super().visit_call_(call)
        args = []
        for index, arg in enumerate(call.args):
            entry = self.stored.get(arg) or self.aliases.get(arg)
            if entry is not None and index in taken:  # passed on stored: the callee decodes
                args += [entry.data] + ([entry.scale] if entry.scale is not None else [])
            else:
                args.append(self.visit_expr(arg))
        return relax.Call(self.renamed.get(call.op, call.op), args, call.attrs, call.ty_args)

    def visit_var_binding_(self, binding) -> None:
        value = binding.value
        source = value.args[0] if _ir.is_call_to(value, _ANNOTATE) else None
        entry = self.stored.get(source) if source is not None else None
        entry = entry if entry is not None else self.aliases.get(source)
        if entry is None:
            super().visit_var_binding_(binding)
            return
        name = binding.var.name
        data = self.builder_.emit(relax.Call(value.op, [entry.data], value.attrs),
                                  name_hint=name)
        scale = (self.builder_.emit(relax.Call(value.op, [entry.scale], value.attrs),
                                    name_hint=name + SCALE_SUFFIX)
                 if entry.scale is not None else None)
        self.aliases[binding.var] = _Stored(entry.name, entry.fmt, entry.shape, entry.dtype,
                                            data, scale)

    def visit_var_(self, var):
        read = self._read(var)
        return read if read is not None else super().visit_var_(var)

    def visit_dataflow_var_(self, var):
        read = self._read(var)
        return read if read is not None else super().visit_dataflow_var_(var)

    def _read(self, var) -> relax.Var | None:
        entry = self.stored.get(var)
        entry = entry if entry is not None else self.aliases.get(var)
        return None if entry is None else self._decode(entry, var.name)

    def _decode(self, s: _Stored, name: str) -> relax.Var:
        """Emit the decode of one stored weight; the float weight's variable."""
        emit, op, f = self.builder_.emit, relax.op, s.dtype
        if not s.fmt.quantized:
            return emit(op.astype(s.data, f), name_hint=name + "_decoded")
        *lead, k = s.shape
        groups, size = k // s.fmt.group, s.fmt.group
        scale = op.astype(s.scale, f)
        if s.fmt.name == "q8":
            values = op.reshape(op.astype(s.data, f), (*lead, groups, size))
            weight = emit(op.multiply(values, op.reshape(scale, (*lead, groups, 1))))
        else:  # q4: a group's 16 bytes hold its first 16 values low, its last 16 high
            packed = emit(op.reshape(s.data, (*lead, groups, 1, size // 2)))
            nibbles = op.concat([op.bitwise_and(packed, relax.const(15, "uint8")),
                                 op.right_shift(packed, relax.const(4, "uint8"))],
                                axis=len(lead) + 1)
            # (nibble - 8) * scale, written nibble * scale + (-8 * scale): a fused
            # multiply-add rounds it exactly as the product (8 * scale is exact), and a
            # kernel decodes each value with that one instruction, the offset once per group
            scale = emit(op.reshape(scale, (*lead, groups, 1, 1)))
            weight = emit(op.add(op.multiply(op.astype(nibbles, f), scale),
                                 op.multiply(scale, relax.const(-8, f))))
        return emit(op.reshape(weight, s.shape), name_hint=name + "_decoded")


#: The formats :func:`quantize` takes, by name (re-exported for documentation).
SUPPORTED = tuple(FORMATS)
