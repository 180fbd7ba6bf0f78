# x's rows (8) split over 4 devices is fine, but the split flows through matmul's
# contraction into B's 6 rows... (B: (8, 6) transposed). The result (6, 8) gets S[0] from x^T.
# expect: IndivisibleShardError: 6
# run: propagate
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class Module:
    I.module_attrs({"device_num": 4})
    I.module_global_infos({"mesh": [R.dist.device_mesh((4,), I.Range(0, 4))]})

    @R.function
    def main(x: R.Tensor((8, 6), "float32")) -> R.Tensor((6, 8), "float32"):
        with R.dataflow():
            a = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="S[1]")
            b = R.permute_dims(a, [1, 0])
            R.output(b)
        return b
