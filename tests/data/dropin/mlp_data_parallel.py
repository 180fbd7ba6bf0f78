# Data parallel MLP: the batch of x is split, the weights replicated.
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class MlpDataParallel:
    I.module_global_infos({"mesh": [R.dist.device_mesh((4,), I.Range(0, 4))]})

    @R.function
    def main(
        x: R.Tensor((64, 32), "float32"),
        A: R.Tensor((32, 32), "float32"),
        B: R.Tensor((32, 16), "float32"),
    ) -> R.Tensor((64, 16), "float32"):
        with R.dataflow():
            x1 = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="S[0]")
            lv0 = R.matmul(x1, A)
            lv1 = R.nn.gelu(lv0)
            lv2 = R.matmul(lv1, B)
            R.output(lv2)
        return lv2
