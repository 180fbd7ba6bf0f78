"""The test hosts (``scripts/testhosts``, ``tests/testhosts.py``): namespaces on this machine
that behave as separate hosts, and that leave nothing behind.

Most tests use the session's three hosts (``test_hosts``); the up/down tests make their own
under an id of their own. The MPI test proves that ranks on two test hosts talk over TCP, not
shared memory: UCX's protocol tables (``UCX_PROTO_INFO=y``) name ``tcp/eth0`` for the
inter-node lanes, while two ranks on this machine without the hosts use ``sysv``/``cma``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from proc_tools import with_default_ctrl_c
from testhosts import SCRIPT, NamespaceHosts, free_id, hosts_up, script


def _links() -> str:
    return subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout


def _netns() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _namespaces_in_use() -> set[str]:
    """The net and pid namespaces of every live process (``net:[4026531840]``, ...)."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue  # ended; its parent has not read its exit status yet
        except OSError:
            continue
        for kind in ("net", "pid"):
            try:
                found.add(os.readlink(f"/proc/{pid}/ns/{kind}"))
            except OSError:
                pass
    return found


def _leftovers(k: int, names: list[str], namespaces: set[str]) -> list[str]:
    """Whatever of id ``k`` is still there: netns, links, mounts, state, processes."""
    found = [f"netns {n}" for n in _netns() if n in names]
    found += re.findall(rf"^\d+: ((?:th{k}v\d+|thbr{k}))[:@]", _links(), re.M)
    mounts = Path("/proc/mounts").read_text()
    found += [f"mount {m}" for m in re.findall(rf"\S*tvm-distx-testhosts\S*/{k}\b\S*", mounts)]
    found += [f"mount {m}" for m in re.findall(r"\S*/netns/(\S+)", mounts) if m in names]
    found += [f"state {p}" for p in (Path(f"/run/tvm-distx-testhosts/{k}"),
                                    Path(f"/var/tmp/tvm-distx-testhosts/{k}"),
                                    Path(f"/var/tmp/tvm-distx-testhosts-shared/{k}"))
              if p.exists()]
    found += [f"process in {ns}" for ns in namespaces & _namespaces_in_use()]
    return found


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def _host_namespaces(k: int, names: list[str]) -> set[str]:
    found = set()
    for name in names:
        init = int(Path(f"/run/tvm-distx-testhosts/{k}/{name}/pid").read_text())
        found |= {os.readlink(f"/proc/{init}/ns/{kind}") for kind in ("net", "pid")}
    return found


# --- up and down -----------------------------------------------------------------------------

def test_up_makes_the_hosts_and_down_leaves_nothing_behind():
    with hosts_up(2) as hosts:
        k, names = hosts.id, list(hosts.names)
        assert names == [f"k{k}t1", f"k{k}t2"]
        assert set(names) <= set(_netns())
        assert f"thbr{k}" in _links() and f"th{k}v2" in _links()
        namespaces = _host_namespaces(k, names)
        assert len(namespaces) == 4  # a network and a PID namespace per host
        hosts.run(names[0], "sleep 300 >/dev/null 2>&1 &")  # a process down must end
        assert [c for _, c in hosts.processes(names[0])] == ["sleep 300"]
    assert _leftovers(k, names, namespaces) == []
    script("down", f"--id={k}")  # again: nothing to do, and no error


def test_up_refuses_an_id_that_is_up():
    with hosts_up(1) as hosts:
        done = script("up", "1", f"--id={hosts.id}", check=False)
        assert done.returncode == 1
        assert f"down --id {hosts.id}` first" in done.stderr


