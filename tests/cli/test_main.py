"""The tvm-distx command line: each subcommand, its errors and its exit codes."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tvm

import tvm_distx as td
import proc_tools
from tvm_distx import ShardingRule
from tvm_distx.cli.main import main as cli
from tvm_distx.passes import AnnotateSharding, PropagateSharding

from rvv_tools import require_tools
from locations import TESTS_DIR

DATA = TESTS_DIR / "data"
TP = str(DATA / "seed_tensor_parallel.py")
TP_RULES = [{"param": "A", "result": "S[1]", "function": "mlp"},
            {"param": "B", "result": "S[0]", "function": "mlp"}]


@pytest.fixture
def rules(tmp_path):
    path = tmp_path / "rules.json"
    path.write_text(json.dumps(TP_RULES))
    return str(path)


def tvm_distx(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the real command line in a new process."""
    return subprocess.run([sys.executable, "-m", "tvm_distx", *argv], capture_output=True,
                          text=True, timeout=timeout)


def expected_annotation():
    return AnnotateSharding([ShardingRule(**r) for r in TP_RULES])(td.load_module(TP))


def test_annotate_writes_the_same_module_as_the_pass(rules, tmp_path):
    done = tvm_distx("annotate", TP, "--rules", rules, "-o", str(tmp_path / "out.py"))
    assert done.returncode == 0, done.stderr
    tvm.ir.assert_structural_equal(td.load_module(tmp_path / "out.py"), expected_annotation())


def test_yaml_rules_and_propagate_to_stdout(tmp_path, capsys):
    path = tmp_path / "rules.yaml"
    path.write_text("- {param: A, result: 'S[1]', function: mlp}\n"
                    "- {param: B, result: 'S[0]', function: mlp}\n")
    done = tvm_distx("propagate", TP, "--rules", str(path))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    back = tvm.script.from_source(out.replace("R.DTensor", "R.dist.DTensor")
                                  .replace("R.device_mesh", "R.dist.device_mesh"))
    tvm.ir.assert_structural_equal(back, PropagateSharding()(expected_annotation()))


def test_plan_prints_the_all_reduce_with_its_bytes(rules, capsys):
    done = tvm_distx("plan", TP, "--rules", rules)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "all_reduce" in out and "65,536 (64.0 KiB)" in out


def test_explain_prints_tables_the_comm_report_and_one_value(rules, tmp_path, capsys):
    done = tvm_distx("explain", TP, "--rules", rules, "--value", "mlp:A",
                     "--png", str(tmp_path / "a.png"))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "function mlp" in out and "function main" in out
    assert "all_reduce" in out and "[0:128, 64:128]" in out
    assert (tmp_path / "a.png").is_file()


