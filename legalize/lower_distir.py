"""``LowerDistIR``: from DTensor IR to the program every rank runs.

TVM's ``LowerDistIR`` assumes a 1-D mesh, lowers one function at a time (so a
call of another distributed function no longer type-checks), ignores a mesh's
device range (so pipeline stages cannot be lowered), and feeds every rank from
worker 0 with a broadcast or scatter. This pass:

* rewrites every function, parameters and calls included, from ``R.DTensor``
  types to each rank's local tensor types (each rank receives its own shard of
  every input, so nothing is scattered from worker 0);
* turns TVM's ``redistribute_replica_to_shard`` (from TVM's
  ``LegalizeRedistribute``) into ``tvm_distx.ccl.local_slice``;
* turns ``call_tir_local_view`` into ``call_tir`` on local types, and TVM's
  distributed KV-cache builtins back into the plain ones, a view asking for
  its local shape (each rank's cache holds its shard);
* turns the all-reduce that ``LowerGlobalViewToLocalView`` inserts after a
  sharded reduction, which TVM runs over *all* workers with a result typed
  replicated, into ``tvm_distx.ccl.allreduce`` over the sub-groups of exactly
  the mesh axes that shard the reduction, keeping its input's layout (on a 2x2
  mesh TVM's version sums over every worker and gives wrong numbers);
* gives a function that spans several meshes (pipeline stages) one version
  per *rank set*, the devices that belong to the same meshes and so run the
  same program. Version ``f_rank<d>`` is named after the first device ``d`` of
  its set; it keeps the parameters, bindings and results that live on meshes
  holding its devices, and drops the rest. Its side of a move between meshes
  is ``tvm_distx.ccl.send`` (source mesh only, an impure call),
  ``tvm_distx.ccl.recv`` (destination mesh only) or ``tvm_distx.ccl.send_recv``
  (both). A version that holds none of the results returns an empty tuple.

Collectives are calls of the runtime functions of :mod:`tvm_distx.ccl`.

Which function each device runs is :func:`rank_entry`; when it is not simply
the function itself on every device, the module attribute
``"tvm_distx.rank_entries"`` maps each public function to one entry name per
device (``""`` for a device that runs nothing).

Limits (raised as :class:`tvm_distx.errors.UnsupportedProgramError`): a function
spanning several meshes must not be called by another function (inline it
first), and ``R.dist.redistribute`` must already be legalized.
"""

from __future__ import annotations

import logging

from tvm import relax
import tvm
from tvm.relax.distributed import DTensorType

from tvm_distx import ccl
from tvm_distx.ccl import REDUCE_KINDS, CollectiveGroup
from tvm_distx.errors import UnsupportedProgramError
from tvm_distx.ir import helpers as _ir
from tvm_distx.ir.module_pass import module_pass
from tvm_distx.ir.rewriter import FunctionRewriter
from tvm_distx.layout import TensorSharding
from tvm_distx.layout.mesh import DeviceMesh, device_meshes
from tvm_distx.legalize.partial_sums import partial_sum
from tvm_distx.legalize.split_extents import drop_extents_param

__all__ = ["LowerDistIR", "CollectiveGroup", "ENTRIES_ATTR", "local_type", "rank_entry",
           "fed_from_worker0", "module_devices", "function_meshes", "rank_sets"]

logger = logging.getLogger(__name__)

#: The module attribute mapping a public function to its entry on every device.
ENTRIES_ATTR = "tvm_distx.rank_entries"


def local_type(ty):
    """The local tensor type one rank holds for a DTensor type (tuples field-wise)."""
    if isinstance(ty, DTensorType):
        sharding = TensorSharding.from_type(ty)
        tensor = ty.tensor_ty
        return relax.TensorType(sharding.local_shape(tensor.shape.values), tensor.dtype)
    if isinstance(ty, relax.TupleType):
        return relax.TupleType([local_type(f) for f in ty.fields])
    return ty


def rank_entry(mod: tvm.IRModule, function: str, device: int) -> str | None:
    """The function ``device`` runs for the public ``function`` of a lowered module.

    Parameters
    ----------
    mod : tvm.IRModule
        The output of :class:`LowerDistIR`.
    function : str
        A public function of the module before lowering (``"main"``).
    device : int
        A global device id.

    Returns
    -------
    str or None
        The name of the function to call on that device; None when the device
        takes no part in ``function``.
    """
    entries = mod.attrs.get(ENTRIES_ATTR) if mod.attrs is not None else None
    if entries is None or function not in entries:
        return function
    row = list(entries[function])
    if device >= len(row) or not row[device]:
        return None
    return str(row[device])


