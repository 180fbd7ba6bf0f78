"""A new user's first hour, through real processes in a fresh directory.

The command-line session pasted in the command-line guide (``docs/cli.md``) is read from
that page itself and run command by command; then every mistake a new user made with the CLI is made again, and each must
end with one error line and a hint, the documented exit code, no traceback, and nothing
lost or half written.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from locations import REPO_ROOT
import proc_tools

ROOT = REPO_ROOT
BIN = Path(sys.executable).parent  # the environment's tvm-distx and python
SEED = ROOT / "tests" / "data" / "seed_tensor_parallel.py"


def _readme_session() -> list[tuple[str, list[str]]]:
    """The guide's pasted command-line session: each ``$`` command with its output lines."""
    text = (ROOT / "docs" / "cli.md").read_text()
    block = re.search(r"```text\n(\$ cat rules\.json\n.*?)```", text, flags=re.S)
    assert block, "the command-line guide's session (docs/cli.md) is missing"
    session: list[tuple[str, list[str]]] = []
    for line in block.group(1).splitlines():
        if line.startswith("$ "):
            session.append((line[2:], []))
        else:
            session[-1][1].append(line)
    return session


def _cli(args: list[str] | str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    env.pop("COLUMNS", None)
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, shell=isinstance(args, str))


def _one_line_error(done: subprocess.CompletedProcess, code: int, *phrases: str) -> str:
    """The error is one line plus a hint, with ``code``, no traceback; returns it."""
    err = done.stderr.strip()
    assert done.returncode == code, (done.returncode, err)
    assert "Traceback" not in err and "InternalError" not in err, err
    lines = err.splitlines()
    assert lines[0].startswith("tvm-distx: error: ") or lines == ["interrupted"], err
    assert len(lines) <= 2 and (len(lines) == 1 or lines[1].startswith("hint: ")), err
    for phrase in phrases:
        assert phrase in err, (phrase, err)
    return err


@pytest.fixture(scope="module")
def journey(tmp_path_factory):
    """A fresh directory holding the tour's inputs, after the guide's session has run in it."""
    home = tmp_path_factory.mktemp("journey")
    session = _readme_session()
    shutil.copy(SEED, home / "model.py")
    assert session[0][0] == "cat rules.json"
    (home / "rules.json").write_text("\n".join(session[0][1]) + "\n")  # the guide's own rules
    rng = np.random.default_rng(7)
    x, a, b = (0.1 * rng.standard_normal((128, 128), dtype="float32") for _ in range(3))
    np.save(home / "x.npy", x)
    np.save(home / "A.npy", a)
    np.save(home / "B.npy", b)
    np.savez(home / "weights.npz", A=a, B=b)
    mlp = lambda v: np.maximum(v @ a, 0) @ b  # noqa: E731
    np.save(home / "want.npy", mlp(mlp(x)))
    results = {}
    for command, shown in session[1:]:
        done = _cli(command, home)
        assert done.returncode == 0, (command, done.stderr)
        assert "Traceback" not in done.stderr
        results[command] = (done, shown)
    return home, results


def test_the_readme_session_runs_as_written(journey):
    home, results = journey
    by_verb = {shlex.split(c)[1] if c.startswith("tvm-distx") else "python": (done, shown)
               for c, (done, shown) in results.items()}
    assert set(by_verb) == {"propagate", "plan", "compile", "run", "python"}
    done, _ = by_verb["propagate"]
    assert 'R.DTensor((128, 128), "float32", "mesh[0]", "S[1]")' in done.stdout
    done, shown = by_verb["plan"]
    assert "all_reduce" in done.stdout and "65,536 (64.0 KiB)" in done.stdout
    assert [s for s in shown if "total" in s][0].split()[-3:] == \
        [s for s in done.stdout.splitlines() if "total" in s][0].split()[-3:]
    for verb in ("compile", "run"):  # the confirmations read as the guide shows them
        done, shown = by_verb[verb]
        assert done.stdout.strip().splitlines() == shown, (done.stdout, shown)
    assert (home / "bundle" / "manifest.json").is_file()
    assert np.load(home / "out" / "out0.npy").shape == (128, 128)
    done, _ = by_verb["python"]
    assert float(done.stdout) < 1e-5  # the two MPI ranks equal numpy


