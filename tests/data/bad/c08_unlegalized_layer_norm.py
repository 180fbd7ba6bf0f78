# layer_norm on a sharded value, propagated without LegalizeOps:
# TVM has no dist.FInferType for it.
# expect: UnsupportedProgramError: layer_norm
# run: propagate
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class Module:
    I.module_attrs({"device_num": 2})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.Tensor((8, 8), "float32"), g: R.Tensor((8,), "float32"), b: R.Tensor((8,), "float32")) -> R.Tensor((8, 8), "float32"):
        with R.dataflow():
            a = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="S[0]")
            y = R.nn.layer_norm(a, g, b, axes=[-1])
            R.output(y)
        return y
