"""Our legalization rules (``tvm_distx.compiler.operator_rules``) against numpy, and TVM's log."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from tvm_distx.compiler.operator_rules import SCATTER_MAX_UPDATES, legalize_rules
from tvm_distx.compiler.pipeline import legalize_operators
from tvm_distx.compiler.schedule import AS_WRITTEN, RULE_ATTR, ScheduleCPU, x86_target

TARGET = x86_target(1)

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


def scatter_reference(data, indices, updates, axis):
    """``scatter_elements`` with ``reduction="update"`` as the loop its definition is."""
    out = data.copy()
    for position in np.ndindex(*indices.shape):
        at = list(position)
        at[axis] = indices[position] % data.shape[axis]
        out[tuple(at)] = updates[position]
    return out


@pytest.mark.parametrize("shape, count, axis", [((6, 8), 2, 1), ((6, 8), 5, 0), ((6, 8), 1, 1),
                                                ((3, 4, 10), 3, -1)])
def test_scatter_of_a_few_updates_equals_the_loop(shape, count, axis, capfd):
    index_shape = list(shape)
    index_shape[axis] = count
    mod = module({"x": (shape, "float32"), "i": (tuple(index_shape), "int64"),
                  "u": (tuple(index_shape), "float32")},
                 lambda x, i, u: relax.op.scatter_elements(x, i, u, axis=axis))
    rng = np.random.default_rng(count)
    x = rng.standard_normal(shape, dtype="float32")
    # negative entries count from the end; repeated ones keep the last update
    i = rng.integers(-shape[axis], shape[axis], index_shape).astype("int64")
    u = rng.standard_normal(index_shape, dtype="float32")
    legalized = legalize_operators(mod)
    got = run(ScheduleCPU(TARGET)(legalized), x, i, u)
    np.testing.assert_array_equal(got, scatter_reference(x, i, u, axis % len(shape)))
    assert "Unknown pragma" not in capfd.readouterr().err
    scheduled = ScheduleCPU(TARGET)(legalized)
    rules = {str(f.attrs[RULE_ATTR]) for f in scheduled.functions.values()
             if isinstance(f, tvm.tirx.PrimFunc)}
    assert AS_WRITTEN not in rules and None not in rules, rules


def test_a_routers_scatter_over_a_run_time_token_count():
    """Top-k weights written into a row per expert, for a prompt of any length."""
    n = tvm.tirx.Var("n", "int64")
    mod = module({"x": ((n, 8), "float32"), "i": ((n, 2), "int64"), "u": ((n, 2), "float32")},
                 lambda x, i, u: relax.op.scatter_elements(x, i, u, axis=1))
    lowered = legalize_operators(mod)
    assert "pragma_scope" not in lowered.script()
    for tokens in (1, 7):
        rng = np.random.default_rng(tokens)
        x = np.zeros((tokens, 8), "float32")
        i = np.stack([rng.permutation(8)[:2] for _ in range(tokens)]).astype("int64")
        u = rng.random((tokens, 2), dtype="float32")
        np.testing.assert_array_equal(run(lowered, x, i, u), scatter_reference(x, i, u, 1))


@pytest.mark.parametrize("reduction, count", [("add", 2), ("update", SCATTER_MAX_UPDATES + 1)])
def test_other_scatters_keep_tvms_rule(reduction, count):
    mod = module({"x": ((4, 80), "float32"), "i": ((4, count), "int64"),
                  "u": ((4, count), "float32")},
                 lambda x, i, u: relax.op.scatter_elements(x, i, u, axis=1,
                                                           reduction=reduction))
    lowered = legalize_operators(mod)
    assert "pragma_scope" in lowered.script()  # TVM's loop program
    rng = np.random.default_rng(count)
    x = rng.standard_normal((4, 80), dtype="float32")
    i = np.stack([rng.permutation(80)[:count] for _ in range(4)]).astype("int64")
    u = rng.standard_normal((4, count), dtype="float32")
    want = x.copy()
    np.add.at(want, (np.arange(4)[:, None], i), u) if reduction == "add" else \
        np.put_along_axis(want, i, u, axis=1)
    np.testing.assert_allclose(run(lowered, x, i, u), want, rtol=1e-6)


def test_the_rules_cover_what_the_module_says():
    assert set(legalize_rules()) == {"relax.full", "relax.full_like", "relax.take",
                                     "relax.scatter_elements"}
