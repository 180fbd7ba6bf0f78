"""Programs that tests of more than one package run (support module, not a test)."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax.distributed import DeviceMesh, Placement
from tvm.script import ir as I
from tvm.script import relax as R

#: The shape of ``moved``'s input.
SHAPE = (8, 12, 4)


def moved(src: str, dst: str, mesh_shape: tuple[int, ...]) -> tvm.IRModule:
    """x annotated src, then dst (the second annotation becomes a redistribute), then relu."""
    n = int(np.prod(mesh_shape))
    mesh = DeviceMesh(list(mesh_shape), tvm.ir.Range(0, n))
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(SHAPE, "float32"))
    with bb.function("main", [x]):
        x1 = bb.emit(relax.op.distributed.annotate_sharding(x, mesh, Placement.from_text(src)))
        y = bb.emit(relax.op.distributed.annotate_sharding(x1, mesh, Placement.from_text(dst)),
                    name_hint="y")
        z = bb.emit(relax.op.nn.relu(y), name_hint="z")
        bb.emit_func_output(z)
    mod = bb.get()
    mod.update_global_info("mesh", [mesh])
    return mod


@I.ir_module
class Accumulate:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.Tensor(("n", 16), "float32"), acc: R.Tensor(("n", 16), "float32")):
        with R.dataflow():
            xs = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="S[1]")
            accs = R.dist.annotate_sharding(acc, device_mesh="mesh[0]", placement="S[1]")
            new = R.add(accs, xs)
            total = R.sum(new)
            out = (total, new)
            R.output(out)
        return out

    # takes a kept value whose extent m no input sets
    @R.function
    def other(x: R.Tensor(("n", 16), "float32"), acc: R.Tensor(("m", 16), "float32")):
        with R.dataflow():
            xs = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="S[1]")
            accs = R.dist.annotate_sharding(acc, device_mesh="mesh[0]", placement="S[1]")
            total = R.add(R.sum(accs), R.sum(xs))
            R.output(total)
        return total
