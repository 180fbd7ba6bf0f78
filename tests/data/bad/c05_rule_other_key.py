# A rule names a global-info key the module does not have.
# expect: UnknownMeshError: gpus[0]
# run: annotate
# rules: [{"param": "x", "result": "S[0]", "function": "main", "meshes": ["gpus[0]"]}]
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class Module:
    I.module_attrs({"device_num": 2})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(x: R.Tensor((8, 8), "float32")) -> R.Tensor((8, 8), "float32"):
        with R.dataflow():
            a = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="R")
            b = R.nn.relu(a)
            R.output(b)
        return b
