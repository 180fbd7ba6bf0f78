"""A random program as an annotated Relax module."""

from __future__ import annotations

import contextlib

from .program import Op, Program

__all__ = ["build_module"]


def build_module(program: Program):
    """The program as a Relax module annotated with its input placements.

    Returns
    -------
    tvm.IRModule
        Ready for :func:`tvm_distx.compile`: with ``program.rules``, the
        parameter annotations come from :class:`tvm_distx.ShardingRule` rules
        through :class:`tvm_distx.passes.AnnotateSharding`; otherwise they are
        ``R.dist.annotate_sharding`` calls at the start of ``main``.
    """
    import tvm
    from tvm import relax
    from tvm.relax.distributed import DeviceMesh, Placement

    mesh = DeviceMesh(list(program.mesh), tvm.ir.Range(0, program.num_devices))
    bb = relax.BlockBuilder()
    gvars: dict[str, object] = {}

    def annotate(value, placement: str):
        return relax.op.distributed.annotate_sharding(value, mesh, Placement.from_text(placement))

    for name, func in program.functions.items():
        names = func.names()
        params = [relax.Var(names[i], relax.TensorType(list(s), "float32"))
                  for i, s in enumerate(func.params)]
        is_main = name == "main"
        with bb.function(name, params, private=not is_main):
            values: list = list(params)
            with (bb.dataflow() if func.dataflow else contextlib.nullcontext()):
                if is_main and not program.rules:
                    for i, inp in enumerate(program.inputs):
                        values[i] = bb.emit(annotate(params[i], inp.placement), f"{names[i]}_s")
                for i, op in enumerate(func.ops):
                    var_name = names[len(func.params) + i]
                    expr = _relax_op(op, [values[a] for a in op.args], annotate, gvars)
                    values.append(bb.emit(expr, var_name))
                outs = [values[o] for o in func.outputs]
                result = outs[0] if len(outs) == 1 else relax.Tuple(outs)
                if func.dataflow:
                    result = bb.emit_output(result)
            # the GlobalVar to call: the BlockBuilder keeps one of two equal functions
            gvars[name] = bb.emit_func_output(result)
    mod = bb.get()
    mod.update_global_info("mesh", [mesh])
    if program.rules:
        from tvm_distx import ShardingRule
        from tvm_distx.passes import AnnotateSharding

        names = program.main.names()
        rules = [ShardingRule(param=names[i], result=inp.placement, function="main")
                 for i, inp in enumerate(program.inputs)]
        mod = AnnotateSharding(rules)(mod)
    return mod


def _relax_op(op: Op, args: list, annotate, gvars: dict):
    from tvm import relax

    R = relax.op
    if op.kind == "matmul":
        return R.matmul(args[0], args[1])
    if op.kind in ("add", "multiply", "subtract"):
        return getattr(R, op.kind)(args[0], args[1])
    if op.kind in ("exp", "tanh"):
        return getattr(R, op.kind)(args[0])
    if op.kind == "relu":
        return R.nn.relu(args[0])
    if op.kind in ("sum", "max"):
        return getattr(R, op.kind)(args[0], axis=[op.axis], keepdims=op.keepdims)
    if op.kind == "softmax":
        return R.nn.softmax(args[0], axis=op.axis)
    if op.kind == "reshape":
        return R.reshape(args[0], op.new_shape)
    if op.kind == "permute_dims":
        return R.permute_dims(args[0], list(op.axes))
    if op.kind == "split":
        return relax.TupleGetItem(R.split(args[0], 2, axis=op.axis), op.half)
    if op.kind == "annotate":
        return annotate(args[0], op.placement)
    if op.kind == "call":
        return relax.Call(gvars[op.callee], args)
    raise ValueError(f"unknown operation {op.kind!r}")