def test_run_failures_exit_1_and_bad_rank_counts_exit_2(rules, tmp_path):
    rng = np.random.default_rng(4)
    np.savez(tmp_path / "w.npz", **{k: rng.standard_normal((128, 128), dtype="float32")
                                    for k in ("A", "B")})
    assert tvm_distx("compile", TP, "--rules", rules, "--weights", str(tmp_path / "w.npz"),
                     "-o", str(tmp_path / "bundle")).returncode == 0
    np.save(tmp_path / "x.npy", np.zeros((128, 64), "float32"))  # the wrong shape
    done = tvm_distx("run", str(tmp_path / "bundle"), "-n", "2", "-i", str(tmp_path / "x.npy"))
    assert done.returncode == 2 and "[argument] input 'x' of 'main' has shape" in done.stderr
    done = tvm_distx("run", str(tmp_path / "bundle"), "-n", "3")
    assert done.returncode == 2 and "needs 2 ranks, not 3" in done.stderr
    # repeated -i are the inputs in order: two for a one-input function is refused
    done = tvm_distx("run", str(tmp_path / "bundle"), "-n", "2", "-i", str(tmp_path / "x.npy"),
                     "-i", str(tmp_path / "x.npy"))
    assert done.returncode == 2 and "takes 1 positional input(s) (x), got 2" in done.stderr
    assert "hint: give one -i file per input" in done.stderr  # flags on the CLI, not params=
    # an output directory that cannot be made is refused before any rank runs
    (tmp_path / "a_file").write_text("")
    done = tvm_distx("run", str(tmp_path / "bundle"), "-n", "2", "-i", str(tmp_path / "x.npy"),
                     "-o", str(tmp_path / "a_file" / "out"))
    assert done.returncode == 2 and "cannot write -o" in done.stderr and \
        "Not a directory" in done.stderr and "Traceback" not in done.stderr
    np.save(tmp_path / "x.npy", np.zeros((128, 128), "float32"))
    import os

    env = {**os.environ, "TVM_DISTX_FAULT": "1:raise"}
    failed = subprocess.run([sys.executable, "-m", "tvm_distx", "run", str(tmp_path / "bundle"),
                             "-n", "2", "-i", str(tmp_path / "x.npy"), "--timeout", "60"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert failed.returncode == 1 and "[launch] rank 1 failed" in failed.stderr


def test_bundle_for_rvv_checks_every_kernel_under_qemu(rules, tmp_path):
    require_tools()
    done = tvm_distx("bundle", TP, "--rules", rules, "--target", "rvv",
                     "-o", str(tmp_path / "rvv"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("vector code ran") == 2


def test_compile_then_run_a_bundle_on_disco(rules, tmp_path):
    rng = np.random.default_rng(4)
    x, A, B = (0.1 * rng.standard_normal((128, 128), dtype="float32") for _ in range(3))
    np.savez(tmp_path / "w.npz", A=A, B=B)
    np.save(tmp_path / "x.npy", x)
    done = tvm_distx("compile", TP, "--rules", rules, "--weights", str(tmp_path / "w.npz"),
                     "-o", str(tmp_path / "bundle"))
    assert done.returncode == 0, done.stderr
    assert "wrote the x86 bundle for 2 ranks" in done.stdout
    done = tvm_distx("run", str(tmp_path / "bundle"), "-n", "2", "--backend", "disco",
                     "-i", str(tmp_path / "x.npy"), "-o", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr

    def mlp(v):
        return np.maximum(v @ A, 0) @ B

    np.testing.assert_allclose(np.load(tmp_path / "out" / "out0.npy"), mlp(mlp(x)), atol=1e-5)


@pytest.mark.parametrize("argv,message", [
    (["annotate", TP], "annotate needs --rules"),
    (["propagate", "nowhere.py"], "module file nowhere.py does not exist"),
    (["propagate", TP, "--rules", "RULES_NOT_JSON"], "cannot read rules"),
    (["propagate", TP, "--rules", "RULES_BAD_FIELD"], "rule 0 in .* has an unknown field"),
    (["propagate", TP, "--rules", "RULES_BAD_PLACEMENT"], "\\[sharding-rule\\] placement \"Q\\[1\\]\""),
    (["compile", TP, "--weights", "nowhere.npz", "-o", "OUT"], "cannot read weights"),
    (["propagate", TP, "--rules", "bad.yaml"], "cannot read rules from .*bad.yaml: YAML .* "
     "at line 2, column 2"),
    (["propagate", "MODULE_DIR"], "module file .*MODULE_DIR is a directory, not a file"),
])
def test_bad_input_is_one_line_with_a_hint_and_exit_code_2(argv, message, tmp_path, capsys):
    files = {"RULES_NOT_JSON": "[{", "RULES_BAD_FIELD": '[{"parm": "A"}]',
             "RULES_BAD_PLACEMENT": '[{"param": "A", "result": "Q[1]", "function": "mlp"}]',
             "bad.yaml": "- param: A\n - result: S[1]\n"}
    for key, text in files.items():
        (tmp_path / key).write_text(text)
    (tmp_path / "MODULE_DIR").mkdir()
    files["MODULE_DIR"] = None
    argv = [str(tmp_path / a) if a in files or a == "OUT" else a for a in argv]
    done = tvm_distx(*argv)
    assert done.returncode == 2
    err = done.stderr
    assert not (tmp_path / "OUT").exists()  # no partial output
    assert err.startswith("tvm-distx: error: ")
    assert "Traceback" not in err
    import re

    assert re.search(message, err), err


def test_verbose_shows_the_traceback_and_a_real_process_exits_2(tmp_path):
    done = subprocess.run([sys.executable, "-m", "tvm_distx", "--verbose", "run",
                           str(tmp_path), "-n", "2"], capture_output=True, text=True)
    assert done.returncode == 2
    assert "Traceback" in done.stderr and "[bundle]" in done.stderr
    quiet = subprocess.run([sys.executable, "-m", "tvm_distx", "run", str(tmp_path), "-n", "2"],
                           capture_output=True, text=True)
    assert quiet.returncode == 2 and "Traceback" not in quiet.stderr
    assert "\x1b[" not in quiet.stderr  # no progress or colour when not a terminal
    usage = subprocess.run([sys.executable, "-m", "tvm_distx", "frobnicate"],
                           capture_output=True, text=True)
    assert usage.returncode == 2 and "invalid choice" in usage.stderr


_PROPAGATE_SECONDS: list[float] = []


@pytest.fixture
def propagate_seconds(rules) -> float:
    """How long the whole ``propagate`` command takes here (the faster of two runs, once)."""
    import time

    if _PROPAGATE_SECONDS:
        return _PROPAGATE_SECONDS[0]
    times = []
    for _ in range(2):
        began = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "tvm_distx", "propagate", TP, "--rules",
                               rules], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        times.append(time.perf_counter() - began)
    _PROPAGATE_SECONDS.append(min(times))
    return _PROPAGATE_SECONDS[0]


@pytest.mark.parametrize("share", [0.15, 0.35, 0.55])
def test_ctrl_c_while_tvm_loads_is_one_line_and_exit_130(rules, propagate_seconds, share):
    """The command line imports TVM (most of its start-up) inside the command, where Ctrl-C
    is caught; whenever it lands, the process prints one line and exits 130 (not killed by
    the signal, not aborted in an extension's C++ start-up). The signal lands at a share of
    the command's whole time on this host, so it always lands before the command ends."""
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "tvm_distx", "propagate", TP, "--rules", rules],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=proc_tools.with_default_ctrl_c)
    time.sleep(share * propagate_seconds)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip() == "interrupted" and "Traceback" not in err


def test_ctrl_c_during_an_import_is_held_until_the_import_ends(tmp_path, monkeypatch):
    import signal
    import time

    from tvm_distx.cli.main import _on_ctrl_c

    (tmp_path / "slow_module_for_ctrl_c.py").write_text(
        "import signal, time\n"
        "signal.raise_signal(signal.SIGINT)\n"
        "time.sleep(0.3)\n"
        "FINISHED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    previous = signal.signal(signal.SIGINT, _on_ctrl_c)
    try:
        with pytest.raises(KeyboardInterrupt):
            import slow_module_for_ctrl_c  # noqa: F401  (the Ctrl-C must wait for its end)

            assert slow_module_for_ctrl_c.FINISHED
            time.sleep(5)  # the held Ctrl-C arrives here
    finally:
        signal.signal(signal.SIGINT, previous)
        sys.modules.pop("slow_module_for_ctrl_c", None)
    assert slow_module_for_ctrl_c.FINISHED


def test_an_interrupt_wrapped_by_python_is_still_an_interrupt():
    from tvm_distx.cli.main import _interrupted

    class Named:
        def __set_name__(self, owner, name):
            raise KeyboardInterrupt

    with pytest.raises((RuntimeError, KeyboardInterrupt)) as caught:  # 3.11 wraps it
        type("Owner", (), {"field": Named()})
    assert _interrupted(caught.value)
    assert not _interrupted(RuntimeError("plain"))
    assert _interrupted(KeyboardInterrupt())


@pytest.fixture(scope="module")
def two_layer_script(tmp_path_factory):
    """A two-layer transformer (attention and MLP, residuals) imported from PyTorch, as TVMScript."""
    torch = pytest.importorskip("torch")

    class Layer(torch.nn.Module):
        def __init__(self, width=32, heads=4):
            super().__init__()
            self.heads = heads
            self.q, self.k, self.v, self.o = (torch.nn.Linear(width, width, bias=False)
                                              for _ in range(4))
            self.up = torch.nn.Linear(width, 64, bias=False)
            self.down = torch.nn.Linear(64, width, bias=False)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = (f(x).reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
                       for f in (self.q, self.k, self.v))
            mixed = torch.softmax(q @ k.transpose(-1, -2), -1) @ v
            x = x + self.o(mixed.transpose(1, 2).reshape(b, t, d))
            return x + self.down(torch.relu(self.up(x)))

    model = torch.nn.Sequential(Layer(), Layer()).eval()
    mod, _ = td.from_torch(model, (torch.zeros(1, 8, 32),))
    path = tmp_path_factory.mktemp("script") / "two_layers.py"
    path.write_text(mod.script())
    return str(path)


def test_plan_with_the_tensor_parallel_preset_prints_each_layer_against_the_ideal(
        two_layer_script, tmp_path):
    done = tvm_distx("plan", two_layer_script, "--preset", "tensor-parallel", "--mesh", "2")
    assert done.returncode == 0, done.stderr
    assert "layer 0: 2 all-reduce(s), ideal 2 (ideal)" in done.stdout
    assert "layer 1: 2 all-reduce(s), ideal 2 (ideal)" in done.stdout
    done = tvm_distx("annotate", two_layer_script, "--preset", "tensor-parallel", "--mesh", "2",
                     "-o", str(tmp_path / "annotated.py"))
    assert done.returncode == 0, done.stderr
    annotated = td.load_module(tmp_path / "annotated.py")
    assert annotated.script().count("R.dist.annotate_sharding") == 12


@pytest.mark.parametrize("extra, message", [
    (["--rules", "r.json"], "--rules and --preset both say how to shard"),
    (["--mesh", "2y"], "--mesh '2y' is not a mesh shape"),
])
def test_preset_and_mesh_errors_are_one_line(two_layer_script, extra, message, tmp_path):
    (tmp_path / "r.json").write_text("[]")
    extra = [str(tmp_path / a) if a == "r.json" else a for a in extra]
    done = tvm_distx("plan", two_layer_script, "--preset", "tensor-parallel", *extra)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr


def test_the_command_line_leaves_a_programs_logging_as_it_was(rules, caplog):
    """main() inside a larger program: its warnings-in-flags filter ends with the command."""
    before = [list(h.filters) for h in logging.getLogger().handlers]
    assert cli(["propagate", TP, "--rules", rules]) == 0
    assert [list(h.filters) for h in logging.getLogger().handlers] == before
