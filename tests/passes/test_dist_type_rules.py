"""Operators TVM 0.27 cannot type on DTensors get the type it gives them on plain tensors."""

from __future__ import annotations

import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from tvm_distx.passes import PropagateSharding


def test_tensor_to_shape_of_a_distributed_tensor_is_a_shape():
    # OPT's learned positions turn the cache position into a shape this way
    @I.ir_module
    class Before:
        I.module_attrs({"device_num": 2})
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @R.function
        def main(x: R.Tensor((1,), "int64"), y: R.Tensor((4, 8), "float32")):
            s = R.tensor_to_shape(x)
            y2 = R.dist.annotate_sharding(y, device_mesh="mesh[0]", placement="S[1]")
            return (s, y2)

    @I.ir_module
    class Expected:
        I.module_attrs({"device_num": 2})
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @R.function
        def main(x: R.dist.DTensor((1,), "int64", "mesh[0]", "R"),
                 y: R.dist.DTensor((4, 8), "float32", "mesh[0]", "S[1]")
                 ) -> R.Tuple(R.Shape(ndim=1), R.dist.DTensor((4, 8), "float32", "mesh[0]",
                                                             "S[1]")):
            s: R.Shape(ndim=1) = R.tensor_to_shape(x)
            return (s, y)

    tvm.ir.assert_structural_equal(PropagateSharding()(Before), Expected)