#: What TVM's ``LowerDistIR`` feeds each parameter through at entry (never emitted by ours).
_FROM_WORKER0 = ("relax.ccl.broadcast_from_worker0", "relax.ccl.scatter_from_worker0",
                 ccl.DISCO_PREFIX + "broadcast_from_worker0",
                 ccl.DISCO_PREFIX + "scatter_from_worker0")


def fed_from_worker0(mod: tvm.IRModule, function: str) -> bool:
    """Whether a lowered public function takes its inputs whole on worker 0, as TVM lowers.

    TVM's ``LowerDistIR`` keeps every parameter's global type and broadcasts
    or scatters it from worker 0 at entry (the ``"worker0"`` feed of
    :mod:`tvm_distx.bundle.manifest.signature`); ours takes each rank's shard. The sign is a
    parameter (or a field of one) passed straight to
    ``R.ccl.broadcast_from_worker0`` or ``R.ccl.scatter_from_worker0`` (or
    to their ``runtime.disco.*`` packed forms).
    """
    gv = next((g for g in mod.functions if g.name_hint == function), None)
    func = mod[gv] if gv is not None else None
    if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
        return False
    params = set(func.params)

    def is_param(arg) -> bool:
        if isinstance(arg, relax.TupleGetItem):
            arg = arg.tuple_value
        return isinstance(arg, relax.Var) and arg in params

    for block in func.body.blocks:
        for binding in block.bindings:
            call = binding.value
            if not isinstance(call, relax.Call) or not call.args:
                continue
            op = call.op
            name = (op.name if isinstance(op, tvm.ir.Op) else
                    str(op.global_symbol) if isinstance(op, relax.ExternFunc) else None)
            if name == "relax.call_dps_packed" and isinstance(call.args[0], relax.ExternFunc):
                name, args = str(call.args[0].global_symbol), list(call.args[1].fields)
            else:
                args = list(call.args)
            if name in _FROM_WORKER0 and args and is_param(args[0]):
                return True
    return False


@module_pass(name="tvm_distx.LowerDistIR")
class LowerDistIR:
    """Lower a DTensor module (after ``LowerGlobalViewToLocalView``) to rank-local IR.

    Raises
    ------
    UnsupportedProgramError
        For a redistribute that is not legalized yet, or a call of a function
        that spans several meshes.
    """

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        devices = module_devices(mod)
        bb = relax.BlockBuilder()
        new_gvs: dict[str, tvm.ir.GlobalVar] = {}
        entries: dict[str, list[str]] = {}
        spanning = {gv.name_hint for gv, f in _ir.relax_functions(mod)
                    if len(function_meshes(f)) > 1}
        for gv in _callees_first(mod):
            func = mod[gv]
            name = gv.name_hint
            _check_no_call_of(name, func, spanning)
            meshes = function_meshes(func)
            if len(meshes) <= 1:
                new_gvs[name] = _FunctionLowerer(bb, name, func, new_gvs).lower()
                held = set(meshes[0].device_range) if meshes else set(devices)
                row = [name if d in held else "" for d in devices]
            else:
                row = [""] * len(devices)
                for rank_set in rank_sets(meshes):
                    version = f"{name}_rank{rank_set[0]}"
                    _FunctionLowerer(bb, version, func, new_gvs, rank_set).lower()
                    for d in rank_set:
                        row[devices.index(d)] = version
            if _is_public(func):
                entries[name] = row
        versions = {v for row in entries.values() for v in row if v and v not in entries}
        out = {gv: _with_own_symbolic_vars(func) if gv.name_hint in versions else func
               for gv, func in bb.get().functions.items()}
        for gv, func in mod.functions.items():
            if not isinstance(func, relax.Function):  # TIR kernels keep their GlobalVars
                out[gv] = func
        lowered = drop_extents_param(
            tvm.IRModule(out, attrs=mod.attrs, global_infos=mod.global_infos))
        if not relax.analysis.check_well_formed(lowered):  # a bug of ours, never silent
            raise UnsupportedProgramError(
                "lowering produced a malformed module (an internal error of tvm_distx)",
                hint="please report it with the module; run with dump_dir= to see the stages")
        if any(row != [name] * len(devices) for name, row in entries.items()):
            lowered = lowered.with_attr(ENTRIES_ATTR, entries)
        return lowered


