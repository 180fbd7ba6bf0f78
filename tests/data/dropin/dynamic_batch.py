# A dynamic batch dimension: only the static feature dimension is sharded.
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T


@I.ir_module
class DynamicBatch:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(
        x: R.Tensor(("n", 64), "float32"),
        W: R.Tensor((64, 128), "float32"),
    ) -> R.Tensor(("n", 128), "float32"):
        n = T.int64()
        with R.dataflow():
            W1 = R.dist.annotate_sharding(W, device_mesh="mesh[0]", placement="S[1]")
            lv0 = R.matmul(x, W1)
            lv1 = R.nn.relu(lv0)
            R.output(lv1)
        return lv1