@pytest.fixture(scope="module")
def input_bundle(journey):
    """The model compiled with no weights: x, A and B are all inputs at run time."""
    home, _ = journey
    done = _cli(["tvm-distx", "compile", "model.py", "--rules", "rules.json", "-o", "inputs"],
                home)
    assert done.returncode == 0, done.stderr
    return home / "inputs"


def test_repeated_inputs_in_order_and_the_bundle_readme_example(journey, input_bundle):
    home, _ = journey
    readme = (input_bundle / "README.md").read_text()
    example = next(line for line in readme.splitlines() if line.startswith("./run.sh"))
    assert example == "./run.sh -i x.npy -i A.npy -i B.npy -o out/"
    for name in ("x", "A", "B"):
        shutil.copy(home / f"{name}.npy", input_bundle / f"{name}.npy")
    done = _cli(example, input_bundle)
    assert done.returncode == 0, done.stderr
    assert np.allclose(np.load(input_bundle / "out" / "out0.npy"), np.load(home / "want.npy"),
                       atol=1e-5)
    # inputs out of order have the wrong meaning but the right shapes: named ones fix that
    done = _cli(["tvm-distx", "run", str(input_bundle), "-n", "2", "-i", "B=B.npy",
                 "-i", "x=x.npy", "-i", "A=A.npy", "-o", "named"], home)
    assert done.returncode == 0, done.stderr
    assert np.allclose(np.load(home / "named" / "out0.npy"), np.load(home / "want.npy"),
                       atol=1e-5)


def test_wrong_inputs_are_refused_before_any_rank_starts(journey, input_bundle):
    home, _ = journey
    np.save(home / "small.npy", np.zeros((4, 4), "float32"))
    np.save(home / "int.npy", np.zeros((128, 128), "int32"))
    cases = [
        (["-i", "x.npy"], "takes 3 positional input(s) (x, A, B), got 1"),
        (["-i", "x.npy", "-i", "A.npy", "-i", "small.npy"], "shape"),
        (["-i", "x.npy", "-i", "A.npy", "-i", "int.npy"], "int32"),
    ]
    for inputs, phrase in cases:
        done = _cli(["tvm-distx", "run", str(input_bundle), "-n", "2", *inputs, "-o", "never"],
                    home)
        err = _one_line_error(done, 2, phrase)
        assert "np.save" not in err.splitlines()[0]
        assert not (home / "never").exists()  # refused before anything ran


def test_yaml_rules_with_a_syntax_error(journey):
    home, _ = journey
    (home / "broken.yaml").write_text("- param: A\n  result: S[1]\n   function: mlp\n")
    done = _cli(["tvm-distx", "propagate", "model.py", "--rules", "broken.yaml"], home)
    _one_line_error(done, 2, "broken.yaml", "line 3")


def test_an_unwritable_output_directory_is_refused_before_the_job(journey):
    home, _ = journey
    if os.geteuid() == 0:  # root writes through permissions: use a file system nobody writes
        target = "/proc/tvm-distx-results"
    else:
        locked = home / "locked"
        locked.mkdir()
        locked.chmod(0o555)
        target = str(locked / "out")
    started = time.monotonic()
    done = _cli(["tvm-distx", "run", "bundle", "-n", "2", "-i", "x.npy", "-o", target], home)
    _one_line_error(done, 2, "cannot write -o")
    assert time.monotonic() - started < 20  # refused at once, not after the ranks ran


def _copy_bundle(home: Path, name: str) -> Path:
    copy = home / name
    shutil.copytree(home / "bundle", copy)
    return copy