def _is_public(func: relax.Function) -> bool:
    return func.attrs is not None and "global_symbol" in func.attrs


def module_devices(mod: tvm.IRModule) -> list[int]:
    """The global device ids of a module: ``0 .. device_num - 1``, or up to its last mesh's."""
    count = 0
    if mod.attrs is not None and "device_num" in mod.attrs:
        count = int(mod.attrs["device_num"])
    for mesh in device_meshes(mod).values():
        count = max(count, mesh.device_range.stop)
    return list(range(count))


def _types_of(func: relax.Function):
    yield from (p.ty for p in func.params)
    for block in func.body.blocks:
        for binding in block.bindings:
            yield binding.var.ty
    yield func.body.body.ty


def _meshes_of_type(ty, found: dict) -> None:
    if isinstance(ty, DTensorType):
        mesh = DeviceMesh.from_tvm(ty.device_mesh)
        found.setdefault((mesh.shape, mesh.device_range.start), mesh)
    elif isinstance(ty, relax.TupleType):
        for field in ty.fields:
            _meshes_of_type(field, found)


def function_meshes(func: relax.Function) -> list[DeviceMesh]:
    """The distinct meshes the values of ``func`` live on, in order of appearance."""
    found: dict = {}
    for ty in _types_of(func):
        _meshes_of_type(ty, found)
    return list(found.values())


def rank_sets(meshes: list[DeviceMesh]) -> list[tuple[int, ...]]:
    """Devices grouped by the meshes they belong to, ordered by their first device.

    All devices of one set run the same program: they hold the same values.
    """
    sets: dict[tuple[bool, ...], list[int]] = {}
    for device in sorted({d for m in meshes for d in m.device_range}):
        key = tuple(device in m.device_range for m in meshes)
        sets.setdefault(key, []).append(device)
    return sorted((tuple(v) for v in sets.values()), key=lambda s: s[0])


def _check_no_call_of(name: str, func: relax.Function, spanning: set[str]) -> None:
    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.GlobalVar):
            if expr.op.name_hint in spanning:
                raise UnsupportedProgramError(
                    f"'{expr.op.name_hint}' spans several meshes and is called from "
                    f"'{name}'; only a function that no other function calls may span "
                    "several meshes (it gets one version per rank set)",
                    function=name,
                    hint="inline it into its caller first "
                    "(relax.transform.InlinePrivateFunctions)",
                )

    relax.analysis.post_order_visit(func, visit)


def _callees_first(mod: tvm.IRModule) -> list[tvm.ir.GlobalVar]:
    """Relax functions in post order of the call graph (callees before callers)."""
    seen: set[str] = set()
    order: list[tvm.ir.GlobalVar] = []
    by_name = {gv.name_hint: gv for gv, f in mod.functions.items()
               if isinstance(f, relax.Function)}

    def visit(name: str) -> None:
        if name in seen:
            return
        seen.add(name)
        calls: list[str] = []

        def collect(expr):
            if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.GlobalVar):
                if expr.op.name_hint in by_name:
                    calls.append(expr.op.name_hint)

        relax.analysis.post_order_visit(mod[by_name[name]], collect)
        for callee in calls:
            visit(callee)
        order.append(by_name[name])

    for name in sorted(by_name):
        visit(name)
    return order


