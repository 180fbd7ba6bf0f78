"""``LowerGlobalViewToLocalView``: TVM's pass, refusing what it gets wrong.

TVM's pass rewrites each ``call_tir`` on DTensors into a kernel over the local
shard. When two mesh axes split the same tensor dimension (``"S[0]S[0]"``), one
split overwrites the other and the kernels get wrong shapes (see
``../shared/NOTES-tvm.md``). This wrapper refuses such a module with a
:class:`tvm_distx.UnsupportedProgramError` before TVM's pass runs, and
otherwise delegates to it.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.distributed import transform as dist_transform

from tvm_distx import _ir
from tvm_distx._pass import module_pass
from tvm_distx.errors import UnsupportedProgramError
from tvm_distx.spec import TensorSharding

__all__ = ["LowerGlobalViewToLocalView"]


@module_pass(name="tvm_distx.LowerGlobalViewToLocalView")
class LowerGlobalViewToLocalView:
    """Check for dimensions split by several mesh axes, then run TVM's pass."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        for gv, func in _ir.relax_functions(mod):
            _check(gv.name_hint, func)
        return dist_transform.LowerGlobalViewToLocalView()(mod)


def _check(name: str, func: relax.Function) -> None:
    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if not _ir.is_call_to(value, "relax.call_tir"):
                continue
            operands = list(value.args[1].fields) + [binding.var]
            for operand in operands:
                sharding = TensorSharding.from_type(operand.ty)
                if sharding is None:
                    continue
                dims = [e.dim for e in sharding.placement.entries if e.is_shard()]
                if len(dims) != len(set(dims)):
                    raise UnsupportedProgramError(
                        f"a kernel reads or writes '{_label(operand)}' with one dimension split "
                        f"by several mesh axes; TVM's local-view lowering computes wrong shard "
                        "shapes for that",
                        function=name,
                        var=binding.var.name,
                        placement=str(sharding.placement),
                        hint="shard that dimension along one mesh axis only, or redistribute "
                        "the value before the kernel",
                    )


def _label(expr) -> str:
    return expr.name if isinstance(expr, relax.Var) else "an operand"
