# A data-parallel layer whose batch "b" is symbolic and split over 2 devices:
# each rank's program has the local extent b // 2, checked before launch.
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class Module:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.Tensor(("b", 64), "float32"), w: R.Tensor((64, 32), "float32")):
        with R.dataflow():
            xs = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="S[0]")
            y = R.nn.relu(R.matmul(xs, w))
            R.output(y)
        return y