class _FunctionLowerer(FunctionRewriter):
    """Write one function rank-locally; with ``rank_set``, only what those devices hold."""

    def __init__(self, bb: relax.BlockBuilder, name: str, func: relax.Function,
                 gvs: dict[str, tvm.ir.GlobalVar],
                 rank_set: tuple[int, ...] | None = None) -> None:
        super().__init__(bb, name)
        self.func = func
        self.gvs = gvs
        self.producers: dict[relax.Var, relax.Call] = {}
        # all devices of a rank set hold the same values: ask about the first
        self.device = rank_set[0] if rank_set is not None else None
        #: in a rank version, the symbolic variables defined so far, and the bindings
        #: that wait for one (see :meth:`binding`)
        self.defined: set = set()
        self.waiting: list[tuple[int, relax.Binding]] = []
        self.deferred: set[relax.Var] = set()

    def lower(self) -> tvm.ir.GlobalVar:
        func = self.func
        # the parameters these devices hold, each mapped to its rank-local version
        params = {p: relax.Var(p.name, self._local(p.ty)) for p in func.params
                  if self._holds(p.ty)}
        if self.device is None:
            return self.rewrite(func, params, _is_public(func))
        self.defined = {v for p in params.values() for v in _type_vars(p.ty)}
        # a version of a function spanning several meshes: its sends are impure
        # calls, which dataflow blocks cannot hold
        sends = self._sends()
        return self.rewrite(func, params, _is_public(func), dataflow=False,
                            pure=func.is_pure and not sends)

    # -- what this version holds --------------------------------------------------
    def _holds(self, ty) -> bool:
        """Whether the devices of this version hold (some of) a value of type ``ty``."""
        if self.device is None:
            return True
        if isinstance(ty, DTensorType):
            return self.device in DeviceMesh.from_tvm(ty.device_mesh).device_range
        if isinstance(ty, relax.TupleType):
            return any(self._holds(f) for f in ty.fields) or not ty.fields
        return True

    def _held_fields(self, ty) -> list[int]:
        return [i for i, f in enumerate(ty.fields) if self._holds(f)]

    def _local(self, ty):
        if self.device is not None and isinstance(ty, relax.TupleType):
            return relax.TupleType([self._local(ty.fields[i]) for i in self._held_fields(ty)])
        return local_type(ty)

    def _sends(self) -> bool:
        """Whether this version calls an impure side of a move: a send, or a receive whose
        size comes with the data (``recv_sized``)."""
        for block in self.func.body.blocks:
            for binding in block.bindings:
                spec = _send_recv_spec(binding.value)
                role = spec.role(self.device) if spec is not None else None
                if role == "send" or (role == "recv" and spec.run_time_dims):
                    return True
        return False

    # -- bindings -----------------------------------------------------------------
    def use(self, expr):
        if isinstance(expr, tvm.ir.Constant) and isinstance(expr.ty, DTensorType):
            return tvm.ir.GenericConst(expr.value, local_type(expr.ty))
        if self.device is not None and isinstance(expr, relax.Tuple):
            return relax.Tuple([self.use(f) for f in expr.fields if self._holds(f.ty)])
        return super().use(expr)

    def _output(self, expr):
        if not self._holds(expr.ty):
            return relax.Tuple([])  # this rank set holds none of the results
        return self.use(expr)

    def binding(self, index: int, binding, dataflow: bool) -> None:
        """Write one binding; in a rank version, once the symbolic extents it uses are defined.

        A rank that only receives a tensor of run-time extents defines them where it
        receives it (a ``match_cast``). A binding before that which uses them (say an
        ``ones((seq,))`` that propagation put on this rank's mesh) waits, with what
        reads it, until the extents are defined; pure bindings only move so, in order.
        """
        if self.device is None:
            self._binding(index, binding, dataflow)
            return
        if self._must_wait(binding):
            self.waiting.append((index, binding))
            self.deferred.add(binding.var)
            return
        self._binding(index, binding, dataflow)
        self._flush()

    def _must_wait(self, binding) -> bool:
        value = binding.value
        spec = _send_recv_spec(value)
        if spec is not None and spec.role(self.device) == "recv":
            return False  # a receive defines the extents it carries
        if any(v in self.deferred for v in _ir.operand_vars(value)):
            return True
        try:
            used = set(relax.analysis.free_symbolic_vars(value))
        except tvm.error.TVMError:  # an expression the analysis does not take
            return False
        return bool(used - self.defined)

    def _flush(self) -> None:
        """Write the waiting bindings whose extents are now defined, in their order."""
        progress = True
        while progress and self.waiting:
            progress = False
            for entry in list(self.waiting):
                index, binding = entry
                self.deferred.discard(binding.var)
                if self._must_wait(binding):
                    self.deferred.add(binding.var)
                    continue
                self.waiting.remove(entry)
                self._binding(index, binding, False)
                progress = True

    def output(self, expr):
        if self.waiting:
            names = ", ".join(b.var.name for _, b in self.waiting[:3])
            raise UnsupportedProgramError(
                f"devices {self.device}... use a symbolic extent that nothing they receive "
                f"defines ({names})", function=self.name,
                hint="annotate the inputs of run-time size on the mesh that uses them")
        return self._output(expr)

    def _binding(self, index: int, binding, dataflow: bool) -> None:
        value = binding.value
        spec = _send_recv_spec(value) if self.device is not None else None
        if spec is not None and spec.role(self.device) == "send":
            self._send(binding.var, value, spec)
            return
        if not self._holds(binding.var.ty):
            return  # the value lives on a mesh these devices are not in
        if isinstance(binding, relax.MatchCast):
            self.match_cast(binding.var, self.use(value), self._local(binding.ty), dataflow)
            self.defined |= set(_type_vars(self._local(binding.ty)))
            return
        name = None
        if spec is not None and spec.role(self.device) == "recv" and spec.run_time_dims:
            self._recv_sized(binding.var, spec)
            return
        if isinstance(value, relax.Call):
            self.producers[binding.var] = value
            new = self._call(binding.var, value, spec)
            if spec is not None and spec.role(self.device) == "recv":
                name = _side_name(binding.var.name, "recv")
        elif isinstance(value, relax.TupleGetItem):
            new = self._tuple_get_item(value)
        else:
            new = self.use(value)
        self.bind(binding.var, new, dataflow, name=name)

    def _tuple_get_item(self, value: relax.TupleGetItem):
        index = value.index
        if self.device is not None:
            index = self._held_fields(value.tuple_value.ty).index(index)
        return relax.TupleGetItem(self.use(value.tuple_value), index)

    def _send(self, var: relax.Var, call: relax.Call, spec: ccl.SendRecvSpec) -> None:
        # the source side of a move between meshes: no result on this rank
        value = self.use(call.args[1].fields[0])
        send = relax.Call(relax.ExternFunc(ccl.SEND), [value, relax.ShapeExpr(spec.encode())],
                          ty_args=[relax.ObjectType()])
        self.bb.emit(send, name_hint=_side_name(var.name, "send"))

    def _recv_sized(self, var: relax.Var, spec: ccl.SendRecvSpec) -> None:
        """The destination side of a move whose extents are known at run time only.

        These ranks hold nothing of the source, so they cannot size the result: the
        runtime makes it (its shape comes from the senders), and a ``match_cast`` to
        the local type defines the symbolic extents on these ranks.
        """
        local = self._local(var.ty)
        call = relax.Call(relax.ExternFunc(ccl.RECV_SIZED),
                          [relax.ShapeExpr(spec.encode()), tvm.ir.StringImm(str(local.dtype))],
                          ty_args=[relax.TensorType(ndim=local.ndim, dtype=local.dtype)])
        received = self.bb.emit(call, name_hint=_side_name(var.name, "recv"))
        self.match_cast(var, received, local, dataflow=False)
        self.defined |= set(_type_vars(local))

    def _call(self, var: relax.Var, call: relax.Call, spec: ccl.SendRecvSpec | None = None):
        if spec is not None and spec.role(self.device) == "recv":
            # the destination side of a move between meshes: nothing to send
            return relax.call_dps_packed(ccl.RECV, relax.Tuple([relax.ShapeExpr(spec.encode())]),
                                         out_ty=local_type(var.ty))
        args = [self.use(a) for a in call.args]
        if isinstance(call.op, tvm.ir.GlobalVar):
            target = self.gvs.get(call.op.name_hint, call.op)
            return relax.Call(target, args, call.attrs, call.ty_args, call.span)
        if _ir.is_call_to(call, "relax.dist.call_tir_local_view"):
            return relax.Call(tvm.ir.Op.get("relax.call_tir"), args, call.attrs,
                              [local_type(var.ty)], call.span)
        if _ir.is_call_to(call, "relax.ccl.allreduce"):
            return self._allreduce(var, call, args[0])
        if _ir.is_call_to(call, "relax.dist.redistribute_replica_to_shard") and \
                isinstance(var.ty, DTensorType):
            return self._replica_to_shard(var, call, args[0])
        if _ir.is_call_to(call, "relax.dist.redistribute"):
            raise UnsupportedProgramError(
                "a redistribute reached lowering; legalize it first "
                "(tvm_distx.legalize.LegalizeRedistribute)",
                function=self.name,
                var=var.name,
            )
        if isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.call_tir" and \
                _on_dtensors(var, call):
            raise UnsupportedProgramError(
                "call_tir on DTensors reached lowering",
                function=self.name,
                var=var.name,
                hint="run relax.distributed.transform.LowerGlobalViewToLocalView first",
            )
        # call_dps_packed (the planned collectives, for example) carries its result
        # type in ty_args: make it rank-local too.
        ty_args = [local_type(t) for t in call.ty_args]
        builtin = _ir.kv_builtin(call)
        if builtin is not None:
            # each rank's cache holds its shard: the plain builtin, asked for the
            # local shape of the view (as TVM's LowerDistIR does)
            if builtin[0] == "view" and isinstance(var.ty, DTensorType):
                args[1] = relax.ShapeExpr(list(local_type(var.ty).shape.values))
            if builtin[0] == "create" and isinstance(call.args[0].ty, DTensorType):
                reserved = TensorSharding.from_type(call.args[0].ty)
                args[1] = relax.ShapeExpr(list(reserved.local_shape(call.args[1].values)))
            return _ir.kv_renamed(call, False, args, ty_args)
        return relax.Call(call.op, args, call.attrs, ty_args, call.span)

    def _replica_to_shard(self, var: relax.Var, call: relax.Call, value):
        """TVM's local slice (what TVM's ``LegalizeRedistribute`` emits): our local slice.

        Each rank keeps its block of its own copy along ``axis``, over the mesh
        axes that split that dimension in the result's placement.
        """
        sharding = TensorSharding.from_type(var.ty)
        axis = int(call.attrs.axis)
        mesh_axes = sharding.placement.mesh_axes_sharding(axis)
        group = CollectiveGroup.along(sharding.mesh, mesh_axes)
        packed_args = relax.Tuple([value, relax.ShapeExpr(group.encode()), relax.ShapeExpr([axis])])
        return relax.call_dps_packed(ccl.LOCAL_SLICE, packed_args, out_ty=local_type(var.ty))

    def _allreduce(self, var: relax.Var, call: relax.Call, value):
        # TVM's local view types the all-reduce's result as replicated on every
        # mesh axis; it completes a partial sum along the summed axes only and
        # keeps its input's layout (partial_sums.partial_sum reads it back).
        partial = partial_sum(call, self.producers)
        if partial is None:
            raise UnsupportedProgramError(
                "cannot tell which mesh axes this all-reduce runs over",
                function=self.name,
                var=var.name,
                hint="the all-reduce must directly follow the sharded reduction it completes",
            )
        mesh: DeviceMesh = partial.layout.mesh
        group = CollectiveGroup(mesh.shape, mesh.device_range.start, partial.axes)
        kind = REDUCE_KINDS[partial.kind]
        packed_args = relax.Tuple([value, relax.prim_value(kind), relax.ShapeExpr(group.encode())])
        return relax.call_dps_packed(ccl.ALLREDUCE, packed_args,
                                     out_ty=local_type(call.args[0].ty))


