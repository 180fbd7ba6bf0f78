"""Emulated RISC-V boards on this machine: a riscv64 Debian root, run by qemu-user through binfmt.

The fixtures ``board_root`` (the root, built once a run by ``scripts/rvv-board build`` or
reused) and ``board_hosts`` (two test hosts that are boards) come from ``tests/boards.py``: a
board that cannot be made fails these tests in one line, unless ``TVM_DISTX_NO_BOARD=1``.
"""

from __future__ import annotations

import shutil
import subprocess
import time

import numpy as np
import pytest

import tvm_distx as td
from tvm_distx import ShardingRule
from tvm_distx.compiler import rvv
from tvm_distx.passes import AnnotateSharding

from boards import BOARD, BOARD_DIR
from locations import TESTS_DIR
from rvv_tools import require_tools

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


def test_a_board_is_a_riscv64_host_with_its_own_files_and_qemu_cpu(board_hosts):
    b1, b2 = board_hosts.names
    out = board_hosts.run(b1, "uname -m; hostname; echo $QEMU_CPU; touch /etc/written-on-b1")
    assert out.stdout.split() == ["riscv64", b1, "rv64,v=true,vext_spec=v1.0"]
    assert board_hosts.run(b2, "test -e /etc/written-on-b1", check=False).returncode == 1
    board_hosts.run(b1, "rm /etc/written-on-b1")  # the boards stay up for the session
    assert board_hosts.run(b2, f"ssh {b1} hostname").stdout.strip() == b1  # the boards' own ssh
    assert board_hosts.run(b2, f"ssh {b1} 'exit 3'", check=False).returncode == 3


@pytest.fixture(scope="module")
def vector_kernel(board_hosts, tmp_path_factory):
    """A kernel with vector code and the harness that runs it, where the boards see them."""
    require_tools()  # the vector kernel is cross-compiled here
    exe = td.compile(AnnotateSharding([ShardingRule(param="A", result="S[1]", function="mlp"),
                                       ShardingRule(param="B", result="S[0]", function="mlp")])(
        td.load_module(TESTS_DIR / "data" / "seed_tensor_parallel.py")), target="rvv")
    rng = np.random.default_rng(31)
    x, A, B = [(0.1 * rng.standard_normal((128, 128))).astype("float32") for _ in range(3)]
    bundle = exe.export(tmp_path_factory.mktemp("board") / "tp", params={"A": A, "B": B})
    folder = board_hosts.shared / "kernel"
    folder.mkdir()
    shutil.copy(bundle / "kernels" / "kernels.so", folder)
    shutil.copy(rvv.build_harness(bundle / "kernels"), folder)
    assert rvv.vector_instructions(bundle / "kernels")["vfmacc.vv"] > 0
    (fused,) = [k for k in rvv.read_kernels(bundle / "kernels") if "relu" in k.name]
    args, outputs = rvv.harness_arguments(folder / "kernels.so", fused, [x, A[:, 64:]], folder)
    return folder, args, outputs, np.maximum(x @ A[:, 64:], 0)


def test_a_vector_kernel_runs_on_a_board_and_dies_without_the_vector_unit(board_hosts,
                                                                           vector_kernel):
    folder, args, ((path, arg),), want = vector_kernel
    command = " ".join([str(folder / "harness"), *args])
    board_hosts.run(board_hosts.names[0], command)  # QEMU_CPU=rv64,v=true from the board's shell
    got = np.fromfile(path, dtype=arg.dtype).reshape(arg.shape)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    done = board_hosts.run(board_hosts.names[0], f"QEMU_CPU=rv64,v=false {command}", check=False)
    assert done.returncode == 128 + 4, done.stderr  # SIGILL, as the shell reports it
    assert "Illegal instruction" in done.stderr


def test_two_ranks_in_one_board_all_reduce(board_hosts):
    (board_hosts.shared / "allreduce.py").write_text(ALLREDUCE)
    done = board_hosts.run(board_hosts.names[0], f"{OMPI} --oversubscribe -n 2 python3 "
                                                 f"{board_hosts.shared / 'allreduce.py'}")
    lines = sorted(done.stdout.splitlines())
    assert lines == [f"{r} 2 {board_hosts.names[0]} 10.0 12.0 14.0 16.0" for r in (0, 1)]
    assert done.stderr == ""


def test_open_mpi_all_reduce_across_two_boards_over_tcp(board_hosts):
    b1, b2 = board_hosts.names
    (board_hosts.shared / "allreduce.py").write_text(ALLREDUCE)
    start = time.monotonic()
    done = board_hosts.run(b1, f"{OMPI} --host {b1},{b2} -n 2 python3 "
                               f"{board_hosts.shared / 'allreduce.py'}")
    print(f"2 ranks on 2 boards in {time.monotonic() - start:.1f} s")
    lines = sorted(done.stdout.splitlines())
    assert lines == [f"0 2 {b1} 10.0 12.0 14.0 16.0", f"1 2 {b2} 10.0 12.0 14.0 16.0"]
    assert done.stderr == ""  # no "Unable to find reachable pairing", nothing else
