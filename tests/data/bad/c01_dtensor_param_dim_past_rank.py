# A parameter typed R.DTensor sharding dimension 2 of a rank-2 tensor.
# expect: ShardDimError: S[2]
# run: propagate
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class Module:
    I.module_attrs({"device_num": 2})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[2]")) -> R.dist.DTensor((8, 8), "float32", "mesh[0]", "R"):
        with R.dataflow():
            b = R.nn.relu(x)
            R.output(b)
        return b