def test_a_corrupt_or_foreign_library_is_refused_before_launch(journey):
    home, _ = journey
    tampered = _copy_bundle(home, "tampered")
    with open(tampered / "lib.so", "ab") as f:
        f.write(b"\0")
    _one_line_error(_cli(["tvm-distx", "run", "tampered", "-n", "2", "-i", "x.npy"], home), 2,
                    "lib.so")
    # a library for another machine (an ELF header for RISC-V), its checksum made to match
    foreign = _copy_bundle(home, "foreign")
    header = bytearray(64)
    header[:7] = b"\x7fELF\x02\x01\x01"
    header[16:20] = (3).to_bytes(2, "little") + (0xF3).to_bytes(2, "little")  # ET_DYN, RISC-V
    (foreign / "lib.so").write_bytes(bytes(header))
    manifest = json.loads((foreign / "manifest.json").read_text())
    from tvm_distx.bundle.manifest import sha256_file

    manifest["library_sha256"] = sha256_file(foreign / "lib.so")
    (foreign / "manifest.json").write_text(json.dumps(manifest))
    err = _one_line_error(_cli(["tvm-distx", "run", "foreign", "-n", "2", "-i", "x.npy"], home),
                          2, "built for riscv64")
    assert "tvm-distx" in err.splitlines()[-1]  # the hint speaks in commands, not Python


def test_paths_in_a_manifest_stay_inside_the_bundle(journey):
    home, _ = journey
    escaping = _copy_bundle(home, "escaping")
    manifest = json.loads((escaping / "manifest.json").read_text())
    manifest["library"] = "../../../../bin/ls"
    (escaping / "manifest.json").write_text(json.dumps(manifest))
    _one_line_error(_cli(["tvm-distx", "run", "escaping", "-n", "2", "-i", "x.npy"], home), 2,
                    "outside the bundle")


def _deep_model(layers: int) -> str:
    """TVMScript of a chain of ``layers`` matmul + relu of growing widths: seconds of TVM build."""
    widths = [64 + 8 * i for i in range(layers + 1)]
    params = "".join(f",\n        w{i}: R.Tensor(({widths[i]}, {widths[i + 1]}), 'float32')"
                     for i in range(layers))
    body, previous = [], "x"
    for i in range(layers):
        body.append(f"            r{i} = R.nn.relu(R.matmul({previous}, w{i}))")
        previous = f"r{i}"
    lines = "\n".join(body)
    return f"""from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class Deep:
    I.module_attrs({{"device_num": 2}})
    I.module_global_infos({{"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]}})

    @R.function
    def main(
        x: R.Tensor((16, {widths[0]}), "float32"){params},
    ) -> R.Tensor((16, {widths[-1]}), "float32"):
        with R.dataflow():
{lines}
            R.output({previous})
        return {previous}
"""


def _interrupted_compile(home: Path, when: str) -> subprocess.CompletedProcess:
    """``tvm-distx --verbose compile`` of a deep model, sent SIGINT ``when`` it is importing
    (0.6 s after its start) or building (as it logs that TVM's build starts)."""
    (home / "deep.py").write_text(_deep_model(100))
    (home / "deep_rules.json").write_text('[{"param": "w0", "result": "S[1]"}]')
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.Popen(["tvm-distx", "--verbose", "compile", "deep.py", "--rules",
                             "deep_rules.json", "-o", "interrupted"], cwd=home, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=proc_tools.with_default_ctrl_c)
    logged = []
    if when == "importing":
        time.sleep(0.6)
    else:
        for line in proc.stderr:  # the build takes seconds after this line
            logged.append(line)
            if "building for" in line:
                break
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    err = "".join(logged) + err
    assert "building for" in err or when == "importing", err
    quiet = "\n".join(line for line in err.splitlines() if not line.startswith("INFO "))
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, quiet)


@pytest.mark.parametrize("when", ["importing", "building"])
def test_ctrl_c_during_start_up_is_one_line_and_exit_130(journey, when):
    home, _ = journey
    _one_line_error(_interrupted_compile(home, when), 130)
    assert not (home / "interrupted" / "manifest.json").exists()


