# DistExecutable.export with a float64 weight for a float32 parameter: refused, and no
# partial bundle directory is left behind.
# expect: ArgumentError: input 'A' of 'main' has dtype float64, expected float32
# run: export
# params: A=float64[8,8]
# absent: {tmp}/export
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class Module:
    I.module_attrs({"device_num": 2})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.Tensor((8, 8), "float32"), A: R.Tensor((8, 8), "float32")) -> R.Tensor((8, 8), "float32"):
        with R.dataflow():
            a = R.dist.annotate_sharding(A, device_mesh="mesh[0]", placement="S[1]")
            y = R.matmul(x, a)
            R.output(y)
        return y
