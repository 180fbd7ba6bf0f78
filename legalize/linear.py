"""``LegalizeLinear``: a matmul with a transposed weight parameter, as one kernel.

PyTorch's ``Linear`` keeps its weight as ``(out, in)``, and TVM's frontend
imports ``x @ W.T`` as ``matmul(x, permute_dims(W))``. Legalized as written,
that is a transpose kernel that copies the whole weight on every call, then a
matmul: for a language model, every weight byte is read and written once more
per forward, which costs more than the matmul itself at small batch sizes.

This pass, run before ``LegalizeOps``, writes such a matmul as one TIR kernel
that reads ``W`` in its stored layout (``out[..., i, j] = sum_k x[..., i, k] *
W[j, k]``). Sharding propagation reads the kernel's access pattern as it reads
any other: ``W``'s axis 0 is the output features, axis 1 the reduced input
features, so a column-parallel ``S[0]`` or row-parallel ``S[1]`` split of the
weight means what it meant before.

The same holds for a weight stored in another format and decoded by the
program (:func:`tvm_distx.quantize`: ``astype``, the groups' ``multiply``, the
nibbles of ``q4``, through the sharding annotations of the stored parts): the
matmul reads the decoded weight ``W[j, k]`` in its stored ``(out, in)`` layout,
and the decode stays a chain of operators that propagation shards as before.
:func:`tvm_distx.compiler.schedule.fuse_kernels` later fuses that decode into the
matmul's kernel, so it happens in registers.

Only a ``permute_dims`` (with no other use) of a 2-D function parameter, of its
sharding annotation or of a decode of parameters
(:func:`tvm_distx.ir.weight_decode.decodes_parameters`) is folded; everything
else is left to ``LegalizeOps``.
"""

from __future__ import annotations

import logging

import tvm
from tvm import relax, te
from tvm.relax.expr_functor import PyExprMutator, mutator

from tvm_distx.ir import helpers as _ir
from tvm_distx.ir.module_pass import module_pass
from tvm_distx.ir.weight_decode import decodes_parameters

__all__ = ["LegalizeLinear"]

logger = logging.getLogger(__name__)


def _matmul_weight_transposed(x: te.Tensor, w: te.Tensor, out_dtype: str) -> te.Tensor:
    """``x @ w.T`` for ``x`` of shape ``(..., m, k)`` and ``w`` of shape ``(n, k)``."""
    *batch, _, k_extent = x.shape
    n_extent = w.shape[0]
    k = te.reduce_axis((0, k_extent), name="k")

    def body(*index):
        *lead, i, j = index
        return te.sum(x[(*lead, i, k)].astype(out_dtype) * w[j, k].astype(out_dtype), axis=k)

    return te.compute((*batch, x.shape[-2], n_extent), body, name="matmul")


@module_pass(name="tvm_distx.LegalizeLinear")
class LegalizeLinear:
    """Fold the transpose of a ``(out, in)`` weight parameter into its matmul."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        out = mod.clone()
        changed = False
        for gv, func in _ir.relax_functions(mod):
            rewriter = _Folder(out, func)
            new = rewriter.visit_expr(func)
            if rewriter.folded:
                out = rewriter.builder_.get()
                out[gv] = relax.analysis.remove_all_unused(new)
                changed = True
                logger.debug("%s: %d weight transposes folded into matmuls", gv.name_hint,
                             rewriter.folded)
        return out if changed else mod


@mutator
class _Folder(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, func: relax.Function) -> None:
        super().__init__(mod)
        self.params = set(func.params)
        self.folded = 0
        self.uses: dict = {}
        for block in func.body.blocks:
            for binding in block.bindings:
                for operand in _ir.operand_vars(binding.value):
                    self.uses[operand] = self.uses.get(operand, 0) + 1
        for operand in _ir.operand_vars(func.body.body):
            self.uses[operand] = self.uses.get(operand, 0) + 1

    def _transposed_weight(self, expr) -> relax.Var | None:
        """The 2-D weight ``W`` if ``expr`` is a single-use ``permute_dims(W)``."""
        if not isinstance(expr, relax.Var) or self.uses.get(expr, 0) != 1:
            return None
        bound = self.lookup_binding(expr)
        if not _ir.is_call_to(bound, "relax.permute_dims"):
            return None
        weight = bound.args[0]
        axes = bound.attrs.axes
        shape = _ir.static_shape(weight.ty) if isinstance(weight, relax.Var) else None
        if shape is None or len(shape) != 2 or None in shape or not self._is_weight(weight):
            return None
        if axes is not None and [int(a) for a in axes] != [1, 0]:
            return None
        return weight

    def _is_weight(self, var: relax.Var) -> bool:
        """A parameter, its sharding annotation, or a decode of parameters."""
        return decodes_parameters(var, self.lookup_binding, self.params)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        if not _ir.is_call_to(call, "relax.matmul"):
            return super().visit_call_(call)
        x, transposed = call.args
        weight = self._transposed_weight(transposed)
        x_shape = _ir.static_shape(x.ty)
        if weight is None or x_shape is None or len(x_shape) < 2:
            return super().visit_call_(call)
        out_dtype = str(call.attrs.out_dtype) if call.attrs.out_dtype else ""
        out_dtype = out_dtype or str(x.ty.dtype)
        self.folded += 1
        return self.builder_.call_te(_matmul_weight_transposed, self.visit_expr(x),
                                     self.visit_expr(weight), out_dtype,
                                     primfunc_name_hint="matmul_weight_transposed")