def test_a_directory_given_as_the_module(journey):
    home, _ = journey
    (home / "models").mkdir(exist_ok=True)
    done = _cli(["tvm-distx", "propagate", "models", "--rules", "rules.json"], home)
    _one_line_error(done, 2, "is a directory")


def test_weights_missing_a_weight_are_refused_before_compiling(journey):
    home, _ = journey
    np.savez(home / "partial.npz", A=np.load(home / "A.npy"))
    done = _cli(["tvm-distx", "compile", "model.py", "--rules", "rules.json", "--weights",
                 "partial.npz", "-o", "partial"], home)
    err = _one_line_error(done, 2, "no weight 'B'", "partial.npz")
    assert "-i" in err.splitlines()[1]  # the hint names the CLI's way out
    assert not (home / "partial").exists()


def test_a_weight_of_another_shape_is_refused_naming_the_file(journey):
    home, _ = journey
    np.savez(home / "wrong.npz", A=np.zeros((64, 128), "float32"), B=np.load(home / "B.npy"))
    done = _cli(["tvm-distx", "compile", "model.py", "--rules", "rules.json", "--weights",
                 "wrong.npz", "-o", "wrong"], home)
    err = _one_line_error(done, 2, "weight 'A' in wrong.npz has shape (64, 128); 'main' "
                          "takes (128, 128)")
    assert err.splitlines()[1] == "hint: save A with shape (128, 128) in wrong.npz " \
        "(numpy.savez)"
    assert not (home / "wrong").exists()


def test_rule_errors_give_hints_in_the_rules_file_syntax(journey):
    home, _ = journey
    (home / "two.json").write_text('[{"param": "A", "callee": "mlp", "result": "S[1]"}]')
    done = _cli(["tvm-distx", "annotate", "model.py", "--rules", "two.json"], home)
    err = _one_line_error(done, 2, "exactly one matcher")
    hint = err.splitlines()[1]
    assert '{"callee": "mlp"' in hint and "ShardingRule(" not in hint


def test_version_and_a_run_that_leaves_the_rank_count_to_the_bundle(journey):
    home, _ = journey
    done = _cli(["tvm-distx", "--version"], home)
    assert done.returncode == 0 and re.fullmatch(r"tvm-distx \S+ \(TVM \S+\)\n", done.stdout)
    done = _cli(["tvm-distx", "run", "bundle", "-i", "x.npy", "-o", "out-no-n"], home)
    assert done.returncode == 0, done.stderr
    np.testing.assert_array_equal(np.load(home / "out-no-n" / "out0.npy"),
                                  np.load(home / "out" / "out0.npy"))
    _one_line_error(_cli(["tvm-distx", "run", "bundle", "-n", "3", "-i", "x.npy"], home), 2,
                    "2 ranks")


def test_propagating_high_level_operators_warns_in_flags(journey):
    home, _ = journey
    done = _cli(["tvm-distx", "propagate", "model.py", "--rules", "rules.json"], home)
    assert done.returncode == 0
    lines = done.stderr.strip().splitlines()
    assert lines[0].startswith("tvm-distx: warning: 3 high-level operator call(s) take sharded "
                               "operands (relax.matmul at 'lv0' in 'mlp')"), lines
    assert lines[1:] == ["hint: add --legalize to legalize them first, as compile does"]
    assert "LegalizeOps" not in done.stderr  # no Python advice on the command line
    legal = _cli(["tvm-distx", "propagate", "model.py", "--rules", "rules.json", "--legalize"],
                 home)
    assert legal.returncode == 0 and legal.stderr == ""


def test_explaining_an_unknown_value_prints_no_table_before_the_error(journey):
    home, _ = journey
    done = _cli(["tvm-distx", "explain", "model.py", "--rules", "rules.json", "--value",
                 "mlp:Z"], home)
    _one_line_error(done, 2, "function 'mlp' has no tensor value 'Z'")
    assert done.stdout == ""


