"""A random program's inputs and its answer, computed by numpy on one process."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .program import Op, Program

__all__ = ["random_inputs", "reference"]


def random_inputs(program: Program, seed: int) -> list[np.ndarray]:
    """Float32 inputs for ``main``, from numpy's generator seeded with ``seed``."""
    rng = np.random.default_rng(seed)
    return [(0.5 * rng.standard_normal(inp.shape)).astype("float32") for inp in program.inputs]


def reference(program: Program, inputs: Sequence[np.ndarray]):
    """``main``'s result computed by numpy (in float64) on one process.

    Returns
    -------
    numpy.ndarray or tuple of numpy.ndarray
        A tuple when ``main`` returns several values.
    """
    outs = _evaluate(program, "main", [np.asarray(a, "float64") for a in inputs])
    return outs[0] if len(outs) == 1 else tuple(outs)


def _evaluate(program: Program, name: str, args: list[np.ndarray]) -> list[np.ndarray]:
    func = program.functions[name]
    values = list(args)
    for op in func.ops:
        a = [values[i] for i in op.args]
        values.append(_numpy_op(program, op, a))
        assert values[-1].shape == op.shape, (op, values[-1].shape)
    return [values[o] for o in func.outputs]


def _numpy_op(program: Program, op: Op, a: list[np.ndarray]) -> np.ndarray:
    kind = op.kind
    if kind == "matmul":
        return a[0] @ a[1]
    if kind == "add":
        return a[0] + a[1]
    if kind == "multiply":
        return a[0] * a[1]
    if kind == "subtract":
        return a[0] - a[1]
    if kind == "exp":
        return np.exp(a[0])
    if kind == "tanh":
        return np.tanh(a[0])
    if kind == "relu":
        return np.maximum(a[0], 0)
    if kind == "sum":
        return a[0].sum(axis=op.axis, keepdims=op.keepdims)
    if kind == "max":
        return a[0].max(axis=op.axis, keepdims=op.keepdims)
    if kind == "softmax":
        shifted = np.exp(a[0] - a[0].max(axis=op.axis, keepdims=True))
        return shifted / shifted.sum(axis=op.axis, keepdims=True)
    if kind == "reshape":
        return a[0].reshape(op.new_shape)
    if kind == "permute_dims":
        return a[0].transpose(op.axes)
    if kind == "split":
        return np.split(a[0], 2, axis=op.axis)[op.half]
    if kind == "annotate":
        return a[0]
    if kind == "call":
        return _evaluate(program, op.callee, a)[0]
    raise ValueError(f"unknown operation {kind!r}")
