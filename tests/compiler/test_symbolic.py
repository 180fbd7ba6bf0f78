"""Symbolic (run-time) extents: one compile, several sizes, on emulated and MPI ranks.

Every program here is compiled once per mesh (a module-scoped fixture) and
run at several sizes of its symbolic dimensions; results are compared with
numpy.
"""

from __future__ import annotations

import contextlib

import dataclasses
import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
import tvm_distx as td
from tvm_distx.bundle.signature import FunctionSignature
from locations import TESTS_DIR

BACKENDS = ("emulate", "mpi")


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _normal(rng, *shape) -> np.ndarray:
    return (0.1 * rng.standard_normal(shape)).astype("float32")


# ------------------------------------------------------------------ programs
def _parse(source: str, p: int):
    """A module from TVMScript ``source`` whose mesh size is written ``NUM_DEVICES``."""
    with tempfile.TemporaryDirectory(prefix="tvm-distx-symbolic-") as tmp:
        path = Path(tmp) / "program.py"
        path.write_text(_HEADER + source.replace("NUM_DEVICES", str(p)))
        return td.load_module(path)


_HEADER = """from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T
"""


MEGATRON_MLP = """
@I.ir_module
class Module:
    I.module_attrs({"device_num": NUM_DEVICES})
    I.module_global_infos({"mesh": [R.dist.device_mesh((NUM_DEVICES,), I.Range(0, NUM_DEVICES))]})

    @R.function
    def main(x: R.Tensor(("n", 64), "float32"), w1: R.Tensor((64, 128), "float32"),
             w2: R.Tensor((128, 64), "float32")) -> R.Tensor(("n", 64), "float32"):
        n = T.int64()
        with R.dataflow():
            xs = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="R")
            a = R.dist.annotate_sharding(w1, device_mesh="mesh[0]", placement="S[1]")
            b = R.dist.annotate_sharding(w2, device_mesh="mesh[0]", placement="S[0]")
            h = R.nn.relu(R.matmul(xs, a))
            y = R.matmul(h, b)
            R.output(y)
        return y
"""


def megatron_mlp(p: int):
    """Column- then row-parallel matmul on ``p`` devices; the token count ``n`` is symbolic."""
    return _parse(MEGATRON_MLP, p)


DATA_PARALLEL = """
@I.ir_module
class Module:
    I.module_attrs({"device_num": NUM_DEVICES})
    I.module_global_infos({"mesh": [R.dist.device_mesh((NUM_DEVICES,), I.Range(0, NUM_DEVICES))]})

    @R.function
    def main(x: R.Tensor(("b", 64), "float32"),
             w: R.Tensor((64, 32), "float32")) -> R.Tensor(("b", 32), "float32"):
        b = T.int64()
        with R.dataflow():
            xs = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="S[0]")
            ws = R.dist.annotate_sharding(w, device_mesh="mesh[0]", placement="R")
            y = R.nn.relu(R.matmul(xs, ws))
            R.output(y)
        return y
"""


def data_parallel(p: int):
    """A layer whose symbolic batch ``b`` is split over ``p`` devices."""
    return _parse(DATA_PARALLEL, p)


ATTENTION_HEADS = """
@I.ir_module
class Module:
    I.module_attrs({"device_num": NUM_DEVICES})
    I.module_global_infos({"mesh": [R.dist.device_mesh((NUM_DEVICES,), I.Range(0, NUM_DEVICES))]})

    @R.function
    def main(x: R.Tensor(("n", 64), "float32"), wq: R.Tensor((64, 64), "float32"),
             wo: R.Tensor((64, 64), "float32")) -> R.Tensor(("n", 64), "float32"):
        n = T.int64()
        with R.dataflow():
            xs = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="R")
            q_w = R.dist.annotate_sharding(wq, device_mesh="mesh[0]", placement="S[1]")
            o_w = R.dist.annotate_sharding(wo, device_mesh="mesh[0]", placement="S[0]")
            q = R.matmul(xs, q_w)
            heads = R.reshape(q, R.shape([n, 4, 16]))
            probs = R.nn.softmax(heads, axis=2)
            merged = R.reshape(probs, R.shape([n, 64]))
            y = R.matmul(merged, o_w)
            R.output(y)
        return y
"""