def _doc_command(page: str, start: str) -> str:
    """The command line of ``docs/<page>`` that starts with ``start``, its comment removed."""
    text = (ROOT / "docs" / page).read_text()
    line = next((line for line in text.splitlines() if line.startswith(start)), None)
    assert line is not None, f"docs/{page} no longer shows {start!r}"
    return line.split("  #")[0].strip()


def test_the_documented_mesh_flags_run_on_a_module_with_its_own_mesh(journey):
    home, _ = journey  # model.py declares its mesh, of 2 devices
    command = _doc_command("autoshard.md", "tvm-distx autoshard model.py --mesh 2x2")
    assert command == "tvm-distx autoshard model.py --mesh 2x2 --memory 1GiB -o rules.yaml"
    done = _cli(command, home)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines()[0] == ("tvm-distx: warning: --mesh 2x2 replaces the "
                                           "module's mesh (shape 2) by a mesh of shape 2x2")
    assert "auto_shard on a (2, 2) mesh" in done.stderr
    written = (home / "rules.yaml").read_text()
    assert "function: main" in written and "result: RS[1]" in written  # a plan for 2x2
    # the same shape as the module's: nothing to replace, nothing said
    command = _doc_command("cli.md", "tvm-distx plan model.py --preset tensor-parallel --mesh")
    assert command == "tvm-distx plan model.py --preset tensor-parallel --mesh 2"
    done = _cli(command, home)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout.startswith("tensor-parallel plan for 2 ranks"), done.stdout
    # another shape: the plan is for that many ranks
    done = _cli(["tvm-distx", "plan", "model.py", "--rules", "rules.json", "--mesh", "4"], home)
    assert done.returncode == 0, done.stderr
    assert "98,304 (96.0 KiB)" in done.stdout  # an all-reduce over 4 ranks, not 2


def test_a_mesh_flag_is_refused_where_the_module_cannot_change_its_mesh(journey):
    home, _ = journey
    done = _cli(["tvm-distx", "propagate", "model.py", "--rules", "rules.json", "--legalize",
                 "-o", "typed.py"], home)
    assert done.returncode == 0, done.stderr
    done = _cli(["tvm-distx", "plan", "typed.py", "--mesh", "4"], home)
    err = _one_line_error(done, 2, "--mesh 4: the module's values are typed on its mesh "
                          "(shape 2) already")
    assert err.splitlines()[1] == ("hint: drop --mesh, or give --mesh the module from before "
                                   "propagate (with R.Tensor types)")
    done = _cli(["tvm-distx", "plan", "typed.py", "--mesh", "2"], home)  # its own mesh: fine
    assert done.returncode == 0 and "all_reduce" in done.stdout, done.stderr
    stages = SEED.read_text().replace(
        "[R.dist.device_mesh((2,), I.Range(0, 2))]",
        "[R.dist.device_mesh((1,), I.Range(0, 1)), R.dist.device_mesh((1,), I.Range(1, 2))]")
    (home / "stages.py").write_text(stages)
    done = _cli(["tvm-distx", "plan", "stages.py", "--mesh", "2"], home)
    err = _one_line_error(done, 2, "--mesh 2: the module has 2 meshes (shapes 1, 1: pipeline "
                          "stages), and one --mesh cannot replace them")
    assert err.splitlines()[1] == ("hint: drop --mesh to run on the module's meshes, or change "
                                   "them in its I.module_global_infos")
    done = _cli(["tvm-distx", "plan", "stages.py"], home)  # the hint's way works
    assert done.returncode == 0, done.stderr


