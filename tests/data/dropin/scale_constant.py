# A scalar constant operand: typed as a replicated DTensor constant.
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class ScaleConstant:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.Tensor((8, 8), "float32")) -> R.Tensor((8, 8), "float32"):
        with R.dataflow():
            x1 = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="S[0]")
            y = R.multiply(x1, R.const(2.0, "float32"))
            z = R.add(y, R.const(1.0, "float32"))
            R.output(z)
        return z
