"""``exp`` and ``sigmoid`` of float32 in vector instructions, not one libm call per lane.

LLVM has no vector ``exp`` on CPUs without a vector math library: a
vectorized ``tirx.exp`` (softmax, ``silu``'s sigmoid) becomes one call to
libm's ``expf`` per lane. In a decode step of a Llama that is a fifth of
every non-matmul kernel's time. :func:`vector_exp` rewrites each float32
``exp`` and ``sigmoid`` of a kernel into arithmetic that vectorizes:

* ``x = n ln 2 + r`` with ``n = round(x / ln 2)`` and ``|r| <= ln 2 / 2``,
  ``r`` computed with ``ln 2`` split in two parts (Cody and Waite) so that it
  is exact to float32;
* ``exp(r)`` by its Taylor polynomial of degree 7 in Horner form (the first
  omitted term is below ``2.5e-9`` relative on that interval);
* ``2^n`` as ``2^h * 2^(n - h)`` with ``h = floor(n / 2)``, each built from its
  exponent bits (``(h + 127) << 23`` reinterpreted), so that both factors are
  normal floats wherever the result is a float (subnormal results included).

Against float64 ``exp`` the result is within ``4e-7`` relative over the
float32 range where ``exp`` is normal (``tests/compiler/test_elementary.py``
measures it on a dense sweep of float32 values). Beyond it: subnormal results
as the multiplication rounds them, ``0`` below ``-103.98``, ``inf`` above
``88.72`` (where float32 overflows), and NaN stays NaN. ``sigmoid(x)`` is
``1 / (1 + exp(-x))``.
"""

from __future__ import annotations

import math

import tvm_ffi
from tvm import tirx
from tvm.ir.expr import Call

__all__ = ["vector_exp"]

#: Below it ``exp`` rounds to 0 in float32; above the other, it overflows.
_LOWEST = -103.97208
_HIGHEST = 88.72283
#: ln 2 split: the high part has few enough bits that ``n * _LN2_HIGH`` is exact.
_LN2_HIGH = 0.693359375
_LN2_LOW = math.log(2.0) - 0.693359375
_DEGREE = 7


def vector_exp(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with every float32 ``exp`` and ``sigmoid`` written in vectorizable arithmetic."""
    changed = []

    def rewrite(call: Call):
        name = getattr(call.op, "name", None)
        if name not in ("tirx.exp", "tirx.sigmoid") or str(call.ty) != "float32":
            return call
        changed.append(name)
        x = call.args[0]
        if name == "tirx.exp":
            return _exp(x)
        one = tirx.const(1.0, "float32")
        return one / (one + _exp(tirx.const(0.0, "float32") - x))

    new = tvm_ffi.structural_map(func, [(Call, rewrite)])
    return new if changed else func


def _exp(x):
    f32 = "float32"
    c = lambda v: tirx.const(v, f32)  # noqa: E731 - a float32 constant
    clamped = tirx.Max(tirx.Min(x, c(_HIGHEST)), c(_LOWEST))
    n = tirx.floor(clamped * c(1.0 / math.log(2.0)) + c(0.5))
    r = (clamped - n * c(_LN2_HIGH)) - n * c(_LN2_LOW)
    poly = c(1.0 / math.factorial(_DEGREE))
    for k in range(_DEGREE - 1, -1, -1):
        poly = poly * r + c(1.0 / math.factorial(k))
    half = tirx.floor(n * c(0.5))
    value = poly * _power_of_two(half) * _power_of_two(n - half)
    value = tirx.Select(x < c(_LOWEST), c(0.0), value)
    value = tirx.Select(x > c(_HIGHEST), tirx.const(float("inf"), f32), value)
    return tirx.Select(tirx.isnan(x), x, value)  # NaN stays NaN


def _power_of_two(n):
    """``2^n`` for an integral float32 ``n`` in [-126, 127], from its exponent bits."""
    bits = tirx.Cast("int32", n) + tirx.const(127, "int32")
    return tirx.call_intrin("float32", "tirx.reinterpret",
                            tirx.LShift(bits, tirx.const(23, "int32")))
