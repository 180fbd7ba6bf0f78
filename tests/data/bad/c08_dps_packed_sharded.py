# An opaque packed function called on a sharded value, with require_legalized.
# expect: UnsupportedProgramError: relax.call_dps_packed at 'y' takes sharded operands, but it has no legalization
# run: legalize-propagate
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class Module:
    I.module_attrs({"device_num": 2})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.Tensor((8, 8), "float32")) -> R.Tensor((8, 8), "float32"):
        with R.dataflow():
            a = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="S[0]")
            y = R.call_dps_packed("my_opaque_kernel", (a,), out_ty=R.Tensor((8, 8), "float32"))
            R.output(y)
        return y
