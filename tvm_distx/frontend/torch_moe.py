"""Mixture-of-experts layers made traceable with static shapes, for :func:`tvm_distx.from_torch`.

transformers stores a sparse MLP's experts as fused 3-D parameters (one slice
per expert: ``gate_up_proj`` of shape ``(E, 2 I, H)``, ``down_proj`` of shape
``(E, H, I)``, or their transposes) and routes tokens with data-dependent
shapes: ``nonzero`` and a Python loop over the experts hit (eager), or a sort,
``histc`` and an opaque grouped matmul (``grouped_mm``). Neither traces into a
static Relax graph, and neither keeps the expert dimension visible to sharding
propagation.

:func:`static_experts` swaps, for the time of an export, the forward of every
experts module it finds for a *dense dispatch* that is mathematically the
same::

    combine[t, index[t, k]] = w[t, k]                             # (T, E)
    h[e, t, :]    = gate(x[t] @ W_up[e])                         # (E, T, I)
    y[e, t, :]    = h[e, t] @ W_down[e]                           # (E, T, H)
    out[t, :]     = sum_e combine[t, e] * y[e, t]                 # (T, H)

Every shape is static and the expert dimension ``e`` is a batch dimension of
two batched matmuls, summed only at the end. Splitting the fused expert
parameters on ``e`` (expert parallelism, :mod:`tvm_distx.plans.moe`) therefore
keeps each rank on its own experts and leaves one partial sum per layer, the
``combine`` reduction, completed by one all-reduce. The routing weights of the
experts a token did not choose are exactly zero, so the result equals
transformers' to rounding (only the order of the top-k additions differs).

The price is compute: every local expert runs on every token (masked dense
work), ``E / k`` times the arithmetic of a sparse dispatch. The tokens that
an expert did not receive contribute exact zeros.

Experts modules are found by structure, not by class or layer names: a module
that carries transformers' experts interface (``has_gate``, ``has_bias``,
``is_transposed`` and two fused 3-D parameters with one leading dimension, the
expert count) and whose forward takes the routing as three positional inputs
(tokens, top-k indices, top-k weights). Activation and gating go through the
module's own ``act_fn`` / ``_apply_gate``, so a family's gating variant is kept.

:data:`CONVERTERS` holds the converters the routers need beyond TVM's
frontend (for its ``custom_convert_map``): in-place ``div_`` and
``scatter_``, ``masked_fill`` with an infinite value, and
``topk(sorted=False)``. :mod:`tvm_distx.frontend.torch_ops` includes them, so
:func:`tvm_distx.from_torch` uses them.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import types
from typing import Iterator

from tvm import relax

from tvm_distx.errors import UnsupportedProgramError

__all__ = ["static_experts", "find_experts", "dense_experts_forward", "CONVERTERS"]

logger = logging.getLogger(__name__)


def _fused_weights(module):
    """The (up, down) 3-D expert parameters of a transformers experts module, or None."""
    up = getattr(module, "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj", None)
    down = getattr(module, "down_proj", None)
    import torch

    if not (isinstance(up, torch.Tensor) and isinstance(down, torch.Tensor)):
        return None
    if up.dim() != 3 or down.dim() != 3 or up.shape[0] != down.shape[0]:
        return None
    return up, down


def _takes_routing(forward) -> bool:
    """Whether ``forward`` takes three positional inputs: tokens, top-k indices, top-k weights."""
    forward = getattr(forward, "__wrapped__", forward)  # the interface's dispatching wrapper
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return False
    if params and params[0].name == "self":
        params = params[1:]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 or any(p.kind == p.VAR_POSITIONAL for p in params)


def _is_experts_module(module) -> bool:
    if not all(hasattr(module, a) for a in ("has_gate", "has_bias", "is_transposed")):
        return False
    return _fused_weights(module) is not None and _takes_routing(module.forward)


def find_experts(model) -> list[tuple[str, object]]:
    """The experts modules of ``model`` (name, module), found by their fused 3-D weights.

    Parameters
    ----------
    model : torch.nn.Module
        Any module; only transformers-style experts modules are returned.

    Returns
    -------
    list of (str, torch.nn.Module)
    """
    return [(name, m) for name, m in model.named_modules() if _is_experts_module(m)]


def dense_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The dense dispatch of the module docstring, as a forward of an experts module.

    Parameters
    ----------
    hidden_states : torch.Tensor
        ``(T, H)`` tokens.
    top_k_index : torch.Tensor
        ``(T, k)`` chosen experts.
    top_k_weights : torch.Tensor
        ``(T, k)`` their routing weights.

    Returns
    -------
    torch.Tensor
        ``(T, H)``.
    """
    import torch

    if getattr(self, "_is_expert_parallel", False):
        raise UnsupportedProgramError(
            f"{type(self).__name__} is set up for transformers' own expert parallelism",
            hint="export the unsharded model; tvm_distx.plans.moe.expert_parallel() splits the experts")
    up, down = _fused_weights(self)
    num_experts = up.shape[0]
    x = hidden_states
    # a token's top-k experts are distinct, so scattering its weights is their sum
    combine = torch.zeros(x.shape[0], num_experts, dtype=top_k_weights.dtype, device=x.device)
    combine = combine.scatter(1, top_k_index, top_k_weights)                  # (T, E)

    h = torch.matmul(x, up if self.is_transposed else up.transpose(1, 2))     # (E, T, 2I)
    if self.has_bias:
        h = h + (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias).unsqueeze(1)
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    y = torch.matmul(h, down if self.is_transposed else down.transpose(1, 2))  # (E, T, H)
    if self.has_bias:
        y = y + self.down_proj_bias.unsqueeze(1)
    if getattr(self, "has_post_expert_norm", False):
        y = self.post_expert_norm(y)
    out = (y * combine.transpose(0, 1).unsqueeze(-1)).sum(dim=0)                # (T, H)
    return out.to(hidden_states.dtype)


