"""``GroupedQueryAttention``: attention products that read each key-value head once.

Grouped-query attention gives ``g`` query heads to each of ``h`` key-value
heads. Traced from transformers, the keys and values are first *repeated*
(``repeat_kv``)::

    e = expand_dims(x, axis=[2])                  # (b, h, 1, n, d)
    r = broadcast_to(e, (b, h, g, n, d))
    k = reshape(r, (b, h * g, n, d))              # every head g times

and the products read the repeated copy: ``q @ permute_dims(k, [0, 1, 3, 2])``
for the scores and ``probs @ v`` for the output. In a decode step, where ``n``
is the whole cache, that is two cache-sized copies per layer before any
arithmetic.

This pass writes each such product without the copy. Query head ``i * g + j``
is row block ``j`` of key-value head ``i``, so a ``(b, h * g, s, c)`` operand
reshaped to ``(b, h, g * s, c)`` multiplies the unrepeated ``x`` directly::

    scores = reshape(matmul(reshape(q, (b, h, g * s, d)), permute_dims(x, [0, 1, 3, 2])),
                     (b, h * g, s, n))
    out    = reshape(matmul(reshape(probs, (b, h, g * s, n)), x), (b, h * g, s, d))

Every value stays what it was (the scores and the output keep their shapes),
only the two products change, and the repeats, now unused, are removed.

Sharding: the reshapes keep a split of the query heads over ``p`` ranks only
when ``p`` divides ``h``, the key-value heads (each rank then holds whole
groups). With more ranks than key-value heads it would become an all-gather,
so the caller passes the number of ranks that split the heads
(``heads_divisor``) and products whose ``h`` it does not divide are left as
they are. Only products whose query length ``s`` is static are rewritten (a
decoded token: merging a run-time length into ``g * s`` is not a layout
propagation can keep split). :meth:`tvm_distx.plans.presets.TensorParallelPlan.prepare`
runs it.
"""

from __future__ import annotations

import logging

import tvm
import tvm_ffi
from tvm import relax
from tvm.ir.transform import module_pass
from tvm.relax.expr_functor import PyExprMutator, mutator

from tvm_distx.ir import helpers as _ir
from tvm_distx.errors import ArgumentError

__all__ = ["GroupedQueryAttention", "repeated_heads"]

logger = logging.getLogger(__name__)

_KEYS_T = (0, 1, 3, 2)


def _dims(ty) -> list | None:
    """The shape of a 4-D or 5-D tensor type as PrimExprs, else None."""
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    values = getattr(ty.shape, "values", None)
    return list(values) if values is not None and len(values) in (4, 5) else None


def _int(expr) -> int | None:
    return int(expr) if isinstance(expr, tvm.tirx.IntImm) else None


