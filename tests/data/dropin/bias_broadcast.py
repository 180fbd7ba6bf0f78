# A linear layer with a broadcast bias: the bias follows the column split.
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class BiasBroadcast:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(
        x: R.Tensor((16, 32), "float32"),
        W: R.Tensor((32, 64), "float32"),
        b: R.Tensor((64,), "float32"),
    ) -> R.Tensor((16, 64), "float32"):
        with R.dataflow():
            W1 = R.dist.annotate_sharding(W, device_mesh="mesh[0]", placement="S[1]")
            lv0 = R.matmul(x, W1)
            lv1 = R.add(lv0, b)
            lv2 = R.nn.gelu(lv1)
            R.output(lv2)
        return lv2
