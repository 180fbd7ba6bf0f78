# A user's kernel that tvm-distx cannot read: a matmul written as plain loops (no
# blocks), over extents read from its buffers, called from main with x split on its
# columns (the summed axis). docs/concepts.md declares its rule, "mk,kn->mn".
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T


@I.ir_module
class LoopMatmul:
    I.module_attrs({"device_num": 2})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

    @T.prim_func
    def my_matmul(a: T.handle, b: T.handle, c: T.handle):
        m, k, n = T.int64(), T.int64(), T.int64()  # any shard fits
        A = T.match_buffer(a, (m, k), "float32")
        B = T.match_buffer(b, (k, n), "float32")
        C = T.match_buffer(c, (m, n), "float32")
        for i, j in T.grid(m, n):
            C[i, j] = T.float32(0)
            for p in range(k):
                C[i, j] = C[i, j] + A[i, p] * B[p, j]

    @R.function
    def main(x: R.Tensor((64, 32), "float32"), w: R.Tensor((32, 16), "float32")):
        cls = LoopMatmul
        with R.dataflow():
            xs = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="S[1]")
            y = R.call_tir(cls.my_matmul, (xs, w), out_ty=R.Tensor((64, 16), "float32"))
            R.output(y)
        return y
