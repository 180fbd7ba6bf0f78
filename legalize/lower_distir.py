"""``LowerDistIR``: from DTensor IR to the program every rank runs.

TVM's ``LowerDistIR`` assumes a 1-D mesh, lowers one function at a time (so a
call of another distributed function no longer type-checks), and feeds every
rank from worker 0 with a broadcast or scatter. This pass:

* rewrites every function, parameters and calls included, from ``R.DTensor``
  types to each rank's local tensor types (each rank receives its own shard of
  every input, so nothing is scattered from worker 0);
* turns ``call_tir_local_view`` into ``call_tir`` on local types;
* turns the all-reduce that ``LowerGlobalViewToLocalView`` inserts after a
  sharded reduction, which TVM runs over *all* workers with a result typed
  replicated, into ``tvm_distx.ccl.allreduce`` over the sub-groups of exactly
  the mesh axes that shard the reduction, keeping its input's layout (on a 2x2
  mesh TVM's version gives wrong numbers, see ``../shared/NOTES-tvm.md``).

Collectives are ``R.call_dps_packed`` calls of runtime functions named
``tvm_distx.ccl.<name>``. Their arguments are the input tensor, then a
:class:`CollectiveGroup` encoded as a shape: ``(mesh ndim, *mesh shape,
first device, *mesh axes)``; the output buffer comes last, as usual for
destination-passing calls.

Limits (raised as :class:`tvm_distx.UnsupportedProgramError`): one mesh per
module covering all its devices (pipeline stages need per-rank programs), and
``R.dist.redistribute`` must already be legalized.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import tvm
from tvm import relax
from tvm.relax.distributed import DTensorType

from tvm_distx import _ir
from tvm_distx._pass import module_pass
from tvm_distx._rewrite import FunctionRewriter
from tvm_distx.errors import UnsupportedProgramError
from tvm_distx.mesh import DeviceMesh
from tvm_distx.spec import TensorSharding

__all__ = ["LowerDistIR", "CollectiveGroup", "local_type"]

logger = logging.getLogger(__name__)

#: Reduction kinds, as the runtime's ``tvm_distx.ccl.allreduce`` receives them.
REDUCE_KINDS = {"sum": 0, "prod": 1, "min": 2, "max": 3, "avg": 4}


@dataclass(frozen=True)
class CollectiveGroup:
    """The ranks a collective runs among: sub-groups of ``mesh`` along ``axes``.

    Every rank of the mesh takes part; ranks that differ only in their
    coordinates along ``axes`` form one group.
    """

    mesh_shape: tuple[int, ...]
    first_device: int
    axes: tuple[int, ...]

    def encode(self) -> tuple[int, ...]:
        """The flat integer form passed to the runtime."""
        return (len(self.mesh_shape), *self.mesh_shape, self.first_device, *self.axes)

    @classmethod
    def decode(cls, values) -> "CollectiveGroup":
        """Read the flat form back."""
        values = [int(v) for v in values]
        ndim = values[0]
        return cls(tuple(values[1:1 + ndim]), values[1 + ndim], tuple(values[2 + ndim:]))

    def members(self, device: int) -> tuple[int, ...]:
        """The global devices in ``device``'s group, in group order."""
        import numpy as np

        grid = np.arange(int(np.prod(self.mesh_shape))).reshape(self.mesh_shape)
        coord = list(np.unravel_index(device - self.first_device, self.mesh_shape))
        index = tuple(slice(None) if axis in self.axes else coord[axis]
                      for axis in range(len(self.mesh_shape)))
        return tuple(int(d) + self.first_device for d in np.ravel(grid[index]))


def local_type(ty):
    """The local tensor type one rank holds for a DTensor type (tuples field-wise)."""
    if isinstance(ty, DTensorType):
        sharding = TensorSharding.from_type(ty)
        tensor = ty.tensor_ty
        return relax.TensorType(sharding.local_shape(tensor.shape.values), tensor.dtype)
    if isinstance(ty, relax.TupleType):
        return relax.TupleType([local_type(f) for f in ty.fields])
    return ty


@module_pass(name="tvm_distx.LowerDistIR")
class LowerDistIR:
    """Lower a DTensor module (after ``LowerGlobalViewToLocalView``) to rank-local IR.

    Raises
    ------
    UnsupportedProgramError
        For several meshes in one module, a mesh that does not cover the
        module's devices, or a redistribute that is not legalized yet.
    """

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        _check_single_mesh(mod)
        bb = relax.BlockBuilder()
        new_gvs: dict[str, tvm.ir.GlobalVar] = {}
        for gv in _callees_first(mod):
            new_gvs[gv.name_hint] = _FunctionLowerer(bb, gv.name_hint, mod[gv], new_gvs).lower()
        out = dict(bb.get().functions.items())
        for gv, func in mod.functions.items():
            if not isinstance(func, relax.Function):  # TIR kernels keep their GlobalVars
                out[gv] = func
        return tvm.IRModule(out, attrs=mod.attrs, global_infos=mod.global_infos)


