"""The dense expert dispatch of an imported sparse MLP, replaced by one experts kernel.

:mod:`tvm_distx.frontend.torch_moe` imports a sparse MLP as a dense dispatch over all
experts (see its docstring); after ``from_torch`` it reads, in Relax::

    combine = scatter_elements(zeros((T, E)), top_k_index, top_k_weights, axis=1)
    h       = matmul(x, permute_dims(W_up, [0, 2, 1]))        # (E, T, 2I); no permute if
    a, b    = split(h, 2, axis=-1)                            #   W_up is stored (E, H, 2I)
    g       = multiply(silu(a), b)                            # (E, T, I)
    y       = matmul(g, permute_dims(W_down, [0, 2, 1]))      # (E, T, H)
    out     = sum(multiply(y, expand_dims(permute_dims(combine, [1, 0]), -1)), axis=0)

:func:`fuse_expert_dispatch` finds that chain by its structure, from the final
``sum`` back to the tokens, the routing matrix and the two 3-D weights, and
replaces ``out`` by one call of the experts kernel
(:func:`tvm_distx.compiler.schedule.experts.experts_definition`) on
``(x, combine, W_up, W_down)``. The dense values become unused and are
removed. Propagation reads the kernel like any other (splitting the experts
leaves a partial sum, completed by the one all-reduce the dense chain had),
and the build runs it as a sparse dispatch
(:class:`tvm_distx.compiler.schedule.experts.SparseExperts`): each rank computes only
the (token, expert) pairs routed to its experts.

A chain that differs (biases on the experts, another gating such as GPT-OSS's
clamped one, a post-expert norm) is left dense, with an INFO log line.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import tvm
from tvm import relax

from tvm_distx.compiler.schedule.experts import EXPERTS_ATTR, ExpertsKernel, experts_definition
from tvm_distx.ir import helpers as _ir

__all__ = ["Dispatch", "dense_dispatches", "fuse_expert_dispatch", "experts_calls"]

logger = logging.getLogger(__name__)

_LAYOUT = ("relax.permute_dims", "relax.expand_dims", "relax.astype")


def _permute_axes(call) -> list[int]:
    ndim = len(call.args[0].ty.shape)
    return list(range(ndim))[::-1] if call.attrs.axes is None else [int(a) for a in call.attrs.axes]


@dataclass(frozen=True)
class Dispatch:
    """One dense expert dispatch found in a function.

    Attributes
    ----------
    kernel : ExpertsKernel
        The experts kernel it becomes (all ``E`` experts).
    top_k : int or None
        Experts per token: the width of the top-k indices scattered into the
        routing matrix (None if the routing matrix is not such a scatter).
    up, down : str
        The expert weights' parameter names.
    """

    kernel: ExpertsKernel
    top_k: int | None
    up: str
    down: str


def _halves(split: relax.Call) -> bool:
    """Whether ``split`` cuts its last axis into two equal halves (2 sections, or at I of 2I)."""
    sections = split.attrs.indices_or_sections
    if hasattr(sections, "value"):
        return int(sections.value) == 2
    extent = _ir.static_ints([split.args[0].ty.shape[-1]])
    return extent is not None and len(sections) == 1 and 2 * int(sections[0]) == extent[0]


class _Chain:
    """The bindings of one function, read backwards from a dispatch's final ``sum``."""

    def __init__(self, func: relax.Function) -> None:
        self.bound: dict = {}
        for block in func.body.blocks:
            for binding in block.bindings:
                self.bound[binding.var] = binding.value
        self.params = set(func.params)

    def value(self, expr, op: str | None = None):
        value = self.bound.get(expr) if isinstance(expr, relax.Var) else None
        return value if op is None or _ir.operator_name(value) == op else None

    def weight(self, expr) -> tuple[relax.Var, bool] | None:
        """A 3-D parameter ``expr`` views, and whether its last two axes are swapped."""
        swapped = False
        while expr not in self.params:
            value = self.value(expr, "relax.permute_dims")
            if value is None:
                return None
            if _permute_axes(value) != [0, 2, 1]:
                return None
            swapped, expr = not swapped, value.args[0]
        return (expr, swapped) if len(expr.ty.shape) == 3 else None

    def routing(self, expr) -> relax.Expr | None:
        """The ``(T, E)`` matrix that ``expand_dims(permute_dims(c, [1, 0]), -1)`` views."""
        expand = self.value(expr, "relax.expand_dims")
        if expand is None or [int(a) for a in expand.attrs.axis] not in ([-1], [2]):
            return None
        permute = self.value(expand.args[0], "relax.permute_dims")
        if permute is None or _permute_axes(permute) != [1, 0]:
            return None
        return permute.args[0]

    def gated(self, expr) -> relax.Expr | None:
        """``h`` if ``expr`` is ``silu(h[..., :I]) * h[..., I:]`` via ``split``."""
        mul = self.value(expr, "relax.multiply")
        if mul is None:
            return None
        for act, other in (mul.args, mul.args[::-1]):
            silu = self.value(act, "relax.nn.silu")
            if silu is None:
                continue
            first, second = self.value(silu.args[0]), self.value(other)
            if not (isinstance(first, relax.TupleGetItem) and isinstance(second, relax.TupleGetItem)
                    and first.tuple_value.same_as(second.tuple_value)
                    and (first.index, second.index) == (0, 1)):
                return None
            split = self.value(first.tuple_value, "relax.split")
            if split is None or int(split.attrs.axis) not in (-1, 2) or not _halves(split):
                return None
            return split.args[0]
        return None

    def top_k(self, combine) -> int | None:
        """The k of a routing matrix scattered from ``(T, k)`` top-k indices."""
        scatter = self.value(combine, "relax.scatter_elements")
        if scatter is None:
            return None
        width = _ir.static_ints([scatter.args[1].ty.shape[-1]])
        return None if width is None else width[0]

    def dispatch(self, total: relax.Call):
        """``(x, combine, up, down, kernel)`` of the chain ending at ``total``, or None."""
        if _ir.operator_name(total) != "relax.sum" or total.attrs.keepdims or total.attrs.axis is None \
                or [int(a) for a in total.attrs.axis] != [0]:
            return None
        scaled = self.value(total.args[0], "relax.multiply")
        if scaled is None:
            return None
        for y, c in (scaled.args, scaled.args[::-1]):
            down_mm = self.value(y, "relax.matmul")
            combine = self.routing(c)
            if down_mm is None or combine is None:
                continue
            down = self.weight(down_mm.args[1])
            h = self.gated(down_mm.args[0])
            up_mm = self.value(h, "relax.matmul") if h is not None else None
            up = self.weight(up_mm.args[1]) if up_mm is not None else None
            if down is None or up is None:
                return None
            x = up_mm.args[0]
            (w_up, up_swapped), (w_down, down_swapped) = up, down
            dims = [_ir.static_ints(v.ty.shape) for v in (x, w_up, w_down)]
            if None in dims[1:] or len(x.ty.shape) != 2 or len(combine.ty.shape) != 2:
                return None
            if _ir.static_ints([x.ty.shape[1]]) is None:
                return None
            experts, hidden = dims[1][0], int(x.ty.shape[1])
            # the matmul's rhs is (E, H, 2I): swapped from the parameter unless stored so
            inter2 = dims[1][1] if up_swapped else dims[1][2]
            kernel = ExpertsKernel(experts, hidden, inter2 // 2, str(x.ty.dtype),
                                   up_transposed=not up_swapped,
                                   down_transposed=not down_swapped)
            if tuple(dims[1]) != kernel.up_shape or tuple(dims[2]) != kernel.down_shape or \
                    len({str(v.ty.dtype) for v in (x, combine, w_up, w_down)}) != 1:
                return None
            return x, combine, w_up, w_down, kernel
        return None