def test_up_leaves_alone_a_namespace_of_the_same_name_that_it_did_not_make():
    with free_id() as k:
        subprocess.run(["ip", "netns", "add", f"k{k}t2"], check=True)
        try:
            done = script("up", "2", f"--id={k}", check=False)
            assert done.returncode == 1
            assert f"k{k}t2 exist already (not made by testhosts --id {k})" in done.stderr
            assert f"k{k}t2" in _netns()
            assert _leftovers(k, [f"k{k}t1"], set()) == []
        finally:
            subprocess.run(["ip", "netns", "del", f"k{k}t2"], check=True)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_down_cleans_up_after_an_up_that_was_killed_midway(sig):
    with free_id() as k:
        names = [f"k{k}t{i}" for i in (1, 2, 3)]
        up = subprocess.Popen([str(SCRIPT), "up", "3", f"--id={k}"], stderr=subprocess.PIPE,
                              text=True, preexec_fn=with_default_ctrl_c,
                              env={**os.environ, "TESTHOSTS_TEST_STALL": names[1]})
        try:
            assert "stalled after starting" in up.stderr.readline()  # hosts 1 and 2 are made
            assert sorted(n for n in _netns() if n in names) == names[:2]
            up.send_signal(sig)
            assert up.wait(timeout=30) != 0
        finally:
            up.kill()
            up.wait()
        if sig == signal.SIGKILL:  # no chance to clean: `down` does it
            assert sorted(n for n in _netns() if n in names) == names[:2]
            script("down", f"--id={k}")
        assert _leftovers(k, names, set()) == []
        assert not [p for p in os.listdir("/proc") if f"--id={k}" in _cmdline(p)]


def _memcg_of(hosts: NamespaceHosts, host: str) -> str:
    """The memory cgroup of ``host``'s remote shell, as /proc/self/cgroup there gives it."""
    lines = hosts.run(host, "cat /proc/self/cgroup").stdout.splitlines()
    return next(line.split(":", 2)[2] for line in lines if line.split(":")[1] == "memory")


def test_up_mem_limits_each_host_and_all_its_remote_shell_starts_and_down_removes_it():
    from tvm_distx.hosts import Host
    from tvm_distx.hosts.memory import read_memory

    with hosts_up(2, mem="200M") as hosts:
        k, names = hosts.id, list(hosts.names)
        for name in names:
            memcg = f"/sys/fs/cgroup/memory/tvm-distx-testhosts/{k}/{name}"
            assert _memcg_of(hosts, name) == memcg.removeprefix("/sys/fs/cgroup/memory")
            assert Path(f"{memcg}/memory.limit_in_bytes").read_text() == f"{200 << 20}\n"
            init = Path(f"/run/tvm-distx-testhosts/{k}/{name}/pid").read_text().strip()
            assert init in Path(f"{memcg}/cgroup.procs").read_text().split()
        # read over the remote shell: the cgroup's limit; a host's mem= wins over it
        found = read_memory([Host(names[0]), Host(names[1], 1, 1 << 30)], rsh=hosts.rsh)
        assert [(m.bytes, m.source, m.oom_kills) for m in found.values()] == [
            (200 << 20, "cgroup", 0), (1 << 30, "mem=", 0)]
        # a process over the limit is killed by the kernel, and the host's count says so
        hog = hosts.run(names[0], "exec python3 -c 'b = bytearray(400 << 20); b[::4096] = "
                        "b\"x\" * (len(b) // 4096)'", check=False)
        assert hog.returncode == -signal.SIGKILL or hog.returncode == 128 + signal.SIGKILL
        after = read_memory([Host(names[0])], rsh=hosts.rsh)[names[0]]
        assert after.oom_kills == 1
    assert not Path(f"/sys/fs/cgroup/memory/tvm-distx-testhosts/{k}").exists()
    script("down", f"--id={k}")  # again: nothing to do


def test_without_mem_a_hosts_memory_is_what_this_machine_has_available(test_hosts):
    from tvm_distx.hosts import Host
    from tvm_distx.hosts.memory import local_memory, read_memory

    host = test_hosts.names[0]
    assert "tvm-distx-testhosts" not in _memcg_of(test_hosts, host)
    found = read_memory([Host(host)], rsh=test_hosts.rsh)[host]
    here = local_memory()
    assert found.source == here.source == "available"
    assert abs(found.bytes - here.bytes) < here.bytes * 0.1  # the same kernel, a moment apart