@contextlib.contextmanager
def static_experts(model) -> Iterator[list[str]]:
    """Within the block, every experts module of ``model`` runs the static dense dispatch.

    Use it around ``torch.export`` (``from_torch`` does). The original
    forwards are restored on exit.

    Parameters
    ----------
    model : torch.nn.Module

    Yields
    ------
    list of str
        The names of the experts modules switched.

    Examples
    --------
    >>> with static_experts(model):                       # doctest: +SKIP
    ...     mod, weights = tvm_distx.from_torch(model, (ids,))
    """
    found = find_experts(model)
    saved = []
    try:
        for name, module in found:
            saved.append((module, module.__dict__.get("forward")))
            module.forward = types.MethodType(dense_experts_forward, module)
        if found:
            logger.info("static expert dispatch for %d experts modules: %s", len(found),
                        ", ".join(n for n, _ in found))
        yield [n for n, _ in found]
    finally:
        for module, forward in saved:
            if forward is None:
                del module.forward
            else:
                module.forward = forward


def _in_place(functional: str):
    """A converter of an in-place operator (``div_``, ``scatter_``) as its functional form.

    Later users of the result read the converted value; so do later users of
    the mutated operand, whose binding is replaced.
    """

    def convert(node, importer):
        result = importer.convert_map[functional](node)
        importer.env[node.args[0]] = result
        return result

    convert.__name__ = f"convert_{functional.split('.')[0]}_in_place"
    return convert


def _topk_any_order(node, importer):
    """``topk`` with ``sorted=False`` (routers with group-limited selection ask for it).

    Unsorted means "in any order", and the sorted order is one of them, so
    TVM's sorted ``topk`` is a correct translation.
    """

    args = importer.retrieve_args(node)
    names = ("input", "k", "dim", "largest", "sorted")
    given = dict(zip(names, args))
    given.update(node.kwargs)
    return importer.block_builder.emit(relax.op.topk(
        given["input"], k=given.get("k", 1), axis=given.get("dim", -1),
        largest=given.get("largest", True), ret_type="both", dtype="int64"))


def _masked_fill(node, importer):
    """``masked_fill(x, mask, value)`` as ``where(mask, value, x)`` with a scalar constant.

    TVM's converter materialises ``full_like(x, value)``, whose legalization
    fails for an infinite value (the group mask of a router fills with -inf).
    """

    x, mask, value = importer.retrieve_args(node)[:3]
    fill = relax.const(value, str(x.ty.dtype)) if isinstance(value, (int, float)) else value
    return importer.block_builder.emit(relax.op.where(mask, fill, x))


def _masked_fill_in_place(node, importer):
    result = _masked_fill(node, importer)
    importer.env[node.args[0]] = result
    return result


#: Converters for ``tvm.relax.frontend.torch.from_exported_program(custom_convert_map=...)``
#: that routers need beyond TVM's frontend: the in-place normalisation of the top-k
#: weights (``div_``), the group mask of group-limited routing (``scatter_``, and
#: ``masked_fill`` with -inf), and ``topk(..., sorted=False)``. Each is called with the
#: FX node and the importer.
CONVERTERS = {
    "div_.Tensor": _in_place("div.Tensor"),
    "scatter_.value": _in_place("scatter.value"),
    "scatter_.src": _in_place("scatter.src"),
    "topk.default": _topk_any_order,
    "masked_fill.Scalar": _masked_fill,
    "masked_fill_.Scalar": _masked_fill_in_place,
}
