"""MPI sessions across the test hosts: the same numbers as on one host, each host only its
ranks' files, and every fault named by host and rank within 30 s, leaving nothing behind.

The hosts are the session's three test hosts (``test_hosts``, tests/testhosts.py): network,
UTS, mount, IPC and PID namespaces on this machine, reached with their ssh-like remote shell.
The program is the seed tensor-parallel MLP (tests/data/seed_tensor_parallel.py) on 2 ranks
and, on a (4,) mesh, on 4 ranks. Its bundles are exported once per module into the directory
every host sees (``test_hosts.shared``), so each of the three ways a bundle reaches the
hosts (``deploy`` then ``dest=``, the session's own copy, ``shared_fs=True``) can use them.
"""

from __future__ import annotations

import hashlib
import re
import shlex
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

import tvm_distx as td
from tvm_distx import ShardingRule
from tvm_distx.bundle.footprint import rank_bytes
from tvm_distx.bundle.manifest import read_manifest
from tvm_distx.errors import ArgumentError, DeployError, HostMemoryError, LaunchError
from tvm_distx.hosts import deploy, place_ranks
from tvm_distx.layout.mesh import set_device_meshes
from tvm_distx.passes import AnnotateSharding
from tvm_distx.runtime import control
from tvm_distx.hosts.memory import format_size
from tvm_distx.runtime.memory import RANK_RUNTIME_BYTES
from tvm_distx.runtime.mpi import MPISession

from locations import TESTS_DIR
from testhosts import hosts_up

#: Seconds of silence after which the faster fault tests give a rank up (default 10).
QUICK_LOST = "4"


# ------------------------------------------------------------------ the program and bundles
def _seed(ranks: int):
    mod = td.load_module(TESTS_DIR / "data" / "seed_tensor_parallel.py")
    if ranks != 2:
        mod = set_device_meshes(mod, [(ranks,)])
    rules = [ShardingRule(param="A", result="S[1]", function="mlp"),
             ShardingRule(param="B", result="S[0]", function="mlp"),
             ShardingRule(callee="mlp", args={0: "R"}, function="main")]
    return td.compile(AnnotateSharding(rules)(mod))


def _mlp_twice(x, weights):
    def mlp(v):
        return np.maximum(v @ weights["A"], 0) @ weights["B"]

    return mlp(mlp(x))


@pytest.fixture(scope="module")
def weights():
    rng = np.random.default_rng(30)
    return {name: 0.1 * rng.standard_normal((128, 128), dtype="float32") for name in "AB"}


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(31)
    return [rng.standard_normal((128, 128), dtype="float32") for _ in range(2)]


@pytest.fixture(scope="module")
def exes():
    """The seed program compiled for 2 and for 4 ranks."""
    return {n: _seed(n) for n in (2, 4)}


@pytest.fixture(scope="module")
def bundles(test_hosts, exes, weights):
    """{2: bundle, 4: bundle} in the directory every host sees; removed at the end."""
    where = Path(tempfile.mkdtemp(prefix="seed-", dir=test_hosts.shared))
    try:
        found = {n: exe.export(where / f"seed{n}", params=weights) for n, exe in exes.items()}
        assert {n: read_manifest(b).num_ranks for n, b in found.items()} == {2: 2, 4: 4}
        yield found
    finally:
        shutil.rmtree(where, ignore_errors=True)


@pytest.fixture(scope="module")
def on_one_host(bundles, inputs, weights):
    """Each bundle's results for ``inputs``, from a session on this machine alone (= numpy's)."""
    results = {}
    for n, bundle in bundles.items():
        with MPISession(bundle) as session:
            results[n] = [session.run(x) for x in inputs]
        for x, got in zip(inputs, results[n]):
            np.testing.assert_allclose(got, _mlp_twice(x, weights), rtol=1e-4, atol=1e-4)
    return results


