# Two rules give the first argument of every call of mlp different shardings.
# expect: ShardingConflictError: mlp
# run: annotate
# rules: [{"callee": "mlp", "args": {"0": "S[0]"}}, {"callee": "mlp", "args": {"0": "S[1]"}}]
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class Module:
    I.module_attrs({"device_num": 2})
    I.module_global_infos(
        {"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]}
    )

    @R.function(private=True)
    def mlp(
        x: R.Tensor((128, 128), "float32"),
        A: R.Tensor((128, 128), "float32"),
        B: R.Tensor((128, 128), "float32"),
    ) -> R.Tensor((128, 128), "float32"):
        with R.dataflow():
            lv0 = R.matmul(x, A)
            lv1 = R.nn.relu(lv0)
            lv2 = R.matmul(lv1, B)
            R.output(lv2)
        return lv2

    @R.function
    def main(
        x: R.Tensor((128, 128), "float32"),
        A: R.Tensor((128, 128), "float32"),
        B: R.Tensor((128, 128), "float32"),
    ) -> R.Tensor((128, 128), "float32"):
        cls = Module
        with R.dataflow():
            y = cls.mlp(x, A, B)
            z = cls.mlp(y, A, B)
            R.output(z)
        return z