@relax.expr_functor.mutator
class _Replace(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, calls: dict) -> None:
        super().__init__(mod)
        self.calls = calls  # binding var -> (kernel, operands)
        self.kernels: dict[ExpertsKernel, tvm.ir.GlobalVar] = {}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var not in self.calls:
            super().visit_var_binding_(binding)
            return
        kernel, args = self.calls[binding.var]
        gv = self.kernels.get(kernel)
        if gv is None:
            name = f"experts_e{kernel.experts}_h{kernel.hidden}_i{kernel.intermediate}"
            gv = self.kernels[kernel] = self.builder_.add_func(experts_definition(kernel), name)
        call = relax.call_tir(gv, [self.visit_expr(a) for a in args],
                              relax.TensorType(binding.var.ty.shape, binding.var.ty.dtype))
        self.builder_.emit_normalized(relax.VarBinding(binding.var,
                                                       self.builder_.normalize(call)))


def fuse_expert_dispatch(mod: tvm.IRModule, function: str = "main") -> tvm.IRModule:
    """``mod`` with every dense expert dispatch of ``function`` one experts kernel call.

    Parameters
    ----------
    mod : tvm.IRModule
        An imported module (before ``LegalizeOps``).
    function : str
        The Relax function to rewrite.

    Returns
    -------
    tvm.IRModule
        The module with one ``call_tir`` of an experts kernel per dispatch
        found; ``mod`` itself when none is.
    """
    func = mod[function]
    chain = _Chain(func)
    found = {var: chain.dispatch(value) for var, value in chain.bound.items()
             if _ir.operator_name(value) == "relax.sum"}
    found = {var: d for var, d in found.items() if d is not None}
    if not found:
        logger.info("%s: no dense expert dispatch of the form tvm_distx.plans.moe_dispatch reads; "
                    "the experts stay dense", function)
        return mod
    calls = {}
    for var, (x, combine, w_up, w_down, kernel) in found.items():
        calls[var] = (kernel, (x, combine, w_up, w_down))
        logger.info("%s: the experts of %s and %s run as one sparse experts kernel",
                    function, w_up.name, w_down.name)
    replace = _Replace(mod, calls)
    new = relax.analysis.remove_all_unused(replace.visit_expr(func))
    out = replace.builder_.get()
    out[function] = new
    return out


def dense_dispatches(mod: tvm.IRModule, function: str = "main") -> list[Dispatch]:
    """The dense expert dispatches of ``function`` that :func:`fuse_expert_dispatch` replaces."""
    chain = _Chain(mod[function])
    out = []
    for value in chain.bound.values():
        found = chain.dispatch(value) if _ir.operator_name(value) == "relax.sum" else None
        if found is not None:
            _, combine, w_up, w_down, kernel = found
            out.append(Dispatch(kernel, chain.top_k(combine), w_up.name, w_down.name))
    return out


def experts_calls(mod: tvm.IRModule, function: str = "main"):
    """``(binding var, call, ExpertsKernel)`` of every experts kernel call in ``function``."""
    func = mod[function]
    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if _ir.operator_name(value) != "relax.call_tir" or not isinstance(value.args[0], tvm.ir.GlobalVar):
                continue
            callee = mod[value.args[0]]
            if isinstance(callee, tvm.tirx.PrimFunc) and callee.attrs is not None and \
                    EXPERTS_ATTR in callee.attrs:
                yield binding.var, value, ExpertsKernel.of(callee)
