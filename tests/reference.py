"""numpy references the tests compare programs with."""

from __future__ import annotations

import numpy as np


def mlp_twice(x: np.ndarray, A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """The seed examples' program: ``mlp(mlp(x))`` with ``mlp(v) = relu(v @ A) @ B``."""
    def mlp(v):
        return np.maximum(v @ A, 0) @ B

    return mlp(mlp(x))
