"""PyTorch operators that TVM's frontend lacks, as converters for :func:`tvm_distx.from_torch`.

TVM's ``from_exported_program`` translates each ATen operator of an exported
program through a table, and refuses a program with an operator the table
lacks. The operators below appear in Hugging Face causal language models
(the attention-mask and position code) and in reference model code, and each
has a short exact translation into Relax operators that our sharding rules
already know:

* ``diff``: two ``strided_slice`` and a ``subtract`` (``n`` times);
* ``repeat_interleave``: ``repeat`` (an integer count per element);
* ``where.ScalarOther`` / ``where.ScalarSelf``: ``where`` with a scalar constant;
* ``to.device``: the value itself, cast if a dtype is given;
* ``_unsafe_view``: ``reshape``;
* ``scaled_dot_product_attention``: two 4-D ``matmul`` around a ``softmax``, any mask;
* ``cumsum``: ``cumsum`` in the dtype torch gives the result;
* ``full``: a 0-d constant broadcast when the value is infinite or NaN;
* ``new_empty``: ``zeros``;
* ``numpy_T`` (``weight.T``, Falcon's linears): ``permute_dims`` of every axis;
* ``max.dim``, ``min.dim``: a reduction (TVM's is a ``topk`` of one, which sharding
  cannot see through), and the indices only when they are read;
* ``index`` with negative indices (Falcon's ``fused_qkv[..., [-2], :]``): counted
  from the end before TVM's translation, which would read out of bounds;
* ``layer_norm`` without a weight or a bias (OLMo's): constants in their place;
* ``&``, ``|``, ``^``: TVM's own, cast to the dtype torch gives the result;
* ``slice``, ``split``, ``narrow``, ``select``: TVM's own, with the result's shape
  stated as torch.export knows it (a ``match_cast``).

:data:`CONVERTERS` maps each to its converter, in the form of the frontend's
``custom_convert_map``: a function ``(fx.Node, importer) -> relax.Var``.
"""

from __future__ import annotations

import functools
import logging
import math
import operator
from typing import Callable

import numpy as np
from tvm import relax
import tvm

from tvm_distx.frontend.tvm_converters import original_converter
from tvm_distx.ir import helpers as _ir

__all__ = ["CONVERTERS", "converters"]

logger = logging.getLogger(__name__)


