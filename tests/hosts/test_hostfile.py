"""Hostfiles, --hosts lists and the placement of ranks on hosts; the remote shell's argv."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tvm_distx.errors import (ArgumentError, ArgumentIndexError, ArgumentKeyError, DeployError,
                              LaunchError)
from tvm_distx.hosts import (Host, RankPlacement, hosts_from, parse_hosts, place_ranks,
                             read_hostfile, remote_argv, remote_shell, run_on_hosts)
from tvm_distx.hosts.rsh import connect_options

from locations import TESTS_DIR

FAKE_RSH = (sys.executable, str(TESTS_DIR / "fake_rsh.py"))


def test_a_hostfile_has_hosts_slots_comments_and_blank_lines(tmp_path):
    path = tmp_path / "hosts.txt"
    path.write_text("# the cluster\n\nnode0:2   # two ranks\n  node1\n\t# off: node9\n"
                    "10.0.0.7:3\n")
    assert read_hostfile(path) == (Host("node0", 2), Host("node1", 1), Host("10.0.0.7", 3))


def test_a_hostfile_line_may_give_the_hosts_memory_in_mpich_or_open_mpis_form(tmp_path):
    path = tmp_path / "hosts.txt"
    path.write_text("node0:2 mem=800M   # MPICH's form\nnode1 slots=3 MEM=16g\n"
                    "node2 mem=1.5G\nnode3 slots=1\nnode4 mem=4096\nnode5 mem=2Ti\n")
    assert read_hostfile(path) == (
        Host("node0", 2, 800 << 20), Host("node1", 3, 16 << 30), Host("node2", 1, 3 << 29),
        Host("node3", 1), Host("node4", 1, 4096), Host("node5", 1, 2 << 40))
    # the one-line form (--hosts) takes the same entries
    assert parse_hosts("node0:2 mem=800M, node1 slots=3 mem=16G,node3") == (
        Host("node0", 2, 800 << 20), Host("node1", 3, 16 << 30), Host("node3", 1))
    assert parse_hosts(["a:2 mem=1k", "a mem=1K"]) == (Host("a", 3, 1024),)  # one host, merged
    # mpiexec is given the slots alone; a host shows its memory
    placement = place_ranks(read_hostfile(path), 9)
    assert placement.mpiexec_hosts() == "node0:2,node1:3,node2:1,node3:1,node4:1,node5:1"
    assert [h.describe() for h in placement.hosts[:3]] == [
        "node0:2 mem=800 MiB", "node1:3 mem=16 GiB", "node2:1 mem=1.5 GiB"]


def test_a_bad_memory_size_in_hosts_is_refused_in_one_line_naming_the_entry():
    with pytest.raises(ArgumentError) as caught:
        parse_hosts("a:2 mem=lots,b")
    assert caught.value.for_cli() == (
        "[argument] host 0: 'a:2 mem=lots': mem=lots is not a memory size\n"
        "hint: write bytes, or a number with K, M, G or T (binary units): mem=800M, mem=16G")
    with pytest.raises(ArgumentError, match="mem is a positive number of bytes, got -1"):
        Host("a", 1, -1)


def test_a_host_on_consecutive_lines_is_one_host_with_all_their_slots(tmp_path):
    path = tmp_path / "hosts.txt"
    path.write_text("a\na:2\nb\n")
    assert read_hostfile(path) == (Host("a", 3), Host("b", 1))
    assert parse_hosts("a,a,b") == (Host("a", 2), Host("b", 1))


@pytest.mark.parametrize("text, line, message", [
    ("a\nb:x\n", 2, "'b:x': the slots after ':' are not a number"),
    ("a\n\nb:0\n", 3, "'b:0': host b has 0 slots"),
    ("a slots=x\n", 1, "'a slots=x': slots=x is not a number"),
    ("a:2 slots=2\n", 1, "'a:2 slots=2': gives the slots twice"),
    ("a max_slots=2\n", 1, "'a max_slots=2': 'max_slots=2' is neither slots=N nor mem=SIZE"),
    ("a\nb:2 mem=12X\n", 2, "'b:2 mem=12X': mem=12X is not a memory size"),
    ("a slots=2 mem=0\n", 1, "'a slots=2 mem=0': mem=0 is not a memory size"),
    ("a mem=1G mem=2G\n", 1, "'a mem=1G mem=2G': gives mem= twice"),
    ("a mem=1G\na mem=2G\n", 2, "host a is given two memories \\(1 GiB, 2 GiB\\)"),
    ("# c\n-oProxyCommand=x\n", 2, "'-oProxyCommand=x' is not a host name"),
    ("a\nb\na:2\n", 3, "host a is listed again, after other hosts \\(first at .*hosts.txt:1\\)"),
])
def test_a_bad_line_is_named_by_file_line_and_text(tmp_path, text, line, message):
    path = tmp_path / "hosts.txt"
    path.write_text(text)
    with pytest.raises(ArgumentError, match=f"^\\[argument\\] {path}:{line}: {message}"):
        read_hostfile(path)


def test_an_unreadable_or_empty_hostfile_is_refused(tmp_path):
    with pytest.raises(ArgumentError, match="cannot read the hostfile .*missing.txt"):
        read_hostfile(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("# nothing\n\n")
    with pytest.raises(ArgumentError, match="names no host"):
        read_hostfile(tmp_path / "empty.txt")


def test_hosts_as_a_string_a_list_or_hosts(tmp_path):
    want = (Host("a", 2), Host("b", 1))
    assert parse_hosts("a:2,b") == parse_hosts(["a:2", "b"]) == parse_hosts([Host("a", 2), "b"]) \
        == want
    with pytest.raises(ArgumentError, match="empty entry"):
        parse_hosts("a,,b")
    with pytest.raises(ArgumentError, match="host 1: 'b:-1': host b has -1 slots"):
        parse_hosts(["a", "b:-1"])
    with pytest.raises(TypeError):
        parse_hosts(3)
    (tmp_path / "h").write_text("a:2\nb\n")
    assert hosts_from(hosts="a:2,b") == hosts_from(hostfile=tmp_path / "h") == want
    assert hosts_from() is None
    with pytest.raises(ArgumentError, match="both hosts= and hostfile=") as caught:
        hosts_from(hosts="a", hostfile=tmp_path / "h")
    assert "--hostfile FILE" in caught.value.for_cli()


def test_a_host_is_validated_when_made():
    with pytest.raises(ArgumentError, match="'a b' is not a host name"):
        Host("a b")
    with pytest.raises(ArgumentError, match="host a has 0 slots"):
        Host("a", 0)
    with pytest.raises(TypeError):
        Host("a", 2.0)
    assert str(Host("user@node0", 4)) == "user@node0:4"


def test_ranks_fill_each_hosts_slots_in_order():
    placement = place_ranks("a:2,b,c:3", 6)
    assert placement == RankPlacement((Host("a", 2), Host("b", 1), Host("c", 3)))
    assert placement.by_host == {"a": (0, 1), "b": (2,), "c": (3, 4, 5)}
    assert [placement.host_of(r) for r in range(6)] == ["a", "a", "b", "c", "c", "c"]
    assert placement.ranks_of("c") == (3, 4, 5) and placement.num_ranks == 6
    assert placement.mpiexec_hosts() == "a:2,b:1,c:3"
    assert hash(placement) == hash(place_ranks(["a:2", "b", "c:3"], 6))  # a cache key
    with pytest.raises(ArgumentIndexError, match="rank 6 is not one of the 6 ranks"):
        placement.host_of(6)
    with pytest.raises(ArgumentKeyError, match="host d is not one of a, b, c"):
        placement.ranks_of("d")


@pytest.mark.parametrize("hosts, ranks, message, fix", [
    ("a:2,b:2", 3, "the hosts have 4 slots \\(a:2, b:2\\), more than the 3 ranks",
     "--hosts a:2,b:1"),
    ("a:2,b:2", 6, "the hosts have 4 slots \\(a:2, b:2\\), fewer than the 6 ranks",
     "--hosts a:2,b:4"),
    ("a:4,b", 2, "the hosts have 5 slots", "--hosts a:2 "),
])
def test_slots_that_differ_from_the_rank_count_are_refused_naming_both(hosts, ranks, message,
                                                                       fix):
    with pytest.raises(ArgumentError, match=message) as caught:
        place_ranks(hosts, ranks)
    assert f"give the hosts {ranks} slots in all" in caught.value.hint
    assert "hosts=[" in caught.value.hint
    assert fix in caught.value.for_cli()


# ------------------------------------------------------------------ the remote shell
def test_the_remote_shell_is_the_argument_else_the_environment_else_ssh(monkeypatch):
    monkeypatch.delenv("TVM_DISTX_RSH", raising=False)
    assert remote_shell() == ("ssh",)
    monkeypatch.setenv("TVM_DISTX_RSH", "ssh -p 2222 -o 'User=a b'")
    assert remote_shell() == ("ssh", "-p", "2222", "-o", "User=a b")
    assert remote_shell("/opt/enter") == ("/opt/enter",)
    assert remote_shell(["my rsh", "-x"]) == ("my rsh", "-x")
    with pytest.raises(ArgumentError, match="names no program"):
        remote_shell("")
    with pytest.raises(ArgumentError, match="cannot be split"):
        remote_shell("ssh 'unclosed")


def test_ssh_alone_gets_a_connect_timeout_and_batch_mode():
    assert connect_options(("/usr/bin/ssh", "-p", "22"), 2.5) == (
        "/usr/bin/ssh", "-o", "ConnectTimeout=3", "-o", "BatchMode=yes", "-p", "22")
    assert connect_options(("enter",), 20) == ("enter",)


@pytest.mark.parametrize("argv", [
    ["echo", "plain"],
    ["printf", "%s|", "two words", "it's", 'a "quoted" $HOME `x` \\ ;&|<>*?', "", "-n"],
    ["sh", "-c", 'mkdir -p "$0" && echo "$0"', "/a dir/with 'quote'"],
])
def test_remote_argv_arrives_as_given_through_the_hosts_sh_c(argv):
    command = remote_argv(("ssh",), "node0", argv)
    assert command[:2] == ["ssh", "node0"] and len(command) == 3
    # the host's shell (ssh runs `sh -c COMMAND`) sees each argument as it was given
    printed = remote_argv(("ssh",), "node0", ["printf", "%s\\0", *argv])[2]
    out = subprocess.run(["sh", "-c", printed], capture_output=True, check=True).stdout
    assert out.split(b"\0")[:-1] == [a.encode() for a in argv]


def test_commands_run_on_many_hosts_at_once_and_a_missing_one_is_named(tmp_path, monkeypatch):
    for host in ("t1", "t2"):
        (tmp_path / "hosts" / host).mkdir(parents=True)
    (tmp_path / "hosts" / "slow").mkdir()
    (tmp_path / "hosts" / "slow" / "hang").touch()
    monkeypatch.setenv("FAKE_RSH_HOSTS", str(tmp_path / "hosts"))
    monkeypatch.setenv("FAKE_RSH_DEST", str(tmp_path / "dest"))
    results = run_on_hosts({"t1": ["sh", "-c", 'echo "$0" > "$1"; cat "$1"', "one",
                                   str(tmp_path / "dest" / "f")],
                            "t2": ["sh", "-c", "echo oops >&2; exit 3"],
                            "t3": ["true"], "slow": ["true"]}, rsh=FAKE_RSH, timeout=1.5)
    assert list(results) == ["t1", "t2", "t3", "slow"]
    assert (results["t1"].returncode, results["t1"].stdout) == (0, "one\n")
    assert (tmp_path / "hosts" / "t1" / "dest" / "f").read_text() == "one\n"  # t1's own dest
    assert results["t2"].answered and results["t2"].returncode == 3
    assert results["t2"].last_error_line == "oops"
    assert not results["t3"].answered and results["t3"].returncode == 255
    with pytest.raises(DeployError, match="^\\[deploy\\] host t3 does not answer: ssh: Could not "
                       "resolve hostname t3: Name or service not known\nhint:") as caught:
        results["t3"].check()
    assert caught.value.host == "t3" and isinstance(caught.value, LaunchError)
    assert results["slow"].returncode is None  # killed after the timeout
    with pytest.raises(DeployError, match="host slow does not answer: no reply within 1.5 s"):
        results["slow"].check()


def test_a_remote_shell_that_does_not_exist_is_named():
    with pytest.raises(ArgumentError, match="cannot start the remote shell '/no/such/rsh'"):
        run_on_hosts({"a": ["true"]}, rsh="/no/such/rsh")

