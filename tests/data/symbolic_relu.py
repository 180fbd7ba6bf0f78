# A sharded function with a symbolic dimension (once a bad-input case that was
# refused): the symbolic dimension is not split, the constant one is.
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T


@I.ir_module
class Module:
    I.module_attrs({"device_num": 2})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.Tensor(("n", 8), "float32")) -> R.Tensor(("n", 8), "float32"):
        n = T.int64()
        with R.dataflow():
            a = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="S[1]")
            b = R.nn.relu(a)
            R.output(b)
        return b