def test_the_tensor_parallel_preset_finds_the_readme_plan_in_the_seed(journey):
    home, _ = journey
    done = _cli(["tvm-distx", "plan", "model.py", "--preset", "tensor-parallel"], home)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    lines = done.stdout.splitlines()
    assert lines[1:6] == [
        "weights split: 100% of the matrices' bytes (0.1 of 0.1 MiB)",
        "model: 2 all-reduce(s), ideal 2 (ideal)",  # one per call of mlp
        "  split S[1]   A: reads the mlp block's input; output features split",
        "  split S[0]   B: ends the mlp block, after its elementwise work; input features "
        "split, one all-reduce",
        "  whole        x: not a linear's weight (an input, or a table read by index)"], lines
    assert lines[-1] == "total received per rank: 131,072 bytes"
    # the documented command (its own mesh given again) prints the same plan
    documented = _cli(_doc_command("cli.md", "tvm-distx plan model.py --preset"), home)
    assert documented.stdout == done.stdout
    # the preset's program is the rules' program: same numbers as numpy on 2 ranks
    done = _cli(["tvm-distx", "compile", "model.py", "--preset", "tensor-parallel",
                 "--weights", "weights.npz", "-o", "preset_bundle"], home)
    assert done.returncode == 0, done.stderr
    done = _cli(["tvm-distx", "run", "preset_bundle", "-i", "x.npy", "-o", "preset_out"], home)
    assert done.returncode == 0, done.stderr
    np.testing.assert_allclose(np.load(home / "preset_out" / "out0.npy"),
                               np.load(home / "want.npy"), atol=1e-5)


def test_a_pytorch_file_is_named_and_the_hint_gets_a_module_the_cli_reads(journey):
    home, _ = journey
    shutil.copy(ROOT / "tests" / "models" / "transformer.py", home / "transformer.py")
    done = _cli(["tvm-distx", "plan", "transformer.py"], home)
    err = _one_line_error(done, 2)
    assert err.splitlines()[0] == (
        "tvm-distx: error: [tvmscript] transformer.py is a PyTorch file (4 torch.nn.Module "
        "classes: Attention, MLP, Block, Transformer), not a TVMScript module")
    hint = err.splitlines()[1]
    steps = re.fullmatch(r"hint: the command line reads TVMScript: in Python, (.*); then "
                         r"(tvm-distx .*)", hint)
    assert steps, hint
    # the hint's steps, as written, with the model's example input
    python = ("import numpy, torch, tvm_distx\nfrom transformer import Transformer\n"
              "example_input = torch.randn(1, 8, 256)\n" + steps.group(1).replace("; ", "\n"))
    done = _cli([sys.executable, "-c", python], home)
    assert done.returncode == 0, done.stderr
    done = _cli(steps.group(2), home)
    assert done.returncode == 0, done.stderr
    assert "layer 1: 2 all-reduce(s), ideal 2 (ideal)" in done.stdout


def test_too_few_inputs_say_whether_the_bundle_holds_the_weights(journey, input_bundle):
    home, _ = journey
    done = _cli(["tvm-distx", "run", str(input_bundle), "-i", "x.npy", "-o", "never"], home)
    err = _one_line_error(done, 2)
    assert err.splitlines() == [
        "tvm-distx: error: [argument] 'main' takes 3 positional input(s) (x, A, B), got 1; "
        "the bundle holds no weights, so each parameter is an input",
        "hint: give one -i file for each of x, A, B, in that order (-i x.npy -i A.npy "
        "-i B.npy), or compile the bundle with --weights W.npz to store the weights in it"]
    done = _cli(["tvm-distx", "run", str(input_bundle), "-i", "x.npy", "-i", "A.npy", "-i",
                 "B.npy", "-o", "inputs_out"], home)  # the hint's first way
    assert done.returncode == 0, done.stderr
    # a bundle with its weights: one input, and a weight given again is named
    done = _cli(["tvm-distx", "run", "bundle", "-i", "x.npy", "-i", "A.npy"], home)
    err = _one_line_error(done, 2)
    assert err.splitlines() == [
        "tvm-distx: error: [argument] 'main' takes 1 positional input(s) (x), got 2; the "
        "bundle holds the weights A, B",
        "hint: give one -i file per input, in parameter order (-i x.npy), or -i NAME=PATH; "
        "the bundle gives the weights"]
    done = _cli(["tvm-distx", "run", "bundle", "-i", "x.npy", "-i", "A=A.npy"], home)
    assert _one_line_error(done, 2).splitlines() == [
        "tvm-distx: error: [argument] A is a weight stored in the bundle",
        "hint: drop -i A=...: the bundle gives it"]
    assert not (home / "never").exists()
    np.testing.assert_allclose(np.load(home / "inputs_out" / "out0.npy"),
                               np.load(home / "want.npy"), atol=1e-5)