def _arg(node, index: int, name: str, default=None):
    """Argument ``index`` of an fx node, or its keyword ``name``, or ``default``."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _dtype_of(expr: relax.Expr) -> str:
    return str(expr.ty.dtype)


def _ndim_of(expr: relax.Expr) -> int:
    return int(expr.ty.ndim)


def _diff(node, importer) -> relax.Var:
    """``torch.diff(x, n, dim, prepend, append)``: ``x[1:] - x[:-1]`` along ``dim``, n times."""
    bb, env = importer.block_builder, importer.env
    x = env[node.args[0]]
    n = int(_arg(node, 1, "n", 1))
    dim = int(_arg(node, 2, "dim", -1))
    prepend, append = _arg(node, 3, "prepend"), _arg(node, 4, "append")
    axis = dim % _ndim_of(x)
    pieces = [env[prepend]] if prepend is not None else []
    pieces.append(x)
    if append is not None:
        pieces.append(env[append])
    if len(pieces) > 1:
        x = bb.emit(relax.op.concat(pieces, axis=axis))
    for _ in range(n):
        extent = x.ty.shape[axis]
        # in bounds by construction: without the promise, a symbolic extent
        # gives each slice a different clamped extent and their difference
        # loses its shape
        later = bb.emit(relax.op.strided_slice(x, [axis], [1], [extent], assume_inbound=True))
        earlier = bb.emit(relax.op.strided_slice(x, [axis], [0], [extent - 1],
                                                 assume_inbound=True))
        x = (bb.emit(relax.op.not_equal(later, earlier)) if _dtype_of(x) == "bool"
             else bb.emit(relax.op.subtract(later, earlier)))
    return x


def _repeat_interleave(node, importer) -> relax.Var:
    """``repeat_interleave(x, repeats: int, dim)``: each element ``repeats`` times along ``dim``."""

    x = importer.env[node.args[0]]
    repeats = _arg(node, 1, "repeats")
    dim = _arg(node, 2, "dim")
    if not isinstance(repeats, int):
        raise UnsupportedProgramError(
            "repeat_interleave with a tensor of repeat counts has a data-dependent shape",
            hint="repeat by an int (x.repeat_interleave(2, dim=1)), or expand and reshape")
    if dim is None:  # torch flattens first
        x = importer.block_builder.emit(relax.op.reshape(x, [-1]))
        dim = 0
    return importer.block_builder.emit(relax.op.repeat(x, repeats, axis=int(dim)))


def _scalar(value, like: relax.Expr) -> relax.Expr:
    if isinstance(value, relax.Expr):
        return value
    return relax.const(value, _dtype_of(like))


def _where_scalar_other(node, importer) -> relax.Var:
    """``where(condition, x, scalar)``."""
    env = importer.env
    x = env[node.args[1]]
    return importer.block_builder.emit(
        relax.op.where(env[node.args[0]], x, _scalar(node.args[2], x)))


def _where_scalar_self(node, importer) -> relax.Var:
    """``where(condition, scalar, y)``."""
    env = importer.env
    y = env[node.args[2]]
    return importer.block_builder.emit(
        relax.op.where(env[node.args[0]], _scalar(node.args[1], y), y))


def _to_device(node, importer) -> relax.Var:
    """``x.to(device, dtype=...)``: devices do not exist in the graph; a dtype is a cast."""
    import torch

    x = importer.env[node.args[0]]
    dtype = _arg(node, 2, "dtype")
    if isinstance(dtype, torch.dtype):
        target = importer._convert_data_type(dtype, importer.env)
        if target != _dtype_of(x):
            return importer.block_builder.emit(relax.op.astype(x, target))
    return x


def _unsafe_view(node, importer) -> relax.Var:
    """``_unsafe_view(x, shape)``: a reshape."""
    return importer.block_builder.emit(
        relax.op.reshape(importer.env[node.args[0]], list(node.args[1])))


def _sdpa(node, importer) -> relax.Var:
    """``scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)``.

    Written out as two 4-D matmuls around a softmax over ``(batch, heads, query,
    key)`` scores, so that the heads stay a batch dimension that sharding can
    split (TVM's converter goes through ``nn.attention``, which takes no
    boolean mask). A boolean mask (or ``is_causal``) keeps a score where it is
    true and puts the dtype's lowest finite value elsewhere, as transformers'
    own masks do; grouped-query attention (``enable_gqa``) repeats each key and
    value head for its group of query heads.
    """


    bb, env = importer.block_builder, importer.env
    q, k, v = (env[a] for a in node.args[:3])
    mask = _arg(node, 3, "attn_mask")
    dropout = _arg(node, 4, "dropout_p", 0.0)
    causal = bool(_arg(node, 5, "is_causal", False))
    scale = _arg(node, 6, "scale")
    gqa = bool(node.kwargs.get("enable_gqa", False))
    if _ndim_of(q) != 4:
        raise UnsupportedProgramError(
            f"scaled_dot_product_attention on {_ndim_of(q)}-D queries",
            hint="pass (batch, heads, sequence, head_dim) queries, keys and values")
    if dropout:
        raise UnsupportedProgramError("scaled_dot_product_attention with dropout",
                                      hint="put the model in eval mode (model.eval())")
    dtype = _dtype_of(q)
    heads, kv_heads = q.ty.shape[1], k.ty.shape[1]
    if gqa and not (isinstance(heads, int) or hasattr(heads, "value")):
        raise UnsupportedProgramError("grouped-query attention with a symbolic head count",
                                      hint="give the heads a static size")
    if gqa and int(heads) != int(kv_heads):
        group = int(heads) // int(kv_heads)
        k = bb.emit(relax.op.repeat(k, group, axis=1))
        v = bb.emit(relax.op.repeat(v, group, axis=1))
    if scale is None:
        head_dim = q.ty.shape[3]
        scale = 1.0 / float(np.sqrt(int(head_dim)))
    scores = bb.emit(relax.op.matmul(q, bb.emit(relax.op.permute_dims(k, [0, 1, 3, 2]))))
    scores = bb.emit(relax.op.multiply(scores, relax.const(scale, dtype)))
    lowest = relax.const(float(np.finfo(dtype).min), dtype)
    if causal:
        length_q, length_k = q.ty.shape[2], k.ty.shape[2]
        ones = bb.emit(relax.op.full([length_q, length_k], relax.const(True, "bool"), "bool"))
        keep = bb.emit(relax.op.tril(ones, length_k - length_q))
        scores = bb.emit(relax.op.where(keep, scores, lowest))
    if mask is not None:
        is_bool = str(getattr(mask.meta.get("val"), "dtype", "")) == "torch.bool"
        mask = env[mask]
        if is_bool and _dtype_of(mask) != "bool":  # TVM's bitwise ops on bools give int64
            mask = bb.emit(relax.op.astype(mask, "bool"))
        if is_bool or _dtype_of(mask) == "bool":
            scores = bb.emit(relax.op.where(mask, scores, lowest))
        else:
            scores = bb.emit(relax.op.add(scores, mask))
    weights = bb.emit(relax.op.nn.softmax(scores, axis=-1))
    return bb.emit(relax.op.matmul(weights, v))


def _torch_dtype_of(node) -> str | None:
    """The dtype torch.export recorded for a node's result, as a Relax dtype string."""
    value = node.meta.get("val")
    dtype = getattr(value, "dtype", None)
    return str(dtype).replace("torch.", "") if dtype is not None else None


