# Control flow in a private function that receives a sharded argument.
# expect: UnsupportedProgramError: If
# run: distribute
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class Module:
    I.module_attrs({"device_num": 2})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function(private=True)
    def f(x: R.Tensor((8, 8), "float32"), c: R.Tensor((), "bool")) -> R.Tensor((8, 8), "float32"):
        if c:
            y = R.nn.relu(x)
        else:
            y = R.negative(x)
        return y

    @R.function
    def main(x: R.Tensor((8, 8), "float32"), c: R.Tensor((), "bool")) -> R.Tensor((8, 8), "float32"):
        cls = Module
        a = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="S[0]")
        y = cls.f(a, c)
        return y
