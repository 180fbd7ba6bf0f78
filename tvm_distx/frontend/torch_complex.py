"""Complex numbers in a PyTorch program, as real pairs: converters for :func:`tvm_distx.from_torch`.

Relax has no complex dtype. Some models write their rotary embedding with
complex numbers (Llama 4: ``torch.polar`` builds ``e^{i theta}``, the queries
are viewed as complex pairs and multiplied by it). Here a complex tensor of
shape ``s`` is a real tensor of shape ``s + (2,)``, its last axis ``(re, im)``,
which is exactly the layout of ``torch.view_as_real``:

* ``view_as_complex(x)`` and ``view_as_real(z)``: the same real tensor;
* ``polar(r, theta)``: ``(r cos theta, r sin theta)`` stacked on a new last axis;
* ``mul`` of two complex tensors: ``(a c - b d, a d + b c)``; of a complex tensor
  and a real one: the real one broadcast over the pair;
* ``to``, ``_to_copy``, ``clone`` of a complex value: its pairs.

Layout operators on a complex value (the slices and ``unsqueeze`` that index
``freqs_cis[:, :, None, :]``) keep working on the pairs as long as they name
their axes from the front; ``unsqueeze`` at a negative axis is moved one further
(the pair's axis is last). The sum or difference of two complex values is that
of their pairs. Other operators on complex values (a quotient, a complex value
added to a real one) are not translated: they would compute on the pairs.
"""

from __future__ import annotations

import logging
from typing import Callable

from tvm import relax

from tvm_distx.frontend.tvm_converters import original_converter


__all__ = ["CONVERTERS", "is_complex"]

logger = logging.getLogger(__name__)


def is_complex(node) -> bool:
    """Whether torch.export recorded ``node``'s value as a complex tensor."""
    value = getattr(node, "meta", {}).get("val")
    dtype = getattr(value, "dtype", None)
    return bool(getattr(dtype, "is_complex", False))


def _same_pairs(node, importer) -> relax.Expr:
    """``view_as_complex`` and ``view_as_real``: the pairs are the same real tensor."""
    return importer.env[node.args[0]]


def _pair_parts(bb, z: relax.Expr) -> tuple[relax.Expr, relax.Expr]:
    """The real and imaginary parts of a pair tensor, each keeping a last axis of 1."""
    ndim = z.ty.ndim
    def part(i: int):
        return bb.emit(relax.op.strided_slice(z, axes=[ndim - 1], begin=[i], end=[i + 1]))
    return part(0), part(1)


def _polar(node, importer) -> relax.Var:
    """``polar(r, theta)``: ``(r cos theta, r sin theta)`` on a new last axis."""
    bb, env = importer.block_builder, importer.env
    magnitude, angle = env[node.args[0]], env[node.args[1]]
    re = bb.emit(relax.op.expand_dims(relax.op.multiply(magnitude, relax.op.cos(angle)), -1))
    im = bb.emit(relax.op.expand_dims(relax.op.multiply(magnitude, relax.op.sin(angle)), -1))
    return bb.emit(relax.op.concat([re, im], axis=-1))


def _mul(node, importer) -> relax.Var:
    """``mul``: TVM's own for real values; a complex product of pairs otherwise."""
    if not is_complex(node):
        return original_converter(importer, "mul.Tensor")(node)
    bb, env = importer.block_builder, importer.env
    left, right = node.args[0], node.args[1]
    if not is_complex(left):
        left, right = right, left
    z = env[left]
    if is_complex(right):
        a, b = _pair_parts(bb, z)
        c, d = _pair_parts(bb, env[right])
        re = bb.emit(relax.op.subtract(relax.op.multiply(a, c), relax.op.multiply(b, d)))
        im = bb.emit(relax.op.add(relax.op.multiply(a, d), relax.op.multiply(b, c)))
        return bb.emit(relax.op.concat([re, im], axis=-1))
    if hasattr(right, "meta"):  # a real tensor: the same factor for both parts
        return bb.emit(relax.op.multiply(z, relax.op.expand_dims(env[right], -1)))
    return bb.emit(relax.op.multiply(z, relax.const(float(right), z.ty.dtype)))


def _axis_wrapped(name: str, axis_at: int) -> Callable:
    """TVM's converter of a layout operator, its negative axis moved past a pair's axis."""
    def convert(node, importer) -> relax.Var:
        original = node.args
        if is_complex(original[0]) and len(original) > axis_at and \
                isinstance(original[axis_at], int) and original[axis_at] < 0:
            node.args = (*original[:axis_at], original[axis_at] - 1, *original[axis_at + 1:])
        try:
            return original_converter(importer, name)(node)
        finally:
            node.args = original

    convert.__name__ = f"paired_{name.replace('.', '_')}"
    return convert


def _kept_if_complex(name: str) -> Callable:
    """A conversion or copy (``to``, ``_to_copy``): a complex value stays its pairs.

    The pairs are float32 (complex64's parts); TVM's own converter serves real values.
    """
    def convert(node, importer) -> relax.Var:
        if is_complex(node):
            return importer.env[node.args[0]]
        return original_converter(importer, name)(node)

    convert.__name__ = f"paired_{name.replace('.', '_')}"
    return convert


#: Converters by ATen overload name (see :data:`tvm_distx.frontend.torch_ops.CONVERTERS`).
CONVERTERS: dict[str, Callable] = {
    "view_as_complex.default": _same_pairs,
    "view_as_real.default": _same_pairs,
    "polar.default": _polar,
    "mul.Tensor": _mul,
    "unsqueeze.default": _axis_wrapped("unsqueeze.default", 1),
    **{name: _kept_if_complex(name) for name in ("to.dtype_layout", "to.dtype",
                                                  "_to_copy.default", "clone.default")},
}
