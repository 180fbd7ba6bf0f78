"""Which operands a TIR kernel is linear in: when a sum over ranks may be taken after it.

An all-reduce completes a partial sum: rank ``r`` holds an addend ``a_r`` and
every rank needs ``sum_r a_r``. A kernel ``f`` may run on the addends instead of
the sum, with one all-reduce after it, when

    f(sum_r a_r, sum_r b_r, c) == sum_r f(a_r, b_r, c)

for every value of its other operands ``c`` (which every rank holds whole). That
holds exactly when every element ``f`` writes is *homogeneous of degree one* in
the summed operands: a sum of terms that each read exactly one summed operand,
once, times factors that read none (``a + b``, ``c * a``, ``a / c``, a copy, a
float cast, a sum over an axis). ``a + c`` is not (``c`` would be added once
per rank), nor is ``a * b`` or ``exp(a)``.

:func:`linear_in` decides it by giving every expression a *degree* in the
summed operands: 0 (reads none of them), 1 (homogeneous of degree one), or
:data:`ZERO` for the literal ``0.0``, which is both (a reduction's ``init``).
Buffers the kernel allocates or writes take the degree of what is stored into
them. Anything else (a load used as an index, a truncating cast, a
non-linear intrinsic of a summed value) is not linear. The analysis is
conservative: a kernel it cannot read is not linear.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx
from tvm.s_tir.stmt import SBlock, SBlockRealize

__all__ = ["NONLINEAR", "ZERO", "linear_in"]

#: The degree of the literal ``0.0``: homogeneous of every degree.
ZERO = -1
#: The degree of anything that is not homogeneous of degree 0 or 1.
NONLINEAR = 2


def linear_in(func: tirx.PrimFunc, summed: frozenset[int] | set[int], num_inputs: int) -> bool:
    """Whether ``func`` is homogeneous of degree one in the inputs ``summed``.

    Parameters
    ----------
    func : tirx.PrimFunc
        A destination-passing kernel: ``num_inputs`` inputs, then its outputs.
    summed : set of int
        Positions of the inputs that are partial sums.
    num_inputs : int
        How many of ``func``'s buffer parameters are inputs.

    Returns
    -------
    bool
        True when running ``func`` on every rank's addends and summing its
        results equals running it on the sums (see the module doc).
    """
    buffers = [p for p in func.params if tirx.is_buffer_var(p)]
    if not summed or len(buffers) <= num_inputs or max(summed) >= num_inputs:
        return False
    degrees: dict[tirx.Buffer, int] = {}
    for index, buffer in enumerate(buffers[:num_inputs]):
        degrees[buffer] = 1 if index in summed else 0
    outputs = buffers[num_inputs:]
    walk = _Degrees(degrees)
    walk.stmt(func.body)
    return walk.readable and all(degrees.get(out) in (1, ZERO) for out in outputs)


def _join(a: int, b: int) -> int:
    """The degree of ``x + y`` (and of a buffer written twice) from the two degrees."""
    if a == ZERO:
        return b
    if b == ZERO or a == b:
        return a
    return NONLINEAR


class _Degrees:
    """Walks a kernel's statements, giving each buffer and expression its degree."""

    def __init__(self, degrees: dict) -> None:
        self.degrees = degrees  # inputs on entry; every buffer written is added
        self.inputs = set(degrees)
        #: False once a statement was met that the walk cannot judge
        self.readable = True

    # -- statements
    def stmt(self, node) -> None:
        if isinstance(node, tirx.BufferStore):
            if node.buffer in self.inputs:
                self.readable = False  # the kernel writes into an input
            for index in node.indices:
                self.index(index)
            value = self.expr(node.value)
            previous = self.degrees.get(node.buffer)
            self.degrees[node.buffer] = value if previous is None else _join(previous, value)
        elif isinstance(node, SBlock):
            if node.init is not None:
                self.stmt(node.init)
            self.stmt(node.body)
        elif isinstance(node, SBlockRealize):
            self.index(node.predicate)
            self.stmt(node.block)
        elif isinstance(node, tirx.SeqStmt):
            for stmt in node.seq:
                self.stmt(stmt)
        elif isinstance(node, tirx.IfThenElse):
            self.index(node.condition)
            self.stmt(node.then_case)
            if node.else_case is not None:
                self.stmt(node.else_case)
        elif isinstance(node, tirx.Evaluate):
            self.index(node.value)
        elif isinstance(node, (tirx.For, tirx.AttrStmt, tirx.LetStmt, tirx.AssertStmt)):
            self.stmt(node.body)  # loops, and attributes or lets of indices
        elif not isinstance(node, (tirx.AllocBuffer, tirx.DeclBuffer)):
            self.readable = False  # (a fresh buffer takes the degree of what is stored into it)

    # -- expressions
    def index(self, expr) -> None:
        """An index, a condition or a predicate: it may not depend on a summed value."""
        if self.expr(expr) not in (0, ZERO):
            self.readable = False

    def expr(self, node) -> int:
        if isinstance(node, tvm.ir.TensorLoad):
            for index in node.indices:
                self.index(index)
            # a buffer read before anything was stored into it is not judged
            return self.degrees.get(node.source, NONLINEAR)
        if isinstance(node, tirx.FloatImm):
            return ZERO if node.value == 0.0 else 0
        if isinstance(node, (tirx.Add, tirx.Sub)):
            return _join(self.expr(node.a), self.expr(node.b))
        if isinstance(node, tirx.Mul):
            a, b = self.expr(node.a), self.expr(node.b)
            if ZERO in (a, b):
                return ZERO
            return min(a + b, NONLINEAR)
        if isinstance(node, tirx.Div):
            a = self.expr(node.a)
            if self.expr(node.b) != 0 or (a == 1 and not _is_float(node)):
                return NONLINEAR  # (integer division truncates)
            return a
        if isinstance(node, tirx.Cast):
            degree = self.expr(node.value)
            if degree == 1 and not (_is_float(node) and _is_float(node.value)):
                return NONLINEAR  # a cast to or from an integer truncates
            return degree
        if isinstance(node, tirx.Select):
            self.index(node.condition)
            return _join(self.expr(node.true_value), self.expr(node.false_value))
        if isinstance(node, tvm.ir.Call) and node.op.same_as(_IF_THEN_ELSE):
            self.index(node.args[0])
            return _join(self.expr(node.args[1]), self.expr(node.args[2]))
        if isinstance(node, tirx.Let):
            self.index(node.value)
            return self.expr(node.body)
        # anything else (max, exp, a comparison, an index variable, a constant): only
        # of values every rank holds whole
        return NONLINEAR if self._reads_summed(node) else 0

    def _reads_summed(self, node) -> bool:
        found = []

        def on_load(load):
            found.append(self.degrees.get(load.source) != 0)

        tvm_ffi.structural_walk(node, [(tvm.ir.TensorLoad, on_load)])
        return any(found)


_IF_THEN_ELSE = tvm.ir.Op.get("prim.if_then_else")


def _is_float(expr) -> bool:
    dtype = getattr(getattr(expr, "ty", None), "dtype", None)
    return dtype is not None and str(dtype).startswith(("float", "bfloat"))
