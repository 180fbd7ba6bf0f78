# (6, 8) split in 2 on mesh[0], redistributed to S[0] on a (4,) mesh.
# expect: IndivisibleShardError: 6
# run: distribute
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class Module:
    I.module_attrs({"device_num": 6})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2)), R.dist.device_mesh((4,), I.Range(2, 6))]})

    @R.function
    def main(x: R.dist.DTensor((6, 8), "float32", "mesh[0]", "S[0]")) -> R.dist.DTensor((6, 8), "float32", "mesh[1]", "S[0]"):
        with R.dataflow():
            c = R.dist.redistribute(x, device_mesh="mesh[1]", placement="S[0]")
            R.output(c)
        return c