def test_a_plan_of_nothing_sharded_says_how_to_shard(journey):
    home, _ = journey
    done = _cli(["tvm-distx", "plan", "model.py"], home)
    assert done.returncode == 0 and "0 (0 B)" in done.stdout
    assert done.stderr == ("hint: nothing in model.py is sharded, so nothing moves: give "
                           "--rules FILE, or --preset tensor-parallel\n")
    done = _cli(["tvm-distx", "annotate", "model.py", "--rules", "rules.json", "-o",
                 "annotated.py"], home)
    assert done.returncode == 0, done.stderr
    done = _cli(["tvm-distx", "plan", "annotated.py"], home)  # sharded by its annotations
    assert done.returncode == 0 and done.stderr == "" and "all_reduce" in done.stdout


def test_explain_keeps_each_row_on_one_line_in_a_pipe_and_wraps_to_columns(journey):
    home, _ = journey
    why = "signature of this version, from the call at 'y' in 'main'"
    piped = _cli(["tvm-distx", "explain", "model.py", "--rules", "rules.json"], home)
    assert piped.returncode == 0, piped.stderr
    row = [line for line in piped.stdout.splitlines() if line.startswith("│ A ")]
    assert row and why in row[0], piped.stdout
    narrow = _cli("COLUMNS=80 tvm-distx explain model.py --rules rules.json", home)
    assert narrow.returncode == 0, narrow.stderr
    assert max(len(line) for line in narrow.stdout.splitlines()) <= 80
    assert why not in narrow.stdout  # wrapped in its column


def test_every_flag_says_what_it_is_for(journey):
    home, _ = journey
    for command, flag, text in [
            ("compile", "--target {x86,rvv}", "the machine to compile for: x86 (this host's "
             "kind) or rvv (RISC-V with vectors) (default: x86)"),
            ("compile", "--function FUNCTION", "the function whose parameters --weights gives "
             "(default: main)"),
            ("run", "--function FUNCTION", "the bundle's function to run (default: main)"),
            ("run", "--backend mpi|disco|emulate|board", "where the ranks run: mpi:"),
            ("propagate", "--legalize", "legalize high-level operators first, as compile does"),
            ("plan", "--preset {tensor-parallel}", "instead of --rules: Megatron's "
             "tensor-parallel plan, found from the graph's structure")]:
        done = _cli(["tvm-distx", command, "--help"], home)
        assert done.returncode == 0, done.stderr
        assert f"{flag} {text}" in " ".join(done.stdout.split()), (command, flag, done.stdout)
        # the help speaks the command line: no Python names of the package
        for python in ("ShardingRule", "presets.", "LegalizeOps", "()"):
            assert python not in done.stdout, (command, python)


