# Two results returned as a tuple.
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class TupleOutput:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(
        x: R.Tensor((16, 16), "float32"), W: R.Tensor((16, 16), "float32")
    ) -> R.Tuple(R.Tensor((16, 16), "float32"), R.Tensor((16, 16), "float32")):
        with R.dataflow():
            W1 = R.dist.annotate_sharding(W, device_mesh="mesh[0]", placement="S[1]")
            lv0 = R.matmul(x, W1)
            lv1 = R.nn.relu(lv0)
            lv2 = R.add(lv0, lv1)
            R.output(lv1, lv2)
        return (lv1, lv2)
