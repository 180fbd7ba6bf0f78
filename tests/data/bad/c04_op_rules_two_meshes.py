# Two rules put the operands of the same matmul on two different meshes.
# expect: ShardingConflictError: relax.matmul
# run: propagate
# rules: [{"op": "relax.matmul", "args": {"0": "S[0]"}, "meshes": "mesh[0]"}, {"op": "relax.matmul", "args": {"1": "R"}, "meshes": "mesh[1]"}]
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class Module:
    I.module_attrs({"device_num": 4})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2)), R.dist.device_mesh((2,), I.Range(2, 4))]})

    @R.function
    def main(x: R.Tensor((8, 8), "float32"), A: R.Tensor((8, 8), "float32")) -> R.Tensor((8, 8), "float32"):
        with R.dataflow():
            y = R.matmul(x, A)
            R.output(y)
        return y
