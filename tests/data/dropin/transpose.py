# A transpose moves the sharded axis.
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class Transpose:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.Tensor((8, 16, 4), "float32")) -> R.Tensor((4, 8, 16), "float32"):
        with R.dataflow():
            x1 = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="S[1]")
            lv0 = R.permute_dims(x1, axes=[2, 0, 1])
            lv1 = R.multiply(lv0, lv0)
            R.output(lv1)
        return lv1