def test_down_removes_the_memory_cgroups_of_an_up_that_was_killed_midway():
    with free_id() as k:
        up = subprocess.Popen([str(SCRIPT), "up", "3", f"--id={k}", "--mem=100M"],
                              stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "TESTHOSTS_TEST_STALL": f"k{k}t2"})
        try:
            assert "stalled after starting" in up.stderr.readline()
            up.kill()
            up.wait(timeout=30)
        finally:
            up.kill()
            up.wait()
        top = Path(f"/sys/fs/cgroup/memory/tvm-distx-testhosts/{k}")
        assert sorted(p.name for p in top.iterdir() if p.is_dir()) == [f"k{k}t1", f"k{k}t2"]
        script("down", f"--id={k}")
        assert not top.exists()
        assert _leftovers(k, [f"k{k}t{i}" for i in (1, 2, 3)], set()) == []


def test_up_refuses_a_bad_mem_in_one_line():
    done = script("up", "1", "--id=255", "--mem=lots", check=False)
    assert done.returncode == 1
    assert done.stderr == ("testhosts: --mem lots: not a memory size of at least 1M (write "
                           "800M, 2G: binary units)\n")


# --- what makes them hosts -------------------------------------------------------------------

def test_each_host_has_its_own_hostname_and_names_the_others(test_hosts):
    seen = [test_hosts.run(h, "hostname").stdout.strip() for h in test_hosts.names]
    assert seen == list(test_hosts.names)
    etc_hosts = test_hosts.run(test_hosts.names[0], "cat /etc/hosts").stdout
    for name, address in test_hosts.addresses.items():
        assert f"{address}\t{name}\n" in etc_hosts
    assert f"{test_hosts.caller_address}\t{test_hosts.caller}\n" in etc_hosts
    assert "10.231." not in Path("/etc/hosts").read_text()  # this machine's file is untouched


def test_tmp_shm_and_the_deploy_root_are_private_and_the_rest_is_shared(test_hosts):
    a, b = test_hosts.names[:2]
    mark = f"mark-{uuid.uuid4().hex}"
    places = ["/tmp", "/dev/shm", test_hosts.deploy_root]
    for place in places:
        test_hosts.run(a, f"echo {a} > {place}/{mark}")
        assert test_hosts.run(a, f"cat {place}/{mark}").stdout == f"{a}\n"
        assert test_hosts.run(b, f"test -e {place}/{mark}", check=False).returncode == 1
        assert not Path(place, mark).exists()  # nor on this machine
    here = Path("/tmp", f"{mark}-here")
    here.write_text("here")
    try:
        assert test_hosts.run(a, f"test -e {here}", check=False).returncode == 1
    finally:
        here.unlink()
    test_hosts.run(a, f"echo {a} > {test_hosts.shared}/{mark}")
    assert test_hosts.run(b, f"cat {test_hosts.shared}/{mark}").stdout == f"{a}\n"
    (test_hosts.shared / mark).unlink()
    # the repository and its Python stay where they are
    code = "import numpy, tvm_distx; print(tvm_distx.__file__)"
    done = test_hosts.run(b, [sys.executable, "-c", code])
    assert done.stdout.startswith(str(Path(__file__).resolve().parents[1]))


def test_a_host_sees_only_its_own_processes(test_hosts):
    a, b = test_hosts.names[:2]
    assert test_hosts.run(a, "echo $$").stdout.strip().isdigit()
    listed = test_hosts.run(a, "ps -ww -e -o pid=,args=").stdout.splitlines()
    assert "_init" in listed[0] and listed[0].split()[0] == "1"  # the host's init is its PID 1
    test_hosts.run(b, "sleep 300 >/dev/null 2>&1 &")
    try:
        assert "sleep 300" not in test_hosts.run(a, "ps -ww -e -o args=").stdout
    finally:
        test_hosts.kill(b)


# --- wherever the checkout is ----------------------------------------------------------------

def _clone_under(where: Path) -> Path:
    """A checkout in ``where`` as a newcomer's clone under /tmp would be, made cheaply: the test
    hosts' scripts (the clone's ``testhosts-ssh`` ends with a line of its own) and a virtual
    environment of its own in ``.venv`` (without pip)."""
    clone = where / "clone"
    (clone / "scripts").mkdir(parents=True)
    for name in ("testhosts", "testhosts-rsh", "testhosts-ssh"):
        shutil.copy2(SCRIPT.parent / name, clone / "scripts" / name)
    with open(clone / "scripts" / "testhosts-ssh", "a") as ssh:
        ssh.write("# the clone's copy\n")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(clone / ".venv")],
                   check=True)
    return clone


