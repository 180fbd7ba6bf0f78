# A parameter already typed S[0] and a rule asking S[1] for it.
# expect: ShardingConflictError: S[1]
# run: annotate
# rules: [{"param": "x", "result": "S[1]", "function": "main"}]
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class Module:
    I.module_attrs({"device_num": 2})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]")) -> R.dist.DTensor((8, 8), "float32", "mesh[0]", "S[0]"):
        with R.dataflow():
            b = R.nn.relu(x)
            R.output(b)
        return b
