# Layer normalisation over features, tokens split: no communication.
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class LayerNormRows:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(
        x: R.Tensor((8, 32), "float32"),
        gamma: R.Tensor((32,), "float32"),
        beta: R.Tensor((32,), "float32"),
    ) -> R.Tensor((8, 32), "float32"):
        with R.dataflow():
            x1 = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="S[0]")
            lv0 = R.nn.layer_norm(x1, gamma, beta, axes=[-1])
            lv1 = R.add(lv0, x1)
            R.output(lv1)
        return lv1