def _check_single_mesh(mod: tvm.IRModule) -> None:
    from tvm_distx.mesh import module_meshes

    meshes = module_meshes(mod)
    if len(meshes) > 1:
        raise UnsupportedProgramError(
            f"the module has {len(meshes)} meshes ({', '.join(meshes)}); lowering several "
            "meshes (pipeline stages) needs per-rank programs, which this pass does not make yet",
            hint="use one mesh for now",
        )


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
    def __init__(self, bb: relax.BlockBuilder, name: str, func: relax.Function,
                 gvs: dict[str, tvm.ir.GlobalVar]) -> None:
        super().__init__(bb, name)
        self.func = func
        self.gvs = gvs
        self.producers: dict[relax.Var, relax.Call] = {}

    def lower(self) -> tvm.ir.GlobalVar:
        func = self.func
        params = [relax.Var(p.name, local_type(p.ty)) for p in func.params]
        public = func.attrs is not None and "global_symbol" in func.attrs
        return self.rewrite(func, params, public)

    def use(self, expr):
        if isinstance(expr, tvm.ir.Constant) and isinstance(expr.ty, DTensorType):
            return tvm.ir.GenericConst(expr.value, local_type(expr.ty))
        return super().use(expr)

    def binding(self, index: int, binding, dataflow: bool) -> None:
        value = binding.value
        if isinstance(binding, relax.MatchCast):
            self.match_cast(binding.var, self.use(value), local_type(binding.ty), dataflow)
            return
        if isinstance(value, relax.Call):
            self.producers[binding.var] = value
            new = self._call(binding.var, value)
        elif isinstance(value, relax.TupleGetItem):
            new = relax.TupleGetItem(self.use(value.tuple_value), value.index)
        else:
            new = self.use(value)
        self.bind(binding.var, new, dataflow)

    def _call(self, var: relax.Var, call: relax.Call):
        args = [self.use(a) for a in call.args]
        if isinstance(call.op, tvm.ir.GlobalVar):
            target = self.gvs.get(call.op.name_hint, call.op)
            return relax.Call(target, args, call.attrs, call.ty_args, call.span)
        if _ir.is_call_to(call, "relax.dist.call_tir_local_view"):
            return relax.Call(tvm.ir.Op.get("relax.call_tir"), args, call.attrs,
                              [local_type(var.ty)], call.span)
        if _ir.is_call_to(call, "relax.ccl.allreduce"):
            return self._allreduce(var, call, args[0])
        if _ir.is_call_to(call, "relax.dist.redistribute") or _ir.is_call_to(
            call, "relax.dist.redistribute_replica_to_shard"
        ):
            raise UnsupportedProgramError(
                "a redistribute reached lowering; legalize it first "
                "(tvm_distx.legalize.LegalizeRedistribute)",
                function=self.name,
                var=var.name,
            )
        if isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.call_tir":
            raise UnsupportedProgramError(
                "call_tir on DTensors reached lowering",
                function=self.name,
                var=var.name,
                hint="run relax.distributed.transform.LowerGlobalViewToLocalView first",
            )
        # call_dps_packed (the planned collectives, for example) carries its result
        # type in ty_args: make it rank-local too.
        ty_args = [local_type(t) for t in call.ty_args]
        return relax.Call(call.op, args, call.attrs, ty_args, call.span)

    def _allreduce(self, var: relax.Var, call: relax.Call, value):
        # LowerGlobalViewToLocalView types the all-reduce's result as replicated on
        # every mesh axis. It is not: an all-reduce completes partial sums along
        # the reduced axes and keeps the layout of its input (for example "S[0]R"
        # on a 2x2 mesh when the model axis reduces). The input's type is the truth.
        source = call.args[0]
        producer = self.producers.get(source)
        out = TensorSharding.from_type(source.ty)
        axes = reduced_axes(producer, out) if producer is not None else ()
        if not axes:
            raise UnsupportedProgramError(
                "cannot tell which mesh axes this all-reduce runs over",
                function=self.name,
                var=var.name,
                hint="the all-reduce must directly follow the sharded reduction it completes",
            )
        mesh: DeviceMesh = out.mesh
        group = CollectiveGroup(mesh.shape, mesh.device_range.start, axes)
        kind = REDUCE_KINDS[str(call.attrs.op_type)]
        packed_args = relax.Tuple([value, relax.prim_value(kind), relax.ShapeExpr(group.encode())])
        return relax.call_dps_packed("tvm_distx.ccl.allreduce", packed_args,
                                     out_ty=local_type(source.ty))


def reduced_axes(producer: relax.Call, out: TensorSharding) -> tuple[int, ...]:
    """Mesh axes that shard an input of ``producer`` but replicate its result."""
    inputs = []
    for arg in producer.args:
        items = arg.fields if isinstance(arg, relax.Tuple) else [arg]
        for item in items:
            sharding = TensorSharding.from_type(item.ty)
            if sharding is not None:
                inputs.append(sharding)
    axes = []
    for axis, entry in enumerate(out.placement.entries):
        if entry.is_shard():
            continue
        if any(s.placement.entries[axis].is_shard() for s in inputs):
            axes.append(axis)
    return tuple(axes)

