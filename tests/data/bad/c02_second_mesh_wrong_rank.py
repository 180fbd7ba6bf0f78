# The placement fits mesh[0] (2x2) but is used on mesh[1], a (2,) mesh.
# expect: PlacementRankError: mesh[1]
# run: propagate
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class Module:
    I.module_attrs({"device_num": 6})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2, 2), I.Range(0, 4)), R.dist.device_mesh((2,), I.Range(4, 6))]})

    @R.function
    def main(x: R.Tensor((8, 8), "float32")) -> R.Tensor((8, 8), "float32"):
        with R.dataflow():
            a = R.dist.annotate_sharding(x, device_mesh="mesh[1]", placement="S[0]S[1]")
            b = R.nn.relu(a)
            R.output(b)
        return b
