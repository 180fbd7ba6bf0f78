# Megatron MLP: A split by columns, B by rows.
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class MlpTensorParallel:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(
        x: R.Tensor((128, 128), "float32"),
        A: R.Tensor((128, 256), "float32"),
        B: R.Tensor((256, 128), "float32"),
    ) -> R.Tensor((128, 128), "float32"):
        with R.dataflow():
            A1 = R.dist.annotate_sharding(A, device_mesh="mesh[0]", placement="S[1]")
            B1 = R.dist.annotate_sharding(B, device_mesh="mesh[0]", placement="S[0]")
            lv0 = R.matmul(x, A1)
            lv1 = R.nn.relu(lv0)
            lv2 = R.matmul(lv1, B1)
            R.output(lv2)
        return lv2
