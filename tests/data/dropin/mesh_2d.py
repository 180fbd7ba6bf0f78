# Data x model parallel on a 2x2 mesh.
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class Mesh2D:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2, 2), I.Range(0, 4))]})

    @R.function
    def main(
        x: R.Tensor((32, 64), "float32"),
        A: R.Tensor((64, 128), "float32"),
        B: R.Tensor((128, 64), "float32"),
    ) -> R.Tensor((32, 64), "float32"):
        with R.dataflow():
            x1 = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="S[0]R")
            A1 = R.dist.annotate_sharding(A, device_mesh="mesh[0]", placement="RS[1]")
            B1 = R.dist.annotate_sharding(B, device_mesh="mesh[0]", placement="RS[0]")
            lv0 = R.matmul(x1, A1)
            lv1 = R.nn.relu(lv0)
            lv2 = R.matmul(lv1, B1)
            R.output(lv2)
        return lv2