def attention_heads(p: int):
    """Four heads of 16 split over ``p`` devices through ``(n, 64) -> (n, 4, 16)``."""
    return _parse(ATTENTION_HEADS, p)


MESH_2X2 = """
@I.ir_module
class Module:
    I.module_attrs({"device_num": 4})
    I.module_global_infos({"mesh": [R.dist.device_mesh((2, 2), I.Range(0, 4))]})

    @R.function
    def main(x: R.Tensor(("b", "s", 32), "float32"), w1: R.Tensor((32, 64), "float32"),
             w2: R.Tensor((64, 32), "float32")) -> R.Tensor(("b", "s", 32), "float32"):
        b = T.int64()
        s = T.int64()
        with R.dataflow():
            xs = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="S[0]R")
            a = R.dist.annotate_sharding(w1, device_mesh="mesh[0]", placement="RS[1]")
            c = R.dist.annotate_sharding(w2, device_mesh="mesh[0]", placement="RS[0]")
            h = R.nn.relu(R.matmul(xs, a))
            y = R.matmul(h, c)
            R.output(y)
        return y
"""


def mesh_2x2():
    """A 2x2 mesh: the batch ``b`` split on axis 0, the sequence ``s`` symbolic, a Megatron MLP
    on axis 1."""
    return _parse(MESH_2X2, 4)


# ------------------------------------------------------------------ references
def _mlp(x, w1, w2):
    return np.maximum(x @ w1, 0) @ w2


def _heads(x, wq, wo):
    q = (x @ wq).reshape(x.shape[0], 4, 16)
    e = np.exp(q - q.max(axis=2, keepdims=True))
    return (e / e.sum(axis=2, keepdims=True)).reshape(x.shape[0], 64) @ wo


# ------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module", params=[2, 4], ids=["p2", "p4"])
def mlp_exe(request):
    return td.compile(megatron_mlp(request.param))


@pytest.fixture(scope="module", params=[2, 4], ids=["p2", "p4"])
def dp_exe(request):
    return request.param, td.compile(data_parallel(request.param))


@pytest.fixture(scope="module", params=[2, 4], ids=["p2", "p4"])
def heads_exe(request):
    return td.compile(attention_heads(request.param))


@pytest.fixture(scope="module")
def mesh_exe():
    return td.compile(mesh_2x2())


# ------------------------------------------------------------------ tests
def test_signature_names_symbolic_dimensions(dp_exe):
    _, exe = dp_exe
    sig = exe.signatures["main"]
    assert sig.params[0].shape == ("b", 64)
    assert sig.results[0].shape == ("b", 32)
    assert sig.params[0].split_axes(0) == (0,)


