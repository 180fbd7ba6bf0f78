"""Our legalization rules (``tvm_distx.build.operator_rules``) against numpy, and TVM's log."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from tvm_distx.build.operator_rules import legalize_rules
from tvm_distx.build.pipeline import legalize_operators

FAST_MODE_LOG = "Fast mode segfaults"


def module(shapes: dict[str, tuple[tuple, str]], body) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    params = [relax.Var(name, relax.TensorType(shape, dtype))
              for name, (shape, dtype) in shapes.items()]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(body(*params))
        bb.emit_func_output(out)
    return bb.get()


def run(mod: tvm.IRModule, *inputs: np.ndarray) -> np.ndarray:
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    return vm["main"](*(tvm.runtime.tensor(x) for x in inputs)).numpy()


CASES = [  # data shape, indices shape, axis
    ((50, 8), (3,), 0),            # an embedding lookup of three tokens
    ((50, 8), (2, 5), 0),          # a batch of prompts
    ((4, 9, 6), (7,), 1),
    ((4, 9, 6), (2, 3), -1),
    ((4, 9, 6), (), 2),            # one index: the axis goes away
    ((11,), (4,), None),           # no axis: the data is one-dimensional
]


@pytest.mark.parametrize("data_shape, index_shape, axis", CASES)
@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
def test_take_in_bounds_equals_numpy_without_the_fast_mode_log(data_shape, index_shape, axis,
                                                               index_dtype, capfd):
    mod = module({"x": (data_shape, "float32"), "i": (index_shape, index_dtype)},
                 lambda x, i: relax.op.take(x, i, axis=axis))
    legalized = legalize_operators(mod)
    (kernel,) = [f for f in legalized.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    rng = np.random.default_rng(len(data_shape) + len(index_shape))
    x = rng.standard_normal(data_shape, dtype="float32")
    extent = data_shape[0 if axis is None else axis]
    i = rng.integers(0, extent, index_shape).astype(index_dtype)
    np.testing.assert_array_equal(run(legalized, x, i), np.take(x, i, axis=axis))
    assert FAST_MODE_LOG not in capfd.readouterr().err
    assert "T_take" in kernel.script()


def test_tvms_own_rule_logs_the_warning_we_leave_out(capfd):
    """The oracle: TVM's rule for the same call logs the line (so the test above can fail)."""
    mod = module({"x": ((50, 8), "float32"), "i": ((3,), "int64")},
                 lambda x, i: relax.op.take(x, i, axis=0))
    relax.transform.LegalizeOps()(mod)
    assert FAST_MODE_LOG in capfd.readouterr().err


def test_take_in_other_modes_keeps_tvms_rule():
    mod = module({"x": ((6, 3), "float32"), "i": ((4,), "int64")},
                 lambda x, i: relax.op.take(x, i, axis=0, mode="clip"))
    x = np.arange(18, dtype="float32").reshape(6, 3)
    i = np.array([-3, 0, 5, 9], dtype="int64")
    np.testing.assert_array_equal(run(legalize_operators(mod), x, i),
                                  np.take(x, i, axis=0, mode="clip"))


def test_take_over_a_run_time_extent():
    n = tvm.tirx.Var("n", "int64")
    mod = module({"x": ((50, 8), "float32"), "i": ((n,), "int64")},
                 lambda x, i: relax.op.take(x, i, axis=0))
    x = np.random.default_rng(0).standard_normal((50, 8), dtype="float32")
    for count in (1, 13):
        i = np.arange(count, dtype="int64") * 3 % 50
        np.testing.assert_array_equal(run(legalize_operators(mod), x, i), x[i])


@pytest.mark.parametrize("value", [-np.inf, np.inf, np.nan])
def test_a_non_finite_fill_legalizes(value):
    mod = module({"x": ((2, 3), "float32")},
                 lambda x: relax.op.full_like(x, relax.const(value, "float32")))
    got = run(legalize_operators(mod), np.zeros((2, 3), "float32"))
    np.testing.assert_array_equal(got, np.full((2, 3), value, "float32"))


def test_the_rules_cover_what_the_module_says():
    assert set(legalize_rules()) == {"relax.full", "relax.full_like", "relax.take"}
