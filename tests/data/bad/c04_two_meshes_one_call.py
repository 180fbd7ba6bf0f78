# The operands of one matmul are annotated onto two different meshes.
# expect: ShardingConflictError: mesh
# run: propagate
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class Module:
    I.module_attrs({"device_num": 4})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2)), R.dist.device_mesh((2,), I.Range(2, 4))]})

    @R.function
    def main(x: R.Tensor((8, 8), "float32"), A: R.Tensor((8, 8), "float32")) -> R.Tensor((8, 8), "float32"):
        with R.dataflow():
            xa = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="S[0]")
            Aa = R.dist.annotate_sharding(A, device_mesh="mesh[1]", placement="R")
            y = R.matmul(xa, Aa)
            R.output(y)
        return y