def _with_torch_dtype(name: str) -> Callable:
    """TVM's own converter of ``name``, its result cast to the dtype torch gives it.

    TVM keeps the operand dtype where torch promotes: ``cumsum`` of booleans is
    ``int64`` in torch (a count), and ``&`` of booleans comes out ``int64`` of
    TVM's bitwise operator. The dtype torch.export recorded is the truth.
    """
    def convert(node, importer) -> relax.Var:
        out = original_converter(importer, name)(node)
        want = _torch_dtype_of(node)
        if want is not None and isinstance(out.ty, relax.TensorType) and _dtype_of(out) != want:
            out = importer.block_builder.emit(relax.op.astype(out, want))
        return out

    convert.__name__ = f"converted_{name.replace('.', '_')}"
    return convert


def _non_finite(value) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def _filled(importer, shape, value, dtype: str) -> relax.Var:
    """A tensor of ``shape`` filled with ``value``, infinite and NaN values included.

    TVM's ``full`` fails in LegalizeOps on a non-finite value (a TypeError in
    its TOPI check of the dtype), so those broadcast a 0-d constant instead.
    """

    bb = importer.block_builder
    if not _non_finite(value):
        return bb.emit(relax.op.full(shape, relax.const(value, dtype), dtype))
    scalar = relax.const(np.array(value, dtype=dtype))
    return bb.emit(relax.op.broadcast_to(scalar, shape))


def _full(node, importer) -> relax.Var:
    """``torch.full(size, value)``, infinite and NaN fill values included."""
    value = _arg(node, 1, "fill_value")
    if not _non_finite(value):
        return original_converter(importer, "full.default")(node)
    size = node.args[0] if isinstance(node.args[0], (list, tuple)) else (node.args[0],)
    shape = [importer.env[d] if not isinstance(d, int) else d for d in size]
    dtype = _torch_dtype_of(node) or "float32"
    return _filled(importer, shape, value, dtype)