def repeated_heads(var, bound: dict) -> tuple[relax.Var, int] | None:
    """``(x, g)`` when ``var`` is ``x``'s heads each repeated ``g`` times (``repeat_kv``).

    ``bound`` maps variables to the values bound to them. The pattern is
    ``reshape(broadcast_to(expand_dims(x, [2]), (b, h, g, n, d)), (b, h * g, n, d))``
    with static ``h`` and ``g``.
    """
    reshape = bound.get(var)
    if not _ir.is_call_to(reshape, "relax.reshape"):
        return None
    broadcast = bound.get(reshape.args[0])
    if not _ir.is_call_to(broadcast, "relax.broadcast_to"):
        return None
    expand = bound.get(broadcast.args[0])
    if not _ir.is_call_to(expand, "relax.expand_dims") or \
            [int(a) for a in expand.attrs.axis] != [2]:
        return None
    x = expand.args[0]
    source, wide, out = _dims(x.ty), _dims(broadcast.ty), _dims(var.ty)
    if source is None or wide is None or out is None or len(source) != 4 or len(wide) != 5:
        return None
    heads, group, repeated = _int(source[1]), _int(wide[2]), _int(out[1])
    if heads is None or group is None or repeated != heads * group:
        return None
    same = tvm_ffi.structural_equal
    if not (same(wide[0], source[0]) and same(wide[1], source[1]) and same(wide[3], source[2])
            and same(wide[4], source[3]) and same(out[0], source[0])
            and same(out[2], source[2]) and same(out[3], source[3])):
        return None
    return x, group


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, bound: dict, divisor: int) -> None:
        super().__init__(mod)
        self.bound, self.divisor = bound, divisor
        self.rewritten = 0

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        new = self._grouped(binding)
        if new is None:
            super().visit_var_binding_(binding)
            return
        self.rewritten += 1
        if isinstance(binding.var, relax.DataflowVar):
            self.set_var_remap(binding.var, self.builder_.emit(new))
        else:  # a dataflow block's output: the product stays bound to it, visible after the block
            self.builder_.emit_normalized(relax.VarBinding(binding.var,
                                                           self.builder_.normalize(new)))

    def _grouped(self, binding: relax.VarBinding):
        """The product without the repeat, as its last reshape (not yet bound), or None."""
        value = binding.value
        if not _ir.is_call_to(value, "relax.matmul"):
            return None
        left, right = value.args
        keys = False
        operand = self.bound.get(right)
        if _ir.is_call_to(operand, "relax.permute_dims") and operand.attrs.axes is not None \
                and tuple(int(a) for a in operand.attrs.axes) == _KEYS_T:
            right, keys = operand.args[0], True
        found = repeated_heads(right, self.bound)
        rows, result = _dims(left.ty), _dims(binding.var.ty)
        if found is None or rows is None or result is None or len(rows) != 4:
            return None
        x, group = found
        heads = _int(_dims(x.ty)[1])
        length = _int(rows[2])
        if length is None or heads % self.divisor or _int(rows[1]) != heads * group:
            return None
        bb = self.builder_
        grouped = bb.emit(relax.op.reshape(self.visit_expr(left),
                                           [rows[0], heads, group * length, rows[3]]))
        other = self.visit_expr(x)
        if keys:
            other = bb.emit(relax.op.permute_dims(other, list(_KEYS_T)))
        product = bb.emit(relax.op.matmul(grouped, other, out_dtype=value.attrs.out_dtype))
        return relax.op.reshape(product, result)


@module_pass(opt_level=0, name="tvm_distx.GroupedQueryAttention")
class GroupedQueryAttention:
    """Rewrite attention products over repeated key-value heads to read each head once.

    Parameters
    ----------
    function : str
        The function whose products are rewritten.
    heads_divisor : int
        Rewrite only products whose key-value head count this divides: the
        number of ranks that split the attention heads (1: every product).

    Notes
    -----
    Run it before annotating. Values keep their shapes and meaning; see the
    module documentation for the pattern and why the divisor matters.
    """

    def __init__(self, function: str = "main", heads_divisor: int = 1) -> None:
        if int(heads_divisor) < 1:
            raise ArgumentError(f"GroupedQueryAttention(heads_divisor={heads_divisor!r}): the "
                                "number of ranks that split the heads, at least 1",
                                hint="GroupedQueryAttention('decode', heads_divisor=2)")
        self.function, self.heads_divisor = function, int(heads_divisor)

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if self.function not in [gv.name_hint for gv in mod.functions]:
            return mod
        func = mod[self.function]
        if not isinstance(func, relax.Function):
            return mod
        bound: dict = {}
        for block in func.body.blocks:
            for binding in block.bindings:
                if isinstance(binding, relax.VarBinding):
                    bound[binding.var] = binding.value
        rewriter = _Rewriter(mod, bound, self.heads_divisor)
        new = rewriter.visit_expr(func)
        if not rewriter.rewritten:
            return mod
        new = relax.analysis.remove_all_unused(new)
        logger.info("%s: %d attention products read key-value heads unrepeated",
                    self.function, rewriter.rewritten)
        out = rewriter.builder_.get()
        out[self.function] = new
        return out
