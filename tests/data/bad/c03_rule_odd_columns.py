# A rule splits the 7 columns of A over 2 devices.
# expect: IndivisibleShardError: 7
# run: annotate
# rules: [{"param": "A", "result": "S[1]", "function": "main"}]
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class Module:
    I.module_attrs({"device_num": 2})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.Tensor((8, 8), "float32"), A: R.Tensor((8, 7), "float32")) -> R.Tensor((8, 7), "float32"):
        with R.dataflow():
            y = R.matmul(x, A)
            R.output(y)
        return y
