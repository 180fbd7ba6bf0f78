# annotate_sharding in a module that declares no mesh at all.
# expect: UnknownMeshError: mesh[0]
# run: propagate
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class Module:
    I.module_attrs({"device_num": 2})

    @R.function
    def main(x: R.Tensor((8, 8), "float32")) -> R.Tensor((8, 8), "float32"):
        with R.dataflow():
            a = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="S[0]")
            b = R.nn.relu(a)
            R.output(b)
        return b