@contextlib.contextmanager
def _runner(exe, params: dict, backend: str):
    """``run(x)`` on ``backend``; on MPI one session serves every size (one launch, not three)."""
    if backend == "mpi":
        with exe.session(params=params) as session:
            yield session.run
    else:
        yield lambda x: exe.run(x, params=params, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_megatron_mlp_with_a_symbolic_token_count(mlp_exe, backend):
    rng = _rng(1)
    w1, w2 = _normal(rng, 64, 128), _normal(rng, 128, 64)
    with _runner(mlp_exe, {"w1": w1, "w2": w2}, backend) as run:
        for n in (3, 8, 17):  # the token count is not split: any size
            x = _normal(rng, n, 64)
            np.testing.assert_allclose(run(x), _mlp(x, w1, w2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_data_parallel_split_symbolic_batch(dp_exe, backend):
    p, exe = dp_exe
    rng = _rng(2)
    w = _normal(rng, 64, 32)
    with _runner(exe, {"w": w}, backend) as run:
        for b in (p, 3 * p, 8 * p):
            x = _normal(rng, b, 64)
            np.testing.assert_allclose(run(x), np.maximum(x @ w, 0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_indivisible_symbolic_batch_is_refused_before_launch(dp_exe, backend):
    p, exe = dp_exe
    x = np.zeros((p + 1, 64), "float32")
    with pytest.raises(td.errors.SymbolicExtentError) as err:
        exe.run(x, params={"w": np.zeros((64, 32), "float32")}, backend=backend)
    text = str(err.value)
    for part in ("'main'", "'x'", "dimension 0", "'b'", f"size {p + 1}", "mesh axis 0",
                 "hint:"):
        assert part in text


def test_one_symbolic_variable_has_one_value(dp_exe):
    _, exe = dp_exe
    x = exe.signatures["main"].params[0]
    two = FunctionSignature("f", (x, dataclasses.replace(x, name="y")), (), False)
    assert two.sizes([np.zeros((8, 64)), np.zeros((8, 64))]) == {"b": 8}
    with pytest.raises(td.errors.SymbolicExtentError, match="'b' of 'f' is 8 in 'x'.* but 4 in 'y'"):
        two.sizes([np.zeros((8, 64)), np.zeros((4, 64))])


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_heads_split_through_a_symbolic_reshape(heads_exe, backend):
    rng = _rng(4)
    wq, wo = _normal(rng, 64, 64), _normal(rng, 64, 64)
    with _runner(heads_exe, {"wq": wq, "wo": wo}, backend) as run:
        for n in (1, 5, 12):
            x = _normal(rng, n, 64)
            np.testing.assert_allclose(run(x), _heads(x, wq, wo), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_2x2_mesh_split_batch_and_symbolic_sequence(mesh_exe, backend):
    rng = _rng(5)
    w1, w2 = _normal(rng, 32, 64), _normal(rng, 64, 32)
    for b, s in ((2, 3), (4, 1), (6, 7)):
        x = _normal(rng, b, s, 32)
        out = mesh_exe.run(x, params={"w1": w1, "w2": w2}, backend=backend)
        np.testing.assert_allclose(out, _mlp(x, w1, w2), rtol=1e-5, atol=1e-5)
    with pytest.raises(td.errors.SymbolicExtentError, match="mesh axis 0"):
        mesh_exe.run(_normal(rng, 3, 2, 32), params={"w1": w1, "w2": w2}, backend=backend)


@pytest.fixture(scope="module")
def relu_exe():
    return td.compile(td.load_module(TESTS_DIR / "data" / "symbolic_relu.py"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_once_refused_symbolic_program_runs(relu_exe, backend):
    rng = _rng(6)
    for n in (8, 3):
        x = rng.standard_normal((n, 8)).astype("float32")
        np.testing.assert_array_equal(relu_exe.run(x, backend=backend), np.maximum(x, 0))


def test_redistributing_a_symbolic_tensor_is_refused_clearly(tmp_path):
    source = _HEADER + DATA_PARALLEL.replace("NUM_DEVICES", "2").replace(
        "y = R.nn.relu(R.matmul(xs, ws))",
        "y = R.dist.annotate_sharding(R.nn.relu(R.matmul(xs, ws)), device_mesh=\"mesh[0]\", "
        "placement=\"S[1]\")")
    path = tmp_path / "program.py"
    path.write_text(source)
    with pytest.raises(td.errors.UnsupportedProgramError,
                       match=r"symbolic \(run-time\) dimension from \"S\[0\]\" to \"S\[1\]\""):
        td.compile(td.load_module(path))


def test_the_manifest_records_symbolic_dimensions(dp_exe, tmp_path):
    from tvm_distx.bundle.manifest import read_manifest

    p, exe = dp_exe
    exe.export(tmp_path / "bundle")
    data = json.loads((tmp_path / "bundle" / "manifest.json").read_text())
    text = json.dumps(data)
    assert '"shape": ["b", 64]' in text
    assert '{"dim": 0, "var": "b", "mesh_axes": [0]}' in text
    assert read_manifest(tmp_path / "bundle").function("main").params[0].shape == ("b", 64)


# ------------------------------------------------------- moves that carry a run-time extent
BETWEEN_STAGES = """
@I.ir_module
class Module:
    I.module_global_infos({"mesh": [R.dist.device_mesh((1,), I.Range(0, 1)),
                                    R.dist.device_mesh((2,), I.Range(1, 3))]})

    @R.function
    def main(x: R.Tensor(("n", 8), "float32"),
             w: R.Tensor((8, 8), "float32")) -> R.Tensor(("n", 8), "float32"):
        n = T.int64()
        with R.dataflow():
            xs = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="R")
            h = R.nn.relu(xs)
            ws = R.dist.annotate_sharding(w, device_mesh="mesh[1]", placement="S[1]")
            y = R.exp(R.matmul(h, ws))
            R.output(y)
        return y
"""


@pytest.fixture(scope="module")
def stages_exe():
    return td.compile(_parse(BETWEEN_STAGES, 3))


def test_a_tensor_of_run_time_size_moves_to_the_next_stage_which_learns_its_size(stages_exe):
    """Devices 1-2 hold nothing of ``x``: they receive ``relu(x)`` whole, its rows counted at
    run time, through ``recv_sized``, and a ``match_cast`` gives them ``n``."""
    module = stages_exe.module
    entries = module.attrs["tvm_distx.rank_entries"]["main"]
    first, second = module[entries[0]], module[entries[1]]
    assert entries[1] == entries[2] != entries[0]
    assert "tvm_distx.ccl.send" in first.script()
    later = second.script()
    assert later.count("tvm_distx.ccl.recv_sized") == 1 and "R.match_cast" in later
    assert not second.params[0].name == "x"  # no input of the first stage


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_program_of_two_stages_serves_every_run_time_size(stages_exe, backend):
    rng = _rng(7)
    w = _normal(rng, 8, 8)
    for n in (5, 2, 9):
        x = _normal(rng, n, 8)
        np.testing.assert_allclose(stages_exe.run(x, w, backend=backend),
                                   np.exp(np.maximum(x, 0) @ w), rtol=1e-5, atol=1e-6)


GATHERED = """
@I.ir_module
class Module:
    I.module_global_infos({"mesh": [R.dist.device_mesh((NUM_DEVICES,), I.Range(0, NUM_DEVICES))]})

    @R.function
    def main(x: R.Tensor(("n", 8), "float32"),
             w: R.Tensor((8, 8), "float32")) -> R.Tensor(("n", 8), "float32"):
        n = T.int64()
        with R.dataflow():
            xs = R.dist.annotate_sharding(x, device_mesh="mesh[0]", placement="R")
            ws = R.dist.annotate_sharding(w, device_mesh="mesh[0]", placement="S[1]")
            h = R.matmul(xs, ws)
            g = R.dist.annotate_sharding(R.nn.relu(h), device_mesh="mesh[0]", placement="R")
            y = R.exp(g)
            R.output(y)
        return y
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_static_dimension_is_gathered_beside_a_run_time_one(backend):
    """S[1] -> R of an ``(n, 8)`` tensor: an all-gather along the columns, the rows counted
    at run time (DeepSeek's latent attention asks for this move)."""
    exe = td.compile(_parse(GATHERED, 2))
    assert "tvm_distx.ccl.allgather" in exe.module.script()
    rng = _rng(8)
    w = _normal(rng, 8, 8)
    for n in (3, 6):
        x = _normal(rng, n, 8)
        np.testing.assert_allclose(exe.run(x, w, backend=backend),
                                   np.exp(np.maximum(x @ w, 0)), rtol=1e-5, atol=1e-6)


def test_a_board_runs_the_two_stages_with_no_tvm_in_its_ranks(stages_exe):
    """The board executor (the VM's program as data, numpy registers) sizes the receive too."""
    assert stages_exe.plan is not None, stages_exe.plan_refusal
    rng = _rng(9)
    w = _normal(rng, 8, 8)
    for n in (4, 7):
        x = _normal(rng, n, 8)
        np.testing.assert_allclose(stages_exe.run(x, w, backend="board"),
                                   np.exp(np.maximum(x, 0) @ w), rtol=1e-5, atol=1e-6)
