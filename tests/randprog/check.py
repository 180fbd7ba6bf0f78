"""Checking a random program: compare with numpy, report a failure, run one case."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .numpy_reference import reference
from .program import Program
from .relax_module import build_module

__all__ = ["RTOL", "ATOL", "compare", "report", "run_case"]

#: Relative tolerance of the comparison with numpy (float32 against float64).
RTOL = 1e-4
#: Absolute tolerance, relative to the largest magnitude of the expected result.
ATOL = 1e-4


def compare(program: Program, got, want) -> None:
    """Assert that ``got`` (the distributed run) equals ``want`` (numpy).

    Shapes and dtypes must match exactly; values to :data:`RTOL` and
    :data:`ATOL` times the largest magnitude of the expected value (at least 1).

    Raises
    ------
    AssertionError
        Naming the result, the shapes or the largest error.
    """
    gots = got if isinstance(got, tuple) else (got,)
    wants = want if isinstance(want, tuple) else (want,)
    assert len(gots) == len(wants), f"{len(gots)} results, numpy has {len(wants)}"
    for i, (g, w) in enumerate(zip(gots, wants)):
        g = np.asarray(g)
        assert g.shape == w.shape, f"result {i}: shape {g.shape}, numpy says {w.shape}"
        assert g.dtype == np.float32, f"result {i}: dtype {g.dtype}, expected float32"
        scale = max(1.0, float(np.max(np.abs(w)))) if w.size else 1.0
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL * scale,
                                   err_msg=f"result {i} differs from numpy")


def report(program: Program, seed: int | None, module=None) -> str:
    """What to print when a case fails: the seed, the program, its TVMScript."""
    lines = []
    if seed is not None:
        lines.append(f"seed {seed}: replay with TVM_DISTX_SEED={seed} "
                     "python -m pytest tests/test_random_programs.py -k replay")
    lines.append(program.describe())
    if module is not None:
        lines.append(module.script(show_meta=False))
    return "\n".join(lines)


def run_case(program: Program, inputs: Sequence[np.ndarray], backend: str = "emulate",
             **run_options) -> None:
    """Compile and run one program, and assert that it equals numpy.

    Nothing is refused: every generated program is valid, so any error
    (a ``tvm_distx`` error, a TVM ``InternalError``, a wrong number) fails.
    """
    import tvm_distx as td

    exe = td.compile(build_module(program), schedule=False)
    compare(program, exe.run(*inputs, backend=backend, **run_options),
            reference(program, inputs))
