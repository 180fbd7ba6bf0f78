# redistribute from a 2x2 mesh to a (3,) mesh, dimension 8 split in 3.
# expect: IndivisibleShardError: 8
# run: distribute
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class Module:
    I.module_attrs({"device_num": 7})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2, 2), I.Range(0, 4)), R.dist.device_mesh((3,), I.Range(4, 7))]})

    @R.function
    def main(x: R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]S[1]")) -> R.dist.DTensor((8, 8), "float32", "mesh[1]", "S[1]"):
        with R.dataflow():
            c = R.dist.redistribute(x, device_mesh="mesh[1]", placement="S[1]")
            R.output(c)
        return c