# ------------------------------------------------------------------ checks
def _first_line(err: Exception) -> str:
    return str(err).splitlines()[0]


def _after(fault, session: MPISession, inputs) -> tuple[LaunchError, float]:
    """Call ``session``, then ``fault()``, then call again: the error, and seconds to it."""
    session.run(inputs[0])
    fault()
    started = time.monotonic()
    with pytest.raises(LaunchError) as caught:
        session.run(inputs[1])
    return caught.value, time.monotonic() - started


def _files_on(test_hosts, host: str, dest: str) -> dict[str, str]:
    """The files under ``dest`` on ``host`` (relative path -> sha256, computed there)."""
    done = test_hosts.run(host, f"cd {shlex.quote(dest)} && find . -type f -print0 | "
                                "xargs -0 sha256sum")
    return {path.removeprefix("./"): sha for sha, path in
            (line.split(None, 1) for line in done.stdout.splitlines())}


def _assert_only_its_ranks(test_hosts, bundle: Path, placement, dest: str) -> None:
    """Each host's copy holds its ranks' weight files, byte for byte the manifest's, and no
    other rank's; the manifest and the library are the bundle's."""
    manifest = read_manifest(bundle)
    for host, ranks in placement.by_host.items():
        files = _files_on(test_hosts, host, dest)
        weights = {k: v for k, v in files.items() if k.startswith("weights/")}
        assert weights == {w.file: w.sha256 for w in manifest.weight_files if w.rank in ranks}
        assert {w.rank for w in manifest.weight_files if w.file in weights} == set(ranks)
        others = {w.file for w in manifest.weight_files if w.rank not in ranks}
        assert others and not others & set(files)
        for name in ("manifest.json", manifest.library):
            assert files[name] == hashlib.sha256((bundle / name).read_bytes()).hexdigest()
        assert "deployment.json" in files


# ------------------------------------------------------------------ the same results
def test_deployed_first_each_host_holds_only_its_ranks_and_results_equal_one_host(
        test_hosts, bundles, inputs, on_one_host, nothing_left):
    """deploy() to each host's own deploy root, then a session with dest=, 2 ranks on 2 hosts.
    (4 ranks on 3 hosts: the session's own copy, below.)"""
    t1, t2, _ = test_hosts.names
    dest = f"{test_hosts.deploy_root}/seed2"
    placement = place_ranks([t1, t2], 2)
    try:
        reports = deploy(bundles[2], placement, dest, rsh=test_hosts.rsh)
        assert {h: r.ranks for h, r in reports.items()} == {t1: (0,), t2: (1,)}
        _assert_only_its_ranks(test_hosts, bundles[2], placement, dest)
        with MPISession(bundles[2], hosts=[t1, t2], rsh=test_hosts.rsh, dest=dest) as session:
            assert [(r.rank, r.host) for r in session.ranks] == [(0, t1), (1, t2)]
            for x, want in zip(inputs, on_one_host[2]):
                np.testing.assert_allclose(session.run(x), want, rtol=1e-5, atol=1e-5)
    finally:
        for host in (t1, t2):
            test_hosts.run(host, ["rm", "-rf", dest])


def test_a_session_deploys_each_host_its_share_and_removes_it(
        test_hosts, bundles, inputs, on_one_host, nothing_left, tmp_path):
    """Neither dest= nor shared_fs=: the session copies each host its ranks' files, and they
    are gone from every host when it closes. Rank 0 is on the second host."""
    t1, t2, t3 = test_hosts.names
    hostfile = test_hosts.hostfile(tmp_path / "hosts.txt", [2, 1, 1], [t2, t1, t3])
    with MPISession(bundles[4], hostfile=hostfile, rsh=test_hosts.rsh) as session:
        assert [r.host for r in session.ranks] == [t2, t2, t1, t3]
        copies = f"/tmp/{session._tag}"
        _assert_only_its_ranks(test_hosts, bundles[4], session.placement, copies)
        for x, want in zip(inputs, on_one_host[4]):
            np.testing.assert_allclose(session.run(x), want, rtol=1e-5, atol=1e-5)
    for host in (t1, t2, t3):
        assert test_hosts.run(host, ["test", "-e", copies], check=False).returncode == 1


