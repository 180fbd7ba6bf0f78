# A parameter typed R.DTensor with one entry on a 2x2 mesh.
# expect: PlacementRankError: has 1 entr
# run: propagate
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class Module:
    I.module_attrs({"device_num": 4})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2, 2), I.Range(0, 4))]})

    @R.function
    def main(x: R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]")) -> R.dist.DTensor((8, 8), "float32", "mesh[0]", "RR"):
        with R.dataflow():
            a = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="RS[1]")
            b = R.nn.relu(a)
            R.output(b)
        return b