def _new_empty(node, importer) -> relax.Var:
    """``x.new_empty(size)``: zeros (an uninitialised tensor may hold anything, zeros too)."""
    size = _arg(node, 1, "size")
    shape = [importer.env[d] if not isinstance(d, int) else d for d in size]
    dtype = _torch_dtype_of(node) or _dtype_of(importer.env[node.args[0]])
    return importer.block_builder.emit(relax.op.zeros(shape, dtype))


#: TVM converters whose result dtype can differ from torch's (see :func:`_with_torch_dtype`).
_DTYPE_CHECKED = ("__and__.Tensor", "__or__.Tensor", "__xor__.Tensor",
                  "bitwise_and.Tensor", "bitwise_or.Tensor", "bitwise_xor.Tensor")


def _cumsum(node, importer) -> relax.Var:
    """``cumsum(x, dim, dtype)``, accumulated in the dtype torch gives the result.

    torch counts booleans and small integers in ``int64``; TVM would accumulate
    in the operand's dtype (a boolean running sum saturates at true).
    """
    bb = importer.block_builder
    x = importer.env[node.args[0]]
    dim = int(_arg(node, 1, "dim"))
    want = _torch_dtype_of(node)
    if want is not None and _dtype_of(x) != want:
        x = bb.emit(relax.op.astype(x, want))
    return bb.emit(relax.op.cumsum(x, axis=dim))


def _shape_vars(importer) -> dict[str, object]:
    """The program's symbolic dimensions (TIR variables) by name, from its inputs' shapes."""
    found = importer.__dict__.get("_tvm_distx_shape_vars")
    if found is None:
        found = {}
        for value in importer.env.values():
            ty = getattr(value, "ty", None)
            if isinstance(value, relax.Var) and isinstance(ty, relax.TensorType) and \
                    isinstance(ty.shape, relax.ShapeExpr):
                for dim in ty.shape.values:
                    if isinstance(dim, tvm.tirx.Var):
                        found.setdefault(dim.name, dim)
        importer.__dict__["_tvm_distx_shape_vars"] = found
    return found


def _tir_dim(dim, names: dict):
    """A torch size (int or SymInt) as a TIR expression over ``names``, or None."""
    import sympy
    import torch

    if isinstance(dim, int):
        return dim
    if not isinstance(dim, torch.SymInt):
        return None
    expr = dim.node.expr

    def convert(e):
        if isinstance(e, sympy.Integer):
            return tvm.tirx.IntImm("int64", int(e))
        if isinstance(e, sympy.Symbol):
            return names.get(str(e))
        if isinstance(e, (sympy.Add, sympy.Mul)):
            terms = [convert(a) for a in e.args]
            if any(t is None for t in terms):
                return None
            out = terms[0]
            for t in terms[1:]:
                out = out + t if isinstance(e, sympy.Add) else out * t
            return out
        return None

    return convert(expr)


def _with_torch_shape(name: str) -> Callable:
    """TVM's own converter of ``name``, its result's shape the one torch.export knows.

    TVM infers a slice's extent without knowing the symbolic dimensions'
    ranges: ``ids[:, :1]`` on a sequence of ``s`` tokens gets the extent
    ``min(1, s)``, which every later shape carries, and a kernel whose buffer
    extents are such expressions cannot be built. torch.export knows ``s >= 1``
    and records the extent ``1``; a ``match_cast`` to that shape states it.
    """
    def convert(node, importer) -> relax.Var:
        out = original_converter(importer, name)(node)
        value = node.meta.get("val")
        if value is None or not isinstance(out.ty, relax.TensorType) or \
                not isinstance(out.ty.shape, relax.ShapeExpr):
            return out
        names = _shape_vars(importer)
        shape = [_tir_dim(d, names) for d in value.shape]
        if any(d is None for d in shape):
            return out
        analyzer = tvm.sym.Analyzer()
        have = out.ty.shape.values
        if len(have) == len(shape) and all(
                analyzer.can_prove_equal(a, b) for a, b in zip(have, shape)):
            return out
        return importer.block_builder.match_cast(out, relax.TensorType(shape, _dtype_of(out)))

    convert.__name__ = f"shaped_{name.replace('.', '_')}"
    return convert


