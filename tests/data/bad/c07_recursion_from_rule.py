# A rule shards the argument of every call of f, and f calls itself through g.
# expect: CallGraphError: recursive call cycle
# run: propagate
# rules: [{"callee": "f", "args": {"0": "S[0]"}, "function": "main"}]
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class Module:
    I.module_attrs({"device_num": 2})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function(private=True)
    def g(x: R.Tensor((8, 8), "float32")) -> R.Tensor((8, 8), "float32"):
        cls = Module
        y = cls.f(x)
        return y

    @R.function(private=True)
    def f(x: R.Tensor((8, 8), "float32")) -> R.Tensor((8, 8), "float32"):
        cls = Module
        y = cls.g(x)
        return y

    @R.function
    def main(x: R.Tensor((8, 8), "float32")) -> R.Tensor((8, 8), "float32"):
        cls = Module
        y = cls.f(x)
        return y