def _type_vars(ty) -> list:
    """The symbolic variables a tensor type's shape names bare (those a binding defines)."""
    if isinstance(ty, DTensorType):
        ty = ty.tensor_ty
    if isinstance(ty, relax.TupleType):
        return [v for field in ty.fields for v in _type_vars(field)]
    shape = getattr(ty, "shape", None) if isinstance(ty, relax.TensorType) else None
    if not isinstance(shape, relax.ShapeExpr):
        return []
    return [d for d in shape.values if isinstance(d, tvm.tirx.Var)]


def _with_own_symbolic_vars(func: relax.Function) -> relax.Function:
    """``func`` with symbolic variables of its own.

    The rank versions of one function are written from it, with its symbolic
    variables; but two functions of a module may not define the same one.
    """
    found = list(relax.analysis.defined_symbolic_vars(func))
    if not found:
        return func
    return func.bind_symbolic_vars({var: tvm.tirx.Var(var.name, var.ty) for var in found})


def _side_name(name: str, side: str) -> str:
    """``y_send_recv`` becomes ``y_send`` or ``y_recv`` on one side of a move."""
    stem = name[: -len("_send_recv")] if name.endswith("_send_recv") else name
    return f"{stem}_{side}"


def _send_recv_spec(value) -> ccl.SendRecvSpec | None:
    """The spec of a ``tvm_distx.ccl.send_recv`` call between two meshes, else None."""
    if not (_ir.is_call_to(value, "relax.call_dps_packed")
            and isinstance(value.args[0], relax.ExternFunc)
            and value.args[0].global_symbol == ccl.SEND_RECV):
        return None
    spec = ccl.SendRecvSpec.decode(value.args[1].fields[1].values)
    return spec if spec.src.mesh != spec.dst.mesh else None


def _on_dtensors(var: relax.Var, call: relax.Call) -> bool:
    """Whether a call's result or a tensor argument is a DTensor (a plain one runs as it is)."""

    args = call.args[1].fields if len(call.args) > 1 and isinstance(call.args[1], relax.Tuple) \
        else call.args
    return isinstance(var.ty, DTensorType) or any(isinstance(a.ty, DTensorType) for a in args)