def _numpy_t(node, importer) -> relax.Var:
    """``x.T`` (``numpy_T``): every axis reversed, as numpy's ``.T`` does."""
    return importer.block_builder.emit(relax.op.permute_dims(importer.env[node.args[0]]))


def _layer_norm(node, importer) -> relax.Var:
    """``layer_norm(x, shape, weight, bias, eps)``, the weight or the bias possibly absent.

    A norm without an affine part (``elementwise_affine=False``, OLMo's) passes
    None for both; TVM's translation looks None up as a value. An absent weight
    is ones and an absent bias zeros, as constants of the normalized shape.
    """
    x = importer.env[node.args[0]]
    shape = [int(d) for d in node.args[1]]
    dtype = _dtype_of(x)

    def part(index: int, name: str, fill: float) -> relax.Expr:
        value = _arg(node, index, name)
        if value is None:
            return relax.const(np.full(shape, fill, dtype))
        return importer.env[value]

    eps = float(_arg(node, 4, "eps", 1e-5))
    axes = list(range(-len(shape), 0))
    return importer.block_builder.emit(relax.op.nn.layer_norm(
        x, part(2, "weight", 1.0), part(3, "bias", 0.0), axes=axes, epsilon=eps))


def _index_from_the_end(node, importer, constants=None) -> relax.Var:
    """``x[..., index, ...]`` (``index.Tensor``) with negative indices counted from the end.

    TVM's translation takes the indices as they are, into a ``take`` that reads
    out of bounds for a negative one (Falcon's ``fused_qkv[..., [-2], :]``
    picked garbage). Each index along an axis of static extent ``n`` becomes
    ``index + n`` where it is negative: a constant is fixed where it stands (a
    list of ints, which torch.export lifts to an input, is looked up in
    ``constants``, see :func:`converters`), a computed index by a ``where``.
    Then TVM's translation runs on the fixed indices, and later passes see a
    constant ``take`` (a fused projection cut by its heads).
    """
    bb, env = importer.block_builder, importer.env
    data = env[node.args[0]]
    shape = _ir.static_shape(data.ty) or ()
    saved = {}
    for axis, index_node in enumerate(node.args[1]):
        if index_node is None or axis >= len(shape) or shape[axis] is None:
            continue
        index, extent = env[index_node], shape[axis]
        lifted = _lifted_value(index_node, constants or {})
        if lifted is not None:
            index = relax.const(lifted)
        if isinstance(index, tvm.ir.Constant):
            values = index.value.numpy()
            if lifted is None and not (values < 0).any():
                continue
            fixed = relax.const(np.where(values < 0, values + extent, values).astype(values.dtype))
        else:
            dtype = _dtype_of(index)
            fixed = bb.emit(relax.op.where(
                relax.op.less(index, relax.const(0, dtype)),
                relax.op.add(index, relax.const(extent, dtype)), index))
        saved[index_node] = env[index_node]
        env[index_node] = fixed
    try:
        return original_converter(importer, "index.Tensor")(node)
    finally:
        env.update(saved)


#: TVM converters whose result shape can be clumsier than torch's (:func:`_with_torch_shape`).
_SHAPE_CHECKED = ("slice.Tensor", "narrow.default", "split.Tensor", "select.int")