def _board_root(root: Path) -> Path:
    """A board's root file system as small as testhosts accepts and its remote shell can use:
    this machine's ``sh`` with its libraries, a ``usr/bin/python3`` and ``etc/mark``."""
    shell = Path(shutil.which("sh")).resolve()
    libraries = re.findall(r"(/\S+) \(0x", subprocess.run(["ldd", str(shell)], capture_output=True,
                                                       text=True, check=True).stdout)
    for path in [*libraries, "/bin/sh"]:
        (root / path.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(shell if path == "/bin/sh" else path, root / path.lstrip("/"))
    for folder in ("proc", "sys", "dev", "tmp", "root", "etc", "usr/bin"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    (root / "usr" / "bin" / "python3").write_text("#!/bin/sh\necho board python3\n")
    (root / "etc" / "mark").write_text("the board's root\n")
    return root


def test_a_clone_under_tmp_its_venv_and_a_board_root_are_seen_at_their_paths_and_tmp_stays_own():
    where = Path(tempfile.mkdtemp(prefix="testhosts-newcomer-", dir="/tmp"))
    try:
        clone = _clone_under(where)
        software = where / "software"  # shared like a cluster's software (--share)
        software.mkdir()
        (software / "mark").write_text("shared software\n")
        (where / "not-shared").write_text("this machine's own\n")
        board = _board_root(where / "board")
        testhosts, rsh = clone / "scripts" / "testhosts", str(clone / "scripts" / "testhosts-rsh")

        def on(host: str, command: str) -> subprocess.CompletedProcess:
            return subprocess.run([rsh, host, command], capture_output=True, text=True,
                                  timeout=30)

        with free_id() as k:
            names, namespaces = [f"k{k}t1", f"k{k}t2"], set()
            try:
                subprocess.run([str(testhosts), "up", "2", f"--id={k}", f"--share={software}"],
                               check=True, capture_output=True, timeout=60)
                namespaces = _host_namespaces(k, names)
                a, b = names
                assert on(a, f"{clone}/.venv/bin/python -c 'import sys; print(sys.prefix)'"
                          ).stdout == f"{clone / '.venv'}\n"
                assert on(a, f"tail -1 {clone}/scripts/testhosts-ssh").stdout == \
                    "# the clone's copy\n"
                assert on(b, f"cat {software}/mark").stdout == "shared software\n"
                # the rest of /tmp is each host's own, both ways
                assert on(a, f"test -e {where}/not-shared").returncode == 1
                mark = f"mark-{uuid.uuid4().hex}"
                assert on(a, f"echo {a} > {where}/{mark} && echo {a} > /tmp/{mark}"
                          ).returncode == 0
                assert not (where / mark).exists() and not Path("/tmp", mark).exists()
                assert on(b, f"test -e {where}/{mark} || test -e /tmp/{mark}").returncode == 1
                # what a host writes in the shared checkout, every host and this machine see
                assert on(a, f"echo {a} > {clone}/{mark}").returncode == 0
                assert (clone / mark).read_text() == f"{a}\n"
                assert on(b, f"cat {clone}/{mark}").stdout == f"{a}\n"
                subprocess.run([str(testhosts), "down", f"--id={k}"], check=True, timeout=60)
                assert _leftovers(k, names, namespaces) == []

                # a board whose root is under /tmp, with the clone's ssh bound inside
                subprocess.run([str(testhosts), "up", "1", f"--id={k}", f"--root={board}"],
                               check=True, capture_output=True, timeout=60)
                namespaces = _host_namespaces(k, names[:1])
                done = on(names[0], "read m < /etc/mark; echo $m; echo $QEMU_CPU; while read l;"
                                    " do last=$l; done < /usr/local/bin/ssh; echo $last")
                assert done.stdout == "the board's root\nrv64,v=true,vext_spec=v1.0\n" \
                                      "# the clone's copy\n", done.stderr
            finally:
                subprocess.run([str(testhosts), "down", f"--id={k}"], timeout=60)
        assert _leftovers(k, names, namespaces) == []
        assert str(where) not in Path("/proc/self/mounts").read_text()
    finally:
        shutil.rmtree(where)


@pytest.mark.parametrize("what", ["share", "root", "checkout", "missing", "tmp"])
def test_a_path_that_a_host_cannot_see_is_refused_in_one_line_naming_it(what):
    where = Path(tempfile.mkdtemp(prefix="testhosts-hidden-", dir="/dev/shm"))
    testhosts, args = SCRIPT, []
    try:
        if what == "share":
            path, args = where, [f"--share={where}"]
        elif what == "root":
            (where / "usr" / "bin").mkdir(parents=True)
            (where / "usr" / "bin" / "python3").touch()
            path, args = where, [f"--root={where}"]
        elif what == "checkout":  # a clone in /dev/shm, each host's own memory
            (where / "scripts").mkdir()
            testhosts = Path(shutil.copy2(SCRIPT, where / "scripts" / "testhosts"))
            path = where
        elif what == "missing":
            path = Path("/tmp", f"testhosts-missing-{uuid.uuid4().hex}")
            args = [f"--share={path}"]
        else:
            path, args = Path("/tmp"), ["--share=/tmp"]
        why = {"missing": "No such file or directory", "tmp": "each host has its own /tmp"}.get(
            what, "each host has its own /dev/shm")
        with free_id() as k:
            done = subprocess.run([str(testhosts), "up", "1", f"--id={k}", *args],
                                  capture_output=True, text=True, timeout=60)
            assert (done.returncode, done.stdout) == (1, "")
            assert done.stderr.startswith(f"testhosts: a test host cannot see {path}: {why}")
            assert done.stderr.count("\n") == 1, done.stderr
            assert _leftovers(k, [f"k{k}t1"], set()) == []
    finally:
        shutil.rmtree(where)


# --- the network -----------------------------------------------------------------------------

SERVER = textwrap.dedent("""
    import socket, sys
    server = socket.create_server(("", 7700))
    print("ready", flush=True)
    while True:
        conn, peer = server.accept()
        conn.sendall(socket.gethostname().encode() + b" " + conn.recv(100))
        conn.close()
""")
CLIENT = textwrap.dedent("""
    import socket, sys
    try:
        with socket.create_connection((sys.argv[1], 7700), timeout=float(sys.argv[2])) as c:
            c.sendall(b"hello")
            print(c.recv(100).decode())
    except OSError as error:
        print("failed:", error)
""")


def _ask(hosts: NamespaceHosts, source: str, target: str, timeout: float = 2.0) -> str:
    done = hosts.run(source, [sys.executable, "-c", CLIENT, target, str(timeout)])
    return done.stdout.strip()


def test_tcp_between_hosts_and_a_link_that_goes_down_and_up(test_hosts):
    a, b, c = test_hosts.names
    server = subprocess.Popen([test_hosts.rsh, b, shlex.join([sys.executable, "-c", SERVER])],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline() == "ready\n"
        assert _ask(test_hosts, a, b) == f"{b} hello"
        assert _ask(test_hosts, c, test_hosts.addresses[b]) == f"{b} hello"
        test_hosts.link(b, up=False)
        try:
            assert _ask(test_hosts, a, b, timeout=1.0).startswith("failed:")
        finally:
            test_hosts.link(b, up=True)
        deadline = time.monotonic() + 10
        while (answer := _ask(test_hosts, a, b)) != f"{b} hello" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert answer == f"{b} hello"
        test_hosts.kill(b)  # the server (and the shell around it) ends
        assert server.wait(timeout=10) != 0
        assert test_hosts.processes(b) == []
    finally:
        server.kill()
        server.wait()
        test_hosts.kill(b)


def test_kill_ends_every_process_of_a_host_and_only_of_that_host(test_hosts):
    a, b = test_hosts.names[:2]
    for host in (a, b):
        test_hosts.run(host, "sleep 300 >/dev/null 2>&1 & sleep 301 >/dev/null 2>&1 &")
    try:
        assert sorted(c for _, c in test_hosts.processes(a)) == ["sleep 300", "sleep 301"]
        test_hosts.kill(a)
        assert test_hosts.processes(a) == []
        assert len(test_hosts.processes(b)) == 2
        assert test_hosts.run(a, "hostname").stdout.strip() == a  # the host itself stays
    finally:
        test_hosts.kill(b)


# --- the remote shell ------------------------------------------------------------------------

def test_the_remote_shell_is_called_like_ssh(test_hosts):
    a = test_hosts.names[0]
    rsh = test_hosts.rsh

    def call(*argv: str, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run([rsh, *argv], capture_output=True, text=True, timeout=30, **kwargs)

    done = call("-x", "-T", "-q", "-o", "BatchMode=yes", "-oStrictHostKeyChecking=no", "-p",
                "22", "-l", "root", a, "echo", "$(hostname)", "two  words")
    assert (done.returncode, done.stdout) == (0, f"{a} two words\n")  # joined, then sh -c
    assert call(f"root@{a}", "hostname").stdout == f"{a}\n"
    assert call(a, "exit 3").returncode == 3
    done = call(a, "cat; echo err >&2", input="in\n")
    assert (done.stdout, done.stderr) == ("in\n", "err\n")
    done = call("-x", "nohost", "true")
    assert done.returncode == 255
    assert done.stderr == "ssh: Could not resolve hostname nohost: Name or service not known\n"


def test_the_remote_shell_can_need_the_link(test_hosts):
    a = test_hosts.names[0]
    env = {**os.environ, "TESTHOSTS_RSH_NEEDS_LINK": "1"}
    test_hosts.link(a, up=False)
    try:
        done = subprocess.run([test_hosts.rsh, a, "true"], capture_output=True, text=True,
                              env=env)
        assert done.returncode == 255 and "No route to host" in done.stderr
        assert test_hosts.run(a, "true").returncode == 0  # without the variable it still works
    finally:
        test_hosts.link(a, up=True)
    assert subprocess.run([test_hosts.rsh, a, "true"], env=env).returncode == 0


def test_env_and_hostfile(test_hosts, tmp_path):
    env = script("env", f"--id={test_hosts.id}").stdout
    assert f"TESTHOSTS_NAMES={','.join(test_hosts.names)}\n" in env
    assert f"TESTHOSTS_RSH={test_hosts.rsh}\n" in env
    a, b, c = test_hosts.names
    assert script("hostfile", f"--id={test_hosts.id}", "--slots=2,1,1").stdout == \
        f"{a}:2\n{b}:1\n{c}:1\n"
    assert test_hosts.hostfile(tmp_path / "h", [2, 1, 1]).read_text() == f"{a}:2\n{b}:1\n{c}:1\n"


# --- MPI across hosts ------------------------------------------------------------------------

ALLREDUCE = textwrap.dedent("""
    import socket
    import numpy as np
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    x = np.arange(1 << 19, dtype="float64") * (comm.rank + 1)  # 4 MiB
    y = np.empty_like(x)
    comm.Allreduce(x, y)
    total = sum(range(1, comm.size + 1))
    ok = np.array_equal(y, np.arange(1 << 19, dtype="float64") * total)
    seen = comm.gather((comm.rank, socket.gethostname(), ok))  # one writer: no interleaving
    if comm.rank == 0:
        print("".join(f"RESULT {r} {host} {ok}\\n" for r, host, ok in seen), flush=True)
""")


def _mpiexec(args: list[str], program: Path, **env: str) -> subprocess.CompletedProcess:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    done = subprocess.run([str(mpiexec if mpiexec.exists() else shutil.which("mpiexec")),
                           *args, sys.executable, str(program)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **env})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _results(out: str) -> dict[int, tuple[str, str]]:
    return {int(r): (h, ok) for r, h, ok in re.findall(r"^RESULT (\d+) (\S+) (\S+)$", out, re.M)}


def _lanes(out: str) -> dict[str, set[str]]:
    """The transports of UCX's protocol tables, by peer kind (``inter-node``, ``intra-node``).

    Each rank prints tables headed ``ucp_context_0 <kind> cfg#N | <operation>``, with rows
    ``| <sizes> | <protocol> | <transport>/<device> |``; ranks' lines interleave, so each
    line's ``[host:pid:thread]`` prefix says whose table it continues.
    """
    kinds: dict[str, str] = {}
    lanes: dict[str, set[str]] = {}
    for line in out.splitlines():
        owner = re.match(r"\[[\d.]+\] \[([^\]]+)\]", line)
        if not owner:
            continue
        if head := re.search(r"\| ucp_context_\d+ (\S+) cfg#\d+ \|", line):
            kinds[owner[1]] = head[1]
        elif (row := re.search(r"\|[^|]+\|[^|]+\| ([\w-]+/[\w.-]+) +\|$", line)) \
                and owner[1] in kinds:
            lanes.setdefault(kinds[owner[1]], set()).add(row[1])
    return lanes


def test_mpi_ranks_on_two_hosts_talk_over_tcp_not_shared_memory(test_hosts):
    a, b = test_hosts.names[:2]
    program = test_hosts.shared / "allreduce.py"  # the hosts' /tmp is their own
    program.write_text(ALLREDUCE)
    done = _mpiexec([*test_hosts.launcher(), "-hosts", f"{a},{b}", "-n", "2"], program,
                    UCX_PROTO_INFO="y")
    assert _results(done.stdout) == {0: (a, "True"), 1: (b, "True")}
    lanes = _lanes(done.stdout + done.stderr)
    assert "intra-node" not in lanes, lanes
    assert lanes["inter-node"] and all(t.startswith("tcp/") for t in lanes["inter-node"]), lanes
    # the same two ranks on this machine, without the hosts: shared memory, which the check sees
    done = _mpiexec(["-n", "2"], program, UCX_PROTO_INFO="y")
    lanes = _lanes(done.stdout + done.stderr)
    assert "inter-node" not in lanes, lanes
    assert {t.split("/")[0] for t in lanes["intra-node"]} & {"sysv", "posix", "cma"}, lanes


def test_hydra_places_ranks_in_host_order_filling_slots(test_hosts):
    a, b, c = test_hosts.names
    program = test_hosts.shared / "allreduce.py"
    program.write_text(ALLREDUCE)
    done = _mpiexec([*test_hosts.launcher(), "-hosts", f"{a}:2,{b}:1,{c}:1", "-n", "4"],
                    program)
    assert _results(done.stdout) == {0: (a, "True"), 1: (a, "True"), 2: (b, "True"),
                                     3: (c, "True")}
    for host in test_hosts.names:  # the proxies and ranks are gone from every host
        assert test_hosts.processes(host) == []


# --- the fixture cleans up -------------------------------------------------------------------

SESSION = textwrap.dedent("""
    import time
    from testhosts import test_hosts_fixture  # noqa: F401

    def test_that_fails(test_hosts):
        print("UP", test_hosts.id, ",".join(test_hosts.names), flush=True)
        if {how!r} != "fails":
            time.sleep(300)  # until interrupted
        assert False
""")


@pytest.mark.parametrize("how", ["fails", "ctrl-c", "killed"])
def test_a_session_that_fails_or_is_interrupted_leaves_nothing_behind(how, tmp_path):
    (tmp_path / "test_session.py").write_text(SESSION.format(how=how))
    tests = Path(__file__).resolve().parent
    session = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-c",
         os.devnull, "--rootdir", str(tmp_path), "-o", f"pythonpath={tests}",
         str(tmp_path / "test_session.py")], cwd=tmp_path, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, preexec_fn=with_default_ctrl_c)
    try:
        for line in session.stdout:
            if line.startswith("UP "):
                break
        _, k, names = line.split()
        k, names = int(k), names.split(",")
        namespaces = _host_namespaces(k, names)
        if how == "ctrl-c":
            session.send_signal(signal.SIGINT)
        elif how == "killed":
            session.kill()
        rest = session.communicate(timeout=60)[0]
    finally:
        session.kill()
        session.wait()
    assert session.returncode == {"fails": 1, "ctrl-c": 2, "killed": -9}[how], rest
    if how == "killed":  # no teardown ran: the next session cleans up first
        assert set(names) <= set(_netns())
        with free_id():
            pass
    assert _leftovers(k, names, namespaces) == []
