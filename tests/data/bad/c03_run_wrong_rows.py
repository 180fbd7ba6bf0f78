# Compiled for (8, 8) split over 2 devices, run with a (6, 8) input.
# expect: ArgumentError: has shape (6, 8), expected (8, 8)
# run: execute
# inputs: float32[6,8]
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class Module:
    I.module_attrs({"device_num": 2})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.Tensor((8, 8), "float32")) -> R.Tensor((8, 8), "float32"):
        with R.dataflow():
            a = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="S[0]")
            b = R.nn.relu(a)
            R.output(b)
        return b
