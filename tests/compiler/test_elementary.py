"""float32 ``exp`` and ``sigmoid`` are vector arithmetic, as accurate as libm's to 4e-7."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import te

from tvm_distx.compiler.schedule import ScheduleCPU, x86_target
from tvm_distx.compiler.schedule.elementary import vector_exp

TARGET = x86_target(1)


def build(op: str, size: int):
    x = te.placeholder((size,), "float32", "x")
    fn = {"exp": tvm.tirx.exp, "sigmoid": tvm.tirx.sigmoid}[op]
    out = te.compute((size,), lambda i: fn(x[i]), name=op)
    mod = tvm.IRModule({"main": te.create_prim_func([x, out])})
    return tvm.compile(ScheduleCPU(TARGET)(mod), target=TARGET)


def run(lib, values: np.ndarray) -> np.ndarray:
    out = tvm.runtime.tensor(np.zeros_like(values))
    lib["main"](tvm.runtime.tensor(values), out)
    return out.numpy()


def sweep() -> np.ndarray:
    """Every 61st float32 between -110 and 90, and the special values."""
    bits = np.arange(0, 1 << 31, 61, dtype=np.int64).astype(np.uint32)
    values = np.concatenate([bits.view(np.float32), -bits.view(np.float32)])
    values = values[np.isfinite(values) & (values > -110) & (values < 90)]
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 88.72283, 88.7229, -103.9, -104.0,
                        -87.33, 1e-30, -1e-30], dtype=np.float32)
    return np.concatenate([values, special])


def test_exp_is_vector_code_without_libm_calls():
    lib = build("exp", 1024)
    asm = lib.mod.imports[0].inspect_source("asm") if lib.mod.imports else \
        lib.mod.inspect_source("asm")
    assert "expf" not in asm


def test_exp_matches_float64_to_4e7_relative_where_float32_is_normal():
    values = sweep()
    got = run(build("exp", values.size), values)
    with np.errstate(over="ignore", under="ignore"):
        want = np.exp(values.astype(np.float64))
    normal = (want >= np.finfo(np.float32).tiny) & (want <= np.finfo(np.float32).max)
    relative = np.abs(got[normal] - want[normal]) / want[normal]
    assert relative.max() < 4e-7, values[normal][relative.argmax()]
    # beyond: subnormal results close in absolute terms, overflow to inf, NaN kept
    tiny = (values < -87.34) & np.isfinite(values)
    assert np.all(np.abs(got[tiny] - want[tiny]) < 2e-45 * 4)
    assert np.all(got[values > 88.7229] == np.inf)
    assert np.isnan(got[np.isnan(values)]).all()
    assert got[values == -np.inf].tolist() == [0.0]


@pytest.mark.parametrize("size", [1, 15, 64])
def test_sigmoid_matches_float64(size):
    values = np.concatenate([sweep()[::7], np.array([-200, 200], dtype=np.float32)])
    values = np.resize(values, (values.size // size) * size)
    got = run(build("sigmoid", values.size), values)
    want = 1 / (1 + np.exp(-values.astype(np.float64)))
    finite = ~np.isnan(values)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-6, atol=1e-30)


def test_other_functions_and_dtypes_are_left_alone():
    x = te.placeholder((8,), "float64", "x")
    out = te.compute((8,), lambda i: tvm.tirx.exp(x[i]), name="exp64")
    func = te.create_prim_func([x, out])
    assert vector_exp(func).same_as(func)


def test_a_kernel_scheduled_by_hand_gets_the_vector_exp_too():
    """Kernels written and scheduled elsewhere (the experts') are not skipped."""
    x = te.placeholder((16,), "float32", "x")
    out = te.compute((16,), lambda i: tvm.tirx.exp(x[i]), name="exp")
    func = te.create_prim_func([x, out]).with_attr("tirx.is_scheduled", True)
    mod = ScheduleCPU(TARGET)(tvm.IRModule({"main": func}))
    assert "T.exp(" not in mod["main"].script() and "tirx.exp" not in str(mod["main"])
