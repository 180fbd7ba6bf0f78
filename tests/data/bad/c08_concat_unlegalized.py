# concat of sharded values without LegalizeOps.
# expect: UnsupportedProgramError: TVM cannot type relax.concat on sharded operands: relax.concat expects
# run: propagate
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class Module:
    I.module_attrs({"device_num": 2})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.Tensor((8, 8), "float32"), z: R.Tensor((8, 8), "float32")) -> R.Tensor((16, 8), "float32"):
        with R.dataflow():
            a = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="S[1]")
            y = R.concat((a, z), axis=0)
            R.output(y)
        return y