#: Converters by ATen overload name, for ``from_exported_program(custom_convert_map=...)``.
def _extreme_along(largest: bool) -> Callable:
    """``max.dim`` / ``min.dim``: the values by a reduction, the indices only when read.

    TVM's translation is a ``topk`` of one element, which carries no sharding rule:
    GPT-OSS's ``scores.max(dim=-1, keepdim=True).values`` over scores split by heads
    gathered every head's scores. A reduction along the axis keeps every other axis
    where it lies. The indices, an ``argmax``/``argmin``, are emitted only when the
    program reads them.
    """

    def convert(node, importer):
        bb, env = importer.block_builder, importer.env
        x = env[node.args[0]]
        axis = int(_arg(node, 1, "dim"))
        keep = bool(_arg(node, 2, "keepdim", False))
        reduce, pick = (relax.op.max, relax.op.argmax) if largest else (relax.op.min,
                                                                         relax.op.argmin)
        values = bb.emit(reduce(x, axis=axis, keepdims=keep))
        getitems = [user for user in node.users if user.target is operator.getitem]
        if len(getitems) == len(node.users) and not any(
                user.args[1] == 1 and user.users for user in getitems):
            return (values, None)  # the indices are never read
        indices = bb.emit(pick(x, axis=axis, keepdims=keep))
        if _dtype_of(indices) != "int64":
            indices = bb.emit(relax.op.astype(indices, "int64"))
        return bb.emit(relax.Tuple([values, indices]))

    return convert


def _lifted_value(node, constants: dict[str, np.ndarray]) -> np.ndarray | None:
    """The value of a tensor constant torch.export lifted to an input, behind ``node``."""
    while getattr(node, "op", None) == "call_function" and len(node.args) == 1 and \
            str(node.target).split(".")[-2:-1] in (["lift_fresh_copy"], ["clone"], ["detach"]):
        node = node.args[0]
    if getattr(node, "op", None) != "placeholder":
        return None
    return constants.get(node.name)


def converters(exported=None) -> dict[str, Callable]:
    """:data:`CONVERTERS`, with those that read the tensor constants of ``exported``.

    Parameters
    ----------
    exported : torch.export.ExportedProgram, optional
        The program translated; its lifted tensor constants (a list of ints
        written in ``forward``) are read by the ``index`` converter.
    """
    constants = {}
    if exported is not None:
        kinds = exported.graph_signature.input_specs
        for spec in kinds:
            if spec.kind.name == "CONSTANT_TENSOR" and spec.target in exported.constants:
                value = exported.constants[spec.target]
                if value.dtype.is_floating_point or value.numel() > 4096:
                    continue  # index lists only
                constants[spec.arg.name] = value.detach().cpu().numpy()
    return {**CONVERTERS, "index.Tensor": functools.partial(_index_from_the_end,
                                                            constants=constants)}


CONVERTERS: dict[str, Callable] = {
    "diff.default": _diff,
    "repeat_interleave.self_int": _repeat_interleave,
    "where.ScalarOther": _where_scalar_other,
    "where.ScalarSelf": _where_scalar_self,
    "to.device": _to_device,
    "_unsafe_view.default": _unsafe_view,
    "scaled_dot_product_attention.default": _sdpa,
    "cumsum.default": _cumsum,
    "full.default": _full,
    "new_empty.default": _new_empty,
    "numpy_T.default": _numpy_t,
    "index.Tensor": _index_from_the_end,
    "layer_norm.default": _layer_norm,
    "max.dim": _extreme_along(largest=True),
    "min.dim": _extreme_along(largest=False),
    **{name: _with_torch_dtype(name) for name in _DTYPE_CHECKED},
    **{name: _with_torch_shape(name) for name in _SHAPE_CHECKED},
}


# ------------------------------------------------------------------ mixture of experts
# The routers' operators (in-place ``div_`` and ``scatter_``, ``masked_fill`` as a ``where``
# with a scalar, which also serves infinite fill values, ``topk(sorted=False)``) are kept
# with the static expert dispatch that needs them, in :mod:`tvm_distx.frontend.torch_moe`.
from tvm_distx.frontend.torch_moe import CONVERTERS as _MOE_CONVERTERS  # noqa: E402
from tvm_distx.errors import UnsupportedProgramError

