# redistribute to mesh[1]; the module has one mesh.
# expect: UnknownMeshError: mesh[1]
# run: distribute
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class Module:
    I.module_attrs({"device_num": 2})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]")) -> R.dist.DTensor((8, 8), "float32", "mesh[1]", "S[0]"):
        with R.dataflow():
            c = R.dist.redistribute(x, device_mesh="mesh[1]", placement="S[0]")
            R.output(c)
        return c
