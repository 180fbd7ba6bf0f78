# R.dist.redistribute on a plain R.Tensor (no mesh yet): TVM's parser cannot type it.
# expect: ScriptError: hint: R.dist.redistribute takes a DTensor
# run: load
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class Module:
    I.module_attrs({"device_num": 4})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2)), R.dist.device_mesh((2,), I.Range(2, 4))]})

    @R.function
    def main(x: R.Tensor((8, 8), "float32")) -> R.Tensor((8, 8), "float32"):
        with R.dataflow():
            c = R.dist.redistribute(x, device_mesh="mesh[1]", placement="S[0]")
            R.output(c)
        return c