CONVERTERS.update(_MOE_CONVERTERS)

# Complex numbers (Llama 4's rotary embedding) as real pairs: :mod:`tvm_distx.frontend.torch_complex`.
from tvm_distx.frontend.torch_complex import CONVERTERS as _COMPLEX_CONVERTERS  # noqa: E402

CONVERTERS.update(_COMPLEX_CONVERTERS)


# ------------------------------------------------------------------ key-value cache writes
# (helper "kvexport") A static key-value cache is written with ``index_copy`` at the
# positions of the new tokens (:mod:`tvm_distx.frontend.decoder`).
def _index_copy(node, importer) -> relax.Var:
    """``index_copy(x, dim, index, source)``: ``x`` with ``source[i]`` written at ``index[i]``.

    Emitted as a one-hot selection along ``dim``: ``hit[i, j] = (index[i] == j)``,
    the written rows are ``hit^T @ source`` and the rows no index names keep
    ``x``. Every other axis (batch, heads, head features) is carried through
    elementwise operators and a batched matmul, so a cache split by heads is
    written where it lies, with no communication; a scatter kernel with
    data-dependent indices would hide that from the sharding solver. Each
    written element is one product with ``1.0`` plus products with ``0.0``:
    exact for finite values. (TVM's own translation emits an ``index_put``
    with too few index tensors, which Relax rejects.)

    A single index (one decoded token) needs no product: the source row is
    broadcast along the indexed axis and selected where the index hits, one
    elementwise pass over ``x``.
    """

    bb, env = importer.block_builder, importer.env
    x, dim = env[node.args[0]], int(node.args[1])
    index, source = env[node.args[2]], env[node.args[3]]
    ndim = _ndim_of(x)
    axis = dim % ndim if ndim else 0
    if ndim < 2 or _ndim_of(index) != 1:
        raise UnsupportedProgramError(
            f"index_copy into a {ndim}-D tensor with a {_ndim_of(index)}-D index",
            hint="index_copy along one axis of a tensor of 2 or more dimensions, "
            "with a 1-D index (a key-value cache write)")
    order = [a for a in range(ndim) if a != axis]
    order.insert(ndim - 2, axis)  # the indexed axis next to last: the matmul's rows
    moved = order != list(range(ndim))
    if moved:
        x = bb.emit(relax.op.permute_dims(x, order))
        source = bb.emit(relax.op.permute_dims(source, order))
    length = x.ty.shape[ndim - 2]
    slots = bb.emit(relax.op.arange(0, length, 1, _dtype_of(index)))
    hit = bb.emit(relax.op.equal(relax.op.expand_dims(index, 1),
                                 relax.op.expand_dims(slots, 0)))          # (n, length)
    count = index.ty.shape[0] if isinstance(index.ty.shape, relax.ShapeExpr) else None
    if isinstance(count, tvm.tirx.IntImm) and int(count) == 1:
        # one row: (1, length) -> (length, 1), selects source (..., 1, d) broadcast
        mask = bb.emit(relax.op.permute_dims(hit, [1, 0]))
        out = bb.emit(relax.op.where(mask, source, x))
    else:
        weights = bb.emit(relax.op.astype(relax.op.permute_dims(hit, [1, 0]), _dtype_of(x)))
        written = bb.emit(relax.op.matmul(weights, source))                # (..., length, d)
        mask = bb.emit(relax.op.expand_dims(
            relax.op.max(relax.op.astype(hit, "int32"), axis=[0]), 1))     # (length, 1)
        out = bb.emit(relax.op.where(relax.op.astype(mask, "bool"), written, x))
    if moved:
        out = bb.emit(relax.op.permute_dims(out, [order.index(a) for a in range(ndim)]))
    return out


CONVERTERS["index_copy.default"] = _index_copy