def test_a_bundle_on_a_filesystem_every_host_shares_is_not_copied(
        test_hosts, bundles, inputs, on_one_host, nothing_left):
    t1, t2, t3 = test_hosts.names
    with MPISession(bundles[2], hosts=f"{t3},{t1}", rsh=test_hosts.rsh,
                    shared_fs=True) as session:
        assert [r.host for r in session.ranks] == [t3, t1]
        for host in (t3, t1):  # nothing deployed: the ranks read the shared bundle
            assert not [c for c in test_hosts.run(host, "ls /tmp").stdout.split()
                        if c.startswith("tvm-distx-session-")]
        for x, want in zip(inputs, on_one_host[2]):
            np.testing.assert_allclose(session.run(x), want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ faults
def test_a_host_whose_link_goes_down_is_named_within_30_s(
        test_hosts, bundles, inputs, nothing_left):
    """At the default LOST (10 s): the silent rank, and its host, are named."""
    t1, t2, _ = test_hosts.names
    assert control.LOST == 10
    session = MPISession(bundles[2], hosts=[t1, t2], rsh=test_hosts.rsh)
    try:
        err, elapsed = _after(lambda: test_hosts.link(t2, False), session, inputs)
    finally:
        test_hosts.link(t2, True)
        session.close()
    assert elapsed < 30, f"{elapsed:.1f} s"
    assert (err.reason, err.rank, err.host) == ("lost", 1, t2)
    # the silence as measured: LOST, and up to one heartbeat more
    assert re.fullmatch(f"\\[launch\\] lost rank 1 on {t2}: nothing heard from it for 1[01] s "
                        "running 'main' \\(its host or the network to it is down\\)",
                        _first_line(err)), _first_line(err)


def test_a_hosts_ranks_killed_between_calls_are_named(
        test_hosts, bundles, inputs, nothing_left, tmp_path):
    """4 ranks on 3 hosts (the bundle shared): every process of the third host is killed (its
    rank and hydra's proxy)."""
    t1, t2, t3 = test_hosts.names
    hostfile = test_hosts.hostfile(tmp_path / "hosts.txt", [2, 1, 1])
    session = MPISession(bundles[4], hostfile=hostfile, rsh=test_hosts.rsh, shared_fs=True)
    try:
        err, elapsed = _after(lambda: test_hosts.kill(t3), session, inputs)
    finally:
        session.close()
    assert elapsed < 30, f"{elapsed:.1f} s"
    assert (err.reason, err.rank, err.host) == ("killed", 3, t3)
    # the host's proxy, which would report the rank's exit status, was killed with it
    assert re.fullmatch(f"\\[launch\\] rank 3 on {t3} \\(pid \\d+\\) died without reporting "
                        "an error \\(killed, or it exited early\\) running 'main'",
                        _first_line(err)), _first_line(err)


def test_a_host_that_is_not_up_at_launch_is_named(test_hosts, bundles, nothing_left, tmp_path):
    t1 = test_hosts.names[0]
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text(f"{t1}\nt9\n")
    started = time.monotonic()
    with pytest.raises(LaunchError) as caught:
        MPISession(bundles[2], hostfile=hostfile, rsh=test_hosts.rsh)
    assert time.monotonic() - started < 30
    err = caught.value
    assert (err.reason, err.host) == ("unreachable", "t9")
    assert _first_line(err).startswith("[deploy] host t9 does not answer: ssh: Could not resolve "
                                       "hostname t9"), _first_line(err)


@pytest.mark.parametrize("needs_link", [True, False], ids=["rsh-fails", "mpi-fails"])
def test_a_host_whose_link_is_down_at_launch_is_named(
        test_hosts, bundles, nothing_left, monkeypatch, needs_link):
    """With ssh's behaviour the remote shell cannot reach it; with the test hosts' own (it
    still can), its MPI proxy cannot reach this machine."""
    t1, t2, _ = test_hosts.names
    if needs_link:
        monkeypatch.setenv("TESTHOSTS_RSH_NEEDS_LINK", "1")
    test_hosts.link(t1, False)
    started = time.monotonic()
    try:
        with pytest.raises(LaunchError) as caught:
            MPISession(bundles[2], hosts=[t2, t1], rsh=test_hosts.rsh)
    finally:
        test_hosts.link(t1, True)
    assert time.monotonic() - started < 30
    err = caught.value
    assert (err.reason, err.host) == ("unreachable", t1)
    if needs_link:
        assert _first_line(err) == (f"[deploy] host {t1} does not answer: ssh: connect to host "
                                    f"{t1} port 22: No route to host"), _first_line(err)
    else:
        assert _first_line(err).startswith(f"[launch] host {t1} failed starting: unable to "
                                           f"connect from \"{t1}\" to \"{test_hosts.caller}\""), \
            _first_line(err)


@pytest.mark.parametrize("slots,message", [
    ([2, 1], "the hosts have 3 slots \\(H1:2, H2:1\\), more than the 2 ranks of the bundle"),
    ([1], "the hosts have 1 slots \\(H1:1\\), fewer than the 2 ranks of the bundle"),
], ids=["more", "fewer"])
def test_slots_that_differ_from_the_ranks_are_refused_before_anything_starts(
        test_hosts, bundles, nothing_left, tmp_path, slots, message):
    names = test_hosts.names[:len(slots)]
    hostfile = test_hosts.hostfile(tmp_path / "hosts.txt", slots, names)
    for i, name in enumerate(names):
        message = message.replace(f"H{i + 1}", name)
    with pytest.raises(ArgumentError, match=message):
        MPISession(bundles[2], hostfile=hostfile, rsh=test_hosts.rsh)


def test_a_deployed_copy_missing_a_file_or_of_another_bundle_is_refused(
        test_hosts, exes, bundles, weights, nothing_left, tmp_path):
    t1, t2, _ = test_hosts.names
    dest = f"{test_hosts.deploy_root}/faulty"
    placement = place_ranks([t1, t2], 2)
    try:
        deploy(bundles[2], placement, dest, rsh=test_hosts.rsh)
        test_hosts.run(t2, ["rm", f"{dest}/weights/rank1.safetensors"])
        started = time.monotonic()
        with pytest.raises(DeployError) as caught:
            MPISession(bundles[2], hosts=[t1, t2], rsh=test_hosts.rsh, dest=dest)
        assert time.monotonic() - started < 30
        err = caught.value
        assert (err.reason, err.host, err.file) == ("files", t2,
                                                    f"{dest}/weights/rank1.safetensors")
        assert _first_line(err) == f"[deploy] host {t2}: {dest}/weights/rank1.safetensors is " \
                                   "missing"
        # the same program with other weights, where the first one is deployed
        other = exes[2].export(tmp_path / "other", params={k: v + 1 for k, v in weights.items()})
        deploy(bundles[2], placement, dest, rsh=test_hosts.rsh)
        with pytest.raises(DeployError) as caught:
            MPISession(other, hosts=[t1, t2], rsh=test_hosts.rsh, dest=dest)
        err = caught.value
        assert (err.reason, err.host, err.file) == ("files", t1, f"{dest}/deployment.json")
        assert _first_line(err).startswith(f"[deploy] host {t1}: {dest} holds another bundle")
    finally:
        for host in (t1, t2):
            test_hosts.run(host, ["rm", "-rf", dest])


def test_ranks_cut_off_from_the_caller_end_by_themselves(
        test_hosts, bundles, inputs, nothing_left, monkeypatch):
    """With ssh's behaviour (the remote shell needs the link) the clean-up cannot reach a host
    whose link is down: its ranks notice the silence and exit by themselves, and so does
    hydra's proxy there. LOST is 4 s here, on both sides."""
    t1, t2, _ = test_hosts.names
    monkeypatch.setattr(control, "LOST", float(QUICK_LOST))
    monkeypatch.setenv("TESTHOSTS_RSH_NEEDS_LINK", "1")
    session = MPISession(bundles[2], hosts=[t1, t2], rsh=test_hosts.rsh, shared_fs=True,
                         env={"TVM_DISTX_LOST_AFTER": QUICK_LOST})
    try:
        err, elapsed = _after(lambda: test_hosts.link(t2, False), session, inputs)
        assert (err.reason, err.rank, err.host) == ("lost", 1, t2)
        assert elapsed < 15, f"{elapsed:.1f} s"
        time.sleep(2 * float(QUICK_LOST))  # the ranks' own timer, and their exit
        left = [c for _, c in test_hosts.processes(t2) if "tvm_distx" in c or "hydra" in c]
    finally:
        test_hosts.link(t2, True)
        session.close()
    assert left == []


def test_a_rank_the_kernel_kills_for_memory_is_named_with_its_host_within_30_s(bundles, tmp_path):
    """A host of 80 MiB (``testhosts up --mem``) whose hostfile line claims 8 GiB: the check
    before the launch believes the line, and the kernel kills one of its two ranks as they
    load TVM's runtime (about 60 MiB of their own memory each)."""
    with hosts_up(1, mem="80M") as small:
        host = small.names[0]
        hostfile = tmp_path / "hosts.txt"
        hostfile.write_text(f"{host}:2 mem=8G   # more than it has\n")
        started = time.monotonic()
        with pytest.raises(HostMemoryError) as caught:
            MPISession(bundles[2], hostfile=hostfile, rsh=small.rsh, timeout=60)
        took = time.monotonic() - started
    err = caught.value
    assert re.fullmatch(rf"(rank [01]|a rank) on host {host} was killed by the kernel: out of "
                        r"memory \(limit 80 MiB\)", _first_line(err).removeprefix(
                            "[host-memory] ")), str(err)
    assert (err.reason, err.host) == ("oom", host)
    assert "EXIT CODE: 9" in err.details  # mpiexec's report, for --verbose
    assert err.for_cli().splitlines()[-1] == (
        "hint: cut the model into more pipeline stages (--stages), spread the ranks over more "
        "hosts (--hostfile), or use a smaller format (--quantization q8 or q4)")
    assert took < 30


def test_a_host_whose_mem_is_too_small_is_refused_before_anything_starts(
        test_hosts, bundles, tmp_path):
    t1, t2, _ = test_hosts.names
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text(f"{t1} slots=1\n{t2} slots=1 mem=100M\n")
    before = {h: test_hosts.processes(h) for h in (t1, t2)}
    with pytest.raises(HostMemoryError) as caught:
        MPISession(bundles[2], hostfile=hostfile, rsh=test_hosts.rsh)
    rank = rank_bytes(bundles[2])[1]
    assert rank.weights == 2 * 64 * 128 * 4 and rank.cache == 0  # half of A and of B
    assert rank.activations == 2 * 2 * 128 * 128 * 4  # x and the result, twice
    need = rank.total + RANK_RUNTIME_BYTES
    assert caught.value.message == (
        f"host {t2} needs {format_size(need)} for rank 1 (weights 64 KiB, activations 256 KiB, "
        f"runtime {format_size(RANK_RUNTIME_BYTES)}), but has 100 MiB (mem= of its hostfile "
        "line)")
    assert (caught.value.needed, caught.value.available) == (need, 100 << 20)
    assert {h: test_hosts.processes(h) for h in (t1, t2)} == before  # nothing started, copied
