"""tvm-distx deploy: hosts from a hostfile or --hosts, each its copy, one-line errors in flags."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import numpy as np
import pytest

import tvm_distx as td
from tvm_distx import ShardingRule
from tvm_distx.bundle.manifest import read_manifest, sha256_file
from tvm_distx.cli.main import main as cli
from tvm_distx.passes import AnnotateSharding

from locations import TESTS_DIR

RSH = shlex.join([sys.executable, str(TESTS_DIR / "fake_rsh.py")])


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    mod = td.load_module(TESTS_DIR / "data" / "seed_tensor_parallel.py")
    rules = [ShardingRule(param="A", result="S[1]", function="mlp"),
             ShardingRule(param="B", result="S[0]", function="mlp")]
    exe = td.compile(AnnotateSharding(rules)(mod), target="x86")
    rng = np.random.default_rng(5)
    weights = {n: rng.standard_normal((128, 128)).astype("float32") for n in "AB"}
    return exe.export(tmp_path_factory.mktemp("cli-deploy") / "bundle", params=weights)


@pytest.fixture
def hosts(tmp_path, monkeypatch):
    for host in ("t1", "t2"):
        (tmp_path / "hosts" / host).mkdir(parents=True)
    monkeypatch.setenv("FAKE_RSH_HOSTS", str(tmp_path / "hosts"))
    monkeypatch.setenv("FAKE_RSH_DEST", str(tmp_path / "dest"))
    return tmp_path / "dest", tmp_path / "hosts"


def _weights(copy):
    return sorted(p.name for p in (copy / "weights").iterdir())


def test_deploy_from_a_hostfile_over_rsh(bundle, hosts, tmp_path, capsys):
    dest, roots = hosts
    (tmp_path / "hosts.txt").write_text("# two hosts\nt1   # rank 0\nt2\n")
    assert cli(["deploy", str(bundle), "--hostfile", str(tmp_path / "hosts.txt"),
                "--dest", str(dest), "--rsh", RSH]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out] == ["t1", "t2"]
    assert out[1].startswith(f"t2: ranks 1: 6 files, ") and out[1].endswith(f"at {dest} (checked)")
    for host, rank in (("t1", 0), ("t2", 1)):
        copy = roots / host / "dest"
        assert _weights(copy) == [f"rank{rank}.safetensors"]
        assert json.loads((copy / "deployment.json").read_text())["ranks"] == [rank]
        w = read_manifest(copy).files_of(rank)[0]
        assert sha256_file(copy / w.file) == w.sha256


def test_split_only_writes_each_hosts_copy_here(bundle, tmp_path, capsys):
    assert cli(["deploy", str(bundle), "--hosts", "a:2", "--split-only",
                str(tmp_path / "out")]) == 0
    assert _weights(tmp_path / "out" / "a") == ["rank0.safetensors", "rank1.safetensors"]
    assert "a: ranks 0,1: 7 files" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message, code", [
    (["--hosts", "t1:2,t2"], "the hosts have 3 slots \\(t1:2, t2:1\\), more than the 2 ranks of "
     "the bundle\nhint: give the hosts 2 slots in all, for example --hosts t1:2 ", 2),
    (["--hosts", "t1,t3"], "^\\[deploy\\] host t3 does not answer: ssh: Could not resolve "
     "hostname t3: Name or service not known\nhint: .*--rsh", 1),
    (["--hosts", "t1,t2", "--hostfile", "HOSTFILE"], "--hostfile and --hosts both give the "
     "hosts\nhint: give one of them: --hostfile FILE, or --hosts a:2,b", 2),
    (["--hostfile", "HOSTFILE"], "HOSTFILE:2: 't2:x': the slots after ':' are not a number", 2),
    ([], "deploy needs the hosts\nhint: give --hostfile FILE or --hosts a:2,b", 2),
], ids=["slots", "missing-host", "both", "bad-line", "no-hosts"])
def test_errors_are_one_line_and_a_hint_in_flags(bundle, hosts, tmp_path, capsys, argv,
                                                 message, code):
    import re

    dest, _ = hosts
    (tmp_path / "HOSTFILE").write_text("t1\nt2:x\n")
    argv = [str(tmp_path / a) if a == "HOSTFILE" else a for a in argv]
    assert cli(["deploy", str(bundle), *argv, "--dest", str(dest), "--rsh", RSH]) == code
    err = capsys.readouterr().err
    assert err.startswith("tvm-distx: error: ") and err.count("\n") == 2, err
    assert re.search(message.replace("HOSTFILE", re.escape(str(tmp_path / "HOSTFILE"))),
                     err[len("tvm-distx: error: "):]), err
    assert "=[" not in err.split("hint:")[1]  # the hint in flags, not Python


def test_a_real_process_needs_dest_and_exits_2_without_a_traceback(bundle):
    done = subprocess.run([sys.executable, "-m", "tvm_distx", "deploy", str(bundle),
                           "--hosts", "t1"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "deploy needs --dest DIR" in done.stderr
