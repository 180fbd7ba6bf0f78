# redistribute to S[2] of a rank-2 tensor on another mesh.
# expect: ShardDimError: S[2] shards dimension 2, but the tensor has rank 2
# run: distribute
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class Module:
    I.module_attrs({"device_num": 4})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2)), R.dist.device_mesh((2,), I.Range(2, 4))]})

    @R.function
    def main(x: R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]")) -> R.dist.DTensor((8, 8), "float32", "mesh[1]", "S[2]"):
        with R.dataflow():
            c = R.dist.redistribute(x, device_mesh="mesh[1]", placement="S[2]")
            R.output(c)
        return c