def test_messages_about_rules_and_usage_speak_the_command_line(journey):
    home, _ = journey
    (home / "typo.json").write_text('[{"parm": "A", "result": "S[1]"}]')
    err = _one_line_error(_cli(["tvm-distx", "plan", "model.py", "--rules", "typo.json"], home),
                          2)
    assert err.splitlines() == [
        "tvm-distx: error: [argument] rule 0 in typo.json has an unknown field 'parm' (did you "
        "mean 'param'?)", "hint: fields are callee, op, param, args, result, function, meshes"]
    (home / "unmatched.json").write_text('[{"param": "Z", "result": "S[1]"}]')
    err = _one_line_error(_cli(["tvm-distx", "plan", "model.py", "--rules", "unmatched.json"],
                               home), 2)
    assert err.splitlines()[0] == ('tvm-distx: error: [rule-unmatched] {"param": "Z", '
                                   '"result": "S[1]"} matched nothing')
    # bad usage: one line and the subcommand's help, no usage block of the top command
    err = _one_line_error(_cli(["tvm-distx", "run", "bundle", "-n", "x"], home), 2)
    assert err.splitlines() == ["tvm-distx: error: [argument] argument -n/--ranks: invalid int "
                                "value: 'x'", "hint: see tvm-distx run --help"]
    # a preset that finds nothing to split: the way out in flags, not Python
    odd = SEED.read_text().replace("A: R.Tensor((128, 128)", "A: R.Tensor((128, 127)").replace(
        "B: R.Tensor((128, 128)", "B: R.Tensor((127, 128)")
    (home / "odd.py").write_text(odd)
    err = _one_line_error(_cli(["tvm-distx", "plan", "odd.py", "--preset", "tensor-parallel"],
                               home), 2, "--preset tensor-parallel splits no matrix of 'main'")
    assert err.splitlines()[1] == (
        'hint: name the splits in a rules file instead of --preset: --rules FILE with '
        '[{"param": "W", "result": "S[1]"}, ...], or let tvm-distx autoshard write one')
    assert "tensor_parallel()" not in err


def test_generating_from_a_checkpoint_prints_no_tvm_or_torch_noise(tmp_path):
    """A checkpoint compiled by the command line: transformers' tokens and a quiet stderr.

    TVM's ``take`` used to log "Fast mode segfaults when there are out-of-bounds
    indices" for every embedding lookup, and torch a FutureWarning about its pytree,
    while the model compiled; neither means anything to a user.
    """
    done, want = _generated_from_a_checkpoint(tmp_path, 1, 11, 4, "-n", "2")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(t) for t in want]
    assert done.stderr == "", done.stderr


def _generated_from_a_checkpoint(tmp_path: Path, layers: int, seed: int, new_tokens: int,
                                 *flags: str):
    """``tvm-distx generate`` of a tiny Llama's checkpoint with ``flags``, and the greedy
    tokens transformers gives."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    sys.path.insert(0, str(ROOT / "tests" / "models"))
    from hf_tiny import build, greedy, prompt_ids

    model = build("llama", layers=layers)
    model.save_pretrained(tmp_path / "ckpt")
    prompt = prompt_ids(5, seed=seed)
    done = _cli(["tvm-distx", "generate", "ckpt", "--ids", *map(str, prompt),
                 "--max-new-tokens", str(new_tokens), *flags], tmp_path)
    with torch.no_grad():
        return done, greedy(model, prompt, new_tokens)


def test_a_bundle_path_that_does_not_exist_is_named_so(journey):
    home, _ = journey
    _one_line_error(_cli(["tvm-distx", "run", "nodir", "-i", "x.npy"], home), 2,
                    "[bundle] nodir does not exist",
                    "hint: give the directory tvm-distx compile ... -o DIR wrote")
    err = _one_line_error(_cli(["tvm-distx", "generate", "nodir", "--ids", "1", "2"], home), 2)
    assert err.splitlines() == ["tvm-distx: error: [bundle] nodir does not exist",
                                "hint: give a generation bundle, a Hugging Face checkpoint "
                                "directory or a .gguf file"]


def test_generating_from_a_checkpoint_in_pipeline_stages(tmp_path):
    """``--stages 2`` on 2 ranks: each rank runs one layer; transformers' tokens. Stages that
    the ranks cannot share are one line, in flags."""
    done, want = _generated_from_a_checkpoint(tmp_path, 2, 12, 6, "-n", "2", "--stages", "2",
                                              "--no-cache")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(t) for t in want]
    err = _one_line_error(_cli(["tvm-distx", "generate", "ckpt", "--ids", "1", "2", "-n", "2",
                                "--stages", "3"], tmp_path), 2)
    assert err.splitlines() == [
        "tvm-distx: error: [argument] CausalLM.from_pretrained(num_ranks=2, stages=3): 3 stages "
        "cannot share 2 ranks evenly", "hint: -n with a multiple of 3, or fewer --stages"]
