"""Deploying a bundle to hosts: each host its ranks' files, checked there, and checked again
before a launch.

The hosts here are directories behind a fake remote shell (tests/fake_rsh.py): each sees its
own directory at the one deploy path, in a private mount namespace, as real hosts would.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from pathlib import Path
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import tvm_distx as td
from tvm_distx import ShardingRule
from tvm_distx.sources.checkpoint import open_checkpoint
from tvm_distx.bundle.manifest import check_weights, read_manifest, sha256_file
from tvm_distx.errors import ArgumentError, DeployError, LaunchError
from tvm_distx.hosts import bundle_sha256, check_deployed, deploy, place_ranks, split
from tvm_distx.passes import AnnotateSharding

from locations import TESTS_DIR

FAKE_RSH = (sys.executable, str(TESTS_DIR / "fake_rsh.py"))


@pytest.fixture(scope="module")
def exe():
    mod = td.load_module(TESTS_DIR / "data" / "seed_tensor_parallel.py")
    rules = [ShardingRule(param="A", result="S[1]", function="mlp"),
             ShardingRule(param="B", result="S[0]", function="mlp")]
    return td.compile(AnnotateSharding(rules)(mod), target="x86")


@pytest.fixture(scope="module")
def weights():
    rng = np.random.default_rng(3)
    return {n: (0.1 * rng.standard_normal((128, 128))).astype("float32") for n in "AB"}


@pytest.fixture(scope="module")
def bundle(exe, weights, tmp_path_factory):
    return exe.export(tmp_path_factory.mktemp("stored") / "bundle", params=weights)


@pytest.fixture
def hosts(tmp_path, monkeypatch):
    """Hosts t1, t2 behind the fake remote shell; returns (dest, each host's view of dest)."""
    for host in ("t1", "t2"):
        (tmp_path / "hosts" / host).mkdir(parents=True)
    dest = tmp_path / "dest"
    monkeypatch.setenv("FAKE_RSH_HOSTS", str(tmp_path / "hosts"))
    monkeypatch.setenv("FAKE_RSH_DEST", str(dest))
    return dest, {h: tmp_path / "hosts" / h / "dest" for h in ("t1", "t2")}


def _files(directory: Path) -> set[str]:
    return {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()}


def _assert_holds_only(copy: Path, source: Path, ranks, host: str) -> None:
    """``copy`` has the library, its program files, manifest, run.sh and exactly ``ranks``'
    weight files, whole."""
    manifest = read_manifest(copy)
    files = sorted({w.file for w in manifest.weight_files if w.rank in ranks})
    assert manifest.program_files == ("plan.json", "board_runtime.so")
    assert _files(copy) == {"manifest.json", "lib.so", "run.sh", "deployment.json",
                            *manifest.program_files, *files}
    for w in manifest.weight_files:
        if w.rank in ranks:
            assert sha256_file(copy / w.file) == w.sha256
    assert sha256_file(copy / "lib.so") == manifest.raw["library_sha256"]
    record = json.loads((copy / "deployment.json").read_text())
    assert {k: record[k] for k in ("format", "version", "host", "ranks", "bundle")} == {
        "format": "tvm-distx-deployment", "version": 1, "host": host, "ranks": list(ranks),
        "bundle": hashlib.sha256((source / "manifest.json").read_bytes()).hexdigest()}
    check_weights(manifest, ranks)


def test_split_writes_each_host_only_its_ranks_files(bundle, tmp_path):
    reports = split(bundle, place_ranks("t1,t2", 2), tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["t1", "t2"]
    for host, rank in (("t1", 0), ("t2", 1)):
        copy = tmp_path / "out" / host
        _assert_holds_only(copy, bundle, [rank], host)
        assert (copy / "manifest.json").read_bytes() == (bundle / "manifest.json").read_bytes()
        assert (copy / f"weights/rank{rank}.safetensors").read_bytes() == \
            (bundle / f"weights/rank{rank}.safetensors").read_bytes()
        assert reports[host].ranks == (rank,) and reports[host].files == 6
    one = split(bundle, place_ranks("t1:2", 2), tmp_path / "one")
    _assert_holds_only(tmp_path / "one" / "t1", bundle, [0, 1], "t1")
    assert one["t1"].ranks == (0, 1)


def test_deploy_streams_each_host_its_copy_and_check_deployed_accepts_it(bundle, hosts):
    dest, seen = hosts
    placement = place_ranks("t1,t2", 2)
    reports = deploy(bundle, placement, dest, rsh=FAKE_RSH)
    assert list(reports) == ["t1", "t2"] and reports["t2"].ranks == (1,)
    assert reports["t1"].files == 6 and reports["t1"].bytes > 0
    assert not dest.exists() or not any(dest.iterdir())  # nothing here: all on the hosts
    for host, rank in (("t1", 0), ("t2", 1)):
        _assert_holds_only(seen[host], bundle, [rank], host)
    check_deployed(bundle, placement, dest, rsh=FAKE_RSH)
    check_deployed(read_manifest(bundle), placement, dest, rsh=FAKE_RSH)
    # deploying again with another placement replaces the weights, not adds to them
    deploy(bundle, place_ranks("t2:2", 2), dest, rsh=FAKE_RSH)
    _assert_holds_only(seen["t2"], bundle, [0, 1], "t2")


def test_the_remote_shell_comes_from_the_environment(bundle, hosts, monkeypatch):
    dest, seen = hosts
    monkeypatch.setenv("TVM_DISTX_RSH", " ".join(FAKE_RSH))
    deploy(bundle, place_ranks("t1:2", 2), dest)
    _assert_holds_only(seen["t1"], bundle, [0, 1], "t1")


def _hint_and_cli(err: DeployError) -> tuple[str, str]:
    return err.hint or "", err.for_cli()


def test_check_deployed_names_the_host_and_the_file_of_each_fault(exe, weights, bundle, hosts,
                                                                 tmp_path):
    dest, seen = hosts
    placement = place_ranks("t1,t2", 2)
    # nothing deployed yet
    with pytest.raises(DeployError, match=f"^\\[deploy\\] host t1: {dest}/deployment.json is "
                       "missing|host t1: .* is missing: nothing was deployed") as caught:
        check_deployed(bundle, placement, dest, rsh=FAKE_RSH)
    err = caught.value
    assert isinstance(err, LaunchError) and err.host == "t1"
    assert str(err).count("\n") == 1  # one line, then the hint
    assert "tvm_distx.hosts.deploy(" in err.hint
    assert f"tvm-distx deploy {bundle} --hosts t1:1,t2:1 --dest {dest}" in err.for_cli()
    deploy(bundle, placement, dest, rsh=FAKE_RSH)
    # a weight file gone
    (seen["t2"] / "weights/rank1.safetensors").unlink()
    with pytest.raises(DeployError, match=f"^\\[deploy\\] host t2: {dest}/weights/"
                       "rank1.safetensors is missing\nhint: deploy the bundle again") as caught:
        check_deployed(bundle, placement, dest, rsh=FAKE_RSH)
    assert caught.value.file == f"{dest}/weights/rank1.safetensors"
    # a truncated library
    deploy(bundle, placement, dest, rsh=FAKE_RSH)
    with open(seen["t1"] / "lib.so", "r+b") as f:
        f.truncate(100)
    with pytest.raises(DeployError, match=f"host t1: {dest}/lib.so has 100 bytes, the deployed"):
        check_deployed(bundle, placement, dest, rsh=FAKE_RSH)
    # the hosts' copies hold other ranks than the placement gives them
    deploy(bundle, placement, dest, rsh=FAKE_RSH)
    with pytest.raises(DeployError, match=f"host t1: {dest}/deployment.json records ranks 0, "
                       "but the hosts give this host ranks 0,1"):
        check_deployed(bundle, place_ranks("t1:2", 2), dest, rsh=FAKE_RSH)
    with pytest.raises(DeployError, match="host t2: .*records ranks 1, but the hosts give this "
                       "host ranks 0"):
        check_deployed(bundle, place_ranks("t2,t1", 2), dest, rsh=FAKE_RSH)
    # t1's copy in t2's directory (a deploy directory that two hosts share)
    (seen["t2"] / "deployment.json").write_text((seen["t1"] / "deployment.json").read_text())
    with pytest.raises(DeployError, match="host t2: .*records ranks 0 \\(deployed for host t1\\), "
                       "but the hosts give this host ranks 1"):
        check_deployed(bundle, placement, dest, rsh=FAKE_RSH)
    # another bundle's files
    other = exe.export(tmp_path / "other", params={k: v + 1 for k, v in weights.items()})
    with pytest.raises(DeployError, match=f"host t1: {dest} holds another bundle "
                       f"\\({dest}/deployment.json records bundle {bundle_sha256(bundle)[:12]}, "
                       f"this one is {bundle_sha256(other)[:12]}\\)"):
        check_deployed(other, placement, dest, rsh=FAKE_RSH)
    # a host that is not there
    with pytest.raises(DeployError, match="^\\[deploy\\] host t3 does not answer: ssh: Could not "
                       "resolve hostname t3") as caught:
        check_deployed(bundle, place_ranks("t1,t3", 2), dest, rsh=FAKE_RSH)
    assert caught.value.host == "t3" and "--rsh" in caught.value.for_cli()


def test_a_deploy_to_a_missing_host_or_with_wrong_slots_is_refused(bundle, hosts):
    dest, seen = hosts
    with pytest.raises(DeployError, match="host t9 does not answer: ssh: Could not resolve"):
        deploy(bundle, place_ranks("t1,t9", 2), dest, rsh=FAKE_RSH)
    with pytest.raises(ArgumentError, match="the hosts have 3 slots \\(t1:2, t2:1\\), more than "
                       "the 2 ranks"):
        deploy(bundle, place_ranks("t1:2,t2", 3), dest, rsh=FAKE_RSH)
    with pytest.raises(ArgumentError, match="'relative/dir' is not an absolute path"):
        deploy(bundle, place_ranks("t1:2", 2), "relative/dir", rsh=FAKE_RSH)


def test_a_copy_that_differs_from_its_manifest_fails_on_the_host(bundle, hosts, tmp_path,
                                                                 monkeypatch):
    deploying = importlib.import_module("tvm_distx.hosts.deploy")  # (the package's deploy is
    # the function)
    dest, seen = hosts
    original = deploying._file_member

    def damaged(root, name, mode=0o644):  # the bytes change on their way to the host
        member = original(root, name, mode)
        if name.startswith("weights/"):
            chunks = member.chunks
            member.chunks = lambda: (c[:-1] + bytes([c[-1] ^ 1]) if i == 0 else c
                                     for i, c in enumerate(chunks()))
        return member

    monkeypatch.setattr(deploying, "_file_member", damaged)
    with pytest.raises(DeployError, match=f"host t1: weight '.' of rank 0 \\({dest}/weights/"
                       "rank0.safetensors\\) does not match its sha256"):
        deploy(bundle, place_ranks("t1,t2", 2), dest, rsh=FAKE_RSH)
    assert not (seen["t1"] / "deployment.json").exists()  # no record for a bad copy


# ------------------------------------------------------------------ linked checkpoints
@pytest.fixture(scope="module")
def linked(exe, weights, tmp_path_factory):
    """A bundle whose A is linked to a checkpoint and whose B is stored in rank files."""
    directory = tmp_path_factory.mktemp("linked")
    save_file({"A": weights["A"]}, directory / "model.safetensors")
    params = {"A": open_checkpoint(directory)["A"], "B": weights["B"]}
    bundle = exe.export(directory / "bundle", params=params, link_checkpoint=True)
    manifest = read_manifest(bundle)
    assert {(link.rank, link.name) for link in manifest.weight_links} == {(0, "A"), (1, "A")}
    assert {(w.rank, w.name) for w in manifest.weight_files} == {(0, "B"), (1, "B")}
    return bundle


def test_linked_blocks_are_copied_into_each_hosts_rank_files(linked, weights, hosts, tmp_path):
    dest, seen = hosts
    placement = place_ranks("t1,t2", 2)
    deploy(linked, placement, dest, rsh=FAKE_RSH)
    split(linked, placement, tmp_path / "out")
    source = read_manifest(linked)
    for host, rank in (("t1", 0), ("t2", 1)):
        for copy in (seen[host], tmp_path / "out" / host):
            _assert_holds_only(copy, linked, [rank], host)
            manifest = read_manifest(copy)
            # this host's ranks: no link left, one file with the block and the stored shard
            assert {(link.rank, link.name) for link in manifest.weight_links} == {(1 - rank, "A")}
            assert {(w.rank, w.name) for w in manifest.weight_files} == {
                (rank, "A"), (rank, "B"), (1 - rank, "B")}
            stored = load_file(copy / f"weights/rank{rank}.safetensors")
            half = slice(64 * rank, 64 * rank + 64)
            np.testing.assert_array_equal(stored["A"], weights["A"][:, half])
            np.testing.assert_array_equal(stored["B"], weights["B"][half, :])
            assert sha256_file(copy / f"weights/rank{rank}.safetensors") == \
                next(w.sha256 for w in manifest.weight_files if w.rank == rank)
            # the other rank's entries are the source's own
            assert [w for w in manifest.weight_files if w.rank != rank] == [
                w for w in source.weight_files if w.rank != rank]
        assert (seen[host] / "manifest.json").read_bytes() == \
            (tmp_path / "out" / host / "manifest.json").read_bytes()
    check_deployed(linked, placement, dest, rsh=FAKE_RSH)


def test_a_shared_checkpoint_keeps_its_links(linked, tmp_path):
    split(linked, place_ranks("t1,t2", 2), tmp_path / "out", shared_fs=True)
    copy = tmp_path / "out" / "t1"
    assert (copy / "manifest.json").read_bytes() == (linked / "manifest.json").read_bytes()
    assert _files(copy) == {"manifest.json", "lib.so", "run.sh", "deployment.json",
                            "plan.json", "board_runtime.so", "weights/rank0.safetensors"}
