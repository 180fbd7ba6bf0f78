"""Emulated RISC-V boards on this machine: a riscv64 Debian root, run by qemu-user through binfmt.

``scripts/rvv-board build`` makes the board's root file system once and caches it in
:data:`BOARD_DIR` (a fixed path: later sessions and CI's later steps reuse it);
``scripts/testhosts up N --root ROOT`` makes N test hosts that are boards. The board needs root,
binfmt_misc and Debian's registry (the first time): outside CI a board that cannot be made is a
skip that says why, in CI a failure (as tests/rvv_tools.py does for the cross compiler).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

import tvm_distx as td
from tvm_distx import ShardingRule
from tvm_distx.build import rvv
from tvm_distx.passes import AnnotateSharding

from locations import REPO_ROOT, TESTS_DIR
from rvv_tools import require_tools
from testhosts import NamespaceHosts, hosts_up

require_tools()  # the vector kernel is cross-compiled here
BOARD = REPO_ROOT / "scripts" / "rvv-board"
BOARD_DIR = Path(os.environ.get("RVV_BOARD_DIR", "/var/cache/tvm-distx/rvv-board"))
#: Open MPI in a board, as root, over the boards' network only
OMPI = ("mpiexec --allow-run-as-root --mca btl tcp,self --mca btl_tcp_if_include eth0 "
        "--mca oob_tcp_if_include eth0")
ALLREDUCE = """\
import socket
import numpy as np
from mpi4py import MPI
comm = MPI.COMM_WORLD
x = np.arange(4.0) + 10 * comm.rank
y = np.empty_like(x)
comm.Allreduce(x, y)
print(comm.rank, comm.size, socket.gethostname(), *y.tolist(), flush=True)
"""


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"the emulated board is missing in CI: {reason}", pytrace=False)
    pytest.skip(f"no emulated board (outside CI): {reason}")


@pytest.fixture(scope="session")
def board_root() -> Path:
    """The board's root file system, made by ``scripts/rvv-board build`` or reused."""
    if os.geteuid() != 0:
        _unavailable("the board needs root (binfmt_misc, chroot, overlayfs)")
    start = time.monotonic()
    done = subprocess.run([str(BOARD), "build", str(BOARD_DIR)], capture_output=True,
                          text=True, timeout=1800)
    if done.returncode != 0:
        _unavailable(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else
                     f"scripts/rvv-board build exited {done.returncode}")
    print(f"board root ready in {time.monotonic() - start:.1f} s")
    return Path(done.stdout.strip())


@pytest.fixture(scope="module")
def boards(board_root) -> NamespaceHosts:
    """Two test hosts that are boards."""
    with hosts_up(2, root=board_root) as hosts:
        yield hosts


def test_the_board_holds_python_numpy_and_open_mpi_but_no_tvm(board_root):
    done = subprocess.run([str(BOARD), "check", str(BOARD_DIR)], capture_output=True, text=True,
                          timeout=120, check=True)
    facts = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert facts["machine"] == "riscv64"
    assert facts["python"].startswith("3.")
    assert facts["numpy"].startswith("2.")
    assert facts["mpi"].startswith("Open MPI")
    assert done.stderr == ""
    found = subprocess.run(["find", str(board_root), "-name", "libtvm*"], capture_output=True,
                           text=True, check=True).stdout
    assert found == ""


def test_a_board_is_a_riscv64_host_with_its_own_files_and_qemu_cpu(boards):
    b1, b2 = boards.names
    out = boards.run(b1, "uname -m; hostname; echo $QEMU_CPU; touch /etc/written-on-b1").stdout
    assert out.split() == ["riscv64", b1, "rv64,v=true,vext_spec=v1.0"]
    assert boards.run(b2, "test -e /etc/written-on-b1", check=False).returncode == 1
    assert boards.run(b2, f"ssh {b1} hostname").stdout.strip() == b1  # the boards' own ssh
    assert boards.run(b2, f"ssh {b1} 'exit 3'", check=False).returncode == 3


@pytest.fixture(scope="module")
def vector_kernel(boards, tmp_path_factory):
    """A kernel with vector code and the harness that runs it, where the boards see them."""
    exe = td.compile(AnnotateSharding([ShardingRule(param="A", result="S[1]", function="mlp"),
                                       ShardingRule(param="B", result="S[0]", function="mlp")])(
        td.load_module(TESTS_DIR / "data" / "seed_tensor_parallel.py")), target="rvv")
    rng = np.random.default_rng(31)
    x, A, B = [(0.1 * rng.standard_normal((128, 128))).astype("float32") for _ in range(3)]
    bundle = exe.export(tmp_path_factory.mktemp("board") / "tp", params={"A": A, "B": B})
    folder = boards.shared / "kernel"
    folder.mkdir()
    shutil.copy(bundle / "kernels" / "kernels.so", folder)
    shutil.copy(rvv.build_harness(bundle / "kernels"), folder)
    assert rvv.vector_instructions(bundle / "kernels")["vfmacc.vv"] > 0
    (fused,) = [k for k in rvv.read_kernels(bundle / "kernels") if "relu" in k.name]
    args, outputs = rvv.harness_arguments(folder / "kernels.so", fused, [x, A[:, 64:]], folder)
    return folder, args, outputs, np.maximum(x @ A[:, 64:], 0)


def test_a_vector_kernel_runs_on_a_board_and_dies_without_the_vector_unit(boards,
                                                                           vector_kernel):
    folder, args, ((path, arg),), want = vector_kernel
    command = " ".join([str(folder / "harness"), *args])
    boards.run(boards.names[0], command)  # QEMU_CPU=rv64,v=true from the board's shell
    got = np.fromfile(path, dtype=arg.dtype).reshape(arg.shape)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    done = boards.run(boards.names[0], f"QEMU_CPU=rv64,v=false {command}", check=False)
    assert done.returncode == 128 + 4, done.stderr  # SIGILL, as the shell reports it
    assert "Illegal instruction" in done.stderr


def test_two_ranks_in_one_board_all_reduce(boards):
    (boards.shared / "allreduce.py").write_text(ALLREDUCE)
    done = boards.run(boards.names[0], f"{OMPI} --oversubscribe -n 2 python3 "
                                       f"{boards.shared / 'allreduce.py'}")
    lines = sorted(done.stdout.splitlines())
    assert lines == [f"{r} 2 {boards.names[0]} 10.0 12.0 14.0 16.0" for r in (0, 1)]
    assert done.stderr == ""


def test_open_mpi_all_reduce_across_two_boards_over_tcp(boards):
    b1, b2 = boards.names
    (boards.shared / "allreduce.py").write_text(ALLREDUCE)
    start = time.monotonic()
    done = boards.run(b1, f"{OMPI} --host {b1},{b2} -n 2 python3 "
                          f"{boards.shared / 'allreduce.py'}")
    print(f"2 ranks on 2 boards in {time.monotonic() - start:.1f} s")
    lines = sorted(done.stdout.splitlines())
    assert lines == [f"0 2 {b1} 10.0 12.0 14.0 16.0", f"1 2 {b2} 10.0 12.0 14.0 16.0"]
    assert done.stderr == ""  # no "Unable to find reachable pairing", nothing else
