# A decoder-like layer: attention with heads split, an MLP, and residuals.
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class DecoderLayer:
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @R.function
    def main(
        x: R.Tensor((16, 64), "float32"),
        Wq: R.Tensor((64, 64), "float32"),
        Wk: R.Tensor((64, 64), "float32"),
        Wv: R.Tensor((64, 64), "float32"),
        Wo: R.Tensor((64, 64), "float32"),
        W1: R.Tensor((64, 256), "float32"),
        W2: R.Tensor((256, 64), "float32"),
    ) -> R.Tensor((16, 64), "float32"):
        with R.dataflow():
            Wq1 = R.dist.annotate_sharding(Wq, device_mesh="mesh[0]", placement="S[1]")
            Wk1 = R.dist.annotate_sharding(Wk, device_mesh="mesh[0]", placement="S[1]")
            Wv1 = R.dist.annotate_sharding(Wv, device_mesh="mesh[0]", placement="S[1]")
            Wo1 = R.dist.annotate_sharding(Wo, device_mesh="mesh[0]", placement="S[0]")
            W11 = R.dist.annotate_sharding(W1, device_mesh="mesh[0]", placement="S[1]")
            W21 = R.dist.annotate_sharding(W2, device_mesh="mesh[0]", placement="S[0]")
            q = R.matmul(x, Wq1)
            k = R.matmul(x, Wk1)
            v = R.matmul(x, Wv1)
            q4 = R.reshape(q, R.shape([16, 4, 16]))
            k4 = R.reshape(k, R.shape([16, 4, 16]))
            v4 = R.reshape(v, R.shape([16, 4, 16]))
            qh = R.permute_dims(q4, axes=[1, 0, 2])
            kh = R.permute_dims(k4, axes=[1, 2, 0])
            vh = R.permute_dims(v4, axes=[1, 0, 2])
            s = R.matmul(qh, kh)
            p = R.nn.softmax(s, axis=-1)
            o = R.matmul(p, vh)
            oh = R.permute_dims(o, axes=[1, 0, 2])
            o2 = R.reshape(oh, R.shape([16, 64]))
            attn = R.matmul(o2, Wo1)
            h = R.add(x, attn)
            f1 = R.matmul(h, W11)
            f2 = R.nn.relu(f1)
            f3 = R.matmul(f2, W21)
            out = R.add(h, f3)
            R.output(out)
        return out
