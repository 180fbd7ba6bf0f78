"""One rank of the MPI collectives check: ``mpiexec -n N python ccl_worker.py``.

Every rank installs :mod:`tvm_distx.runtime.mpi_ccl`, then calls each
``tvm_distx.ccl.*`` function (and TVM's overridden disco builtins) through
``tvm.get_global_func`` on TVM tensors, exactly as a lowered program does, and
compares its output with what numpy says it should hold. Inputs come from
arrays seeded by the case's name, so every rank knows the global data. Cases
that need more ranks than the job has are skipped.

A mismatch is printed (``FAIL <case> rank <r>: ...``) and the job exits 1;
an unexpected exception aborts the whole job, so no rank waits forever. When
every case passes on every rank, rank 0 prints ``MPI-CCL OK <n> cases on <N>
ranks``.
"""

from __future__ import annotations

import sys
import traceback
import zlib

import numpy as np
import tvm
import tvm_ffi
from mpi4py import MPI

from tvm_distx import ccl
from tvm_distx.ccl import CollectiveGroup, SendRecvSpec
from tvm_distx.layout.mesh import DeviceMesh
from tvm_distx.layout import Placement, TensorSharding
from tvm_distx.runtime import mpi_ccl, shard_array

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
IMPL = mpi_ccl.install()
FAILURES: list[str] = []
RAN: list[str] = []

REDUCE = {"sum": lambda a: np.sum(a, axis=0), "prod": lambda a: np.prod(a, axis=0),
          "min": lambda a: np.min(a, axis=0), "max": lambda a: np.max(a, axis=0),
          "avg": lambda a: np.sum(a, axis=0) / len(a)}


def mesh(shape: tuple[int, ...], first: int = 0) -> DeviceMesh:
    return DeviceMesh(shape, range(first, first + int(np.prod(shape))))


def data(name: str, shape, dtype="float32") -> np.ndarray:
    """Small integer values (exact in every dtype and under every reduction), by ``name``."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    return rng.integers(-3, 4, size=shape).astype(dtype)


def tensor(array: np.ndarray):
    return tvm.runtime.tensor(np.ascontiguousarray(array))


def empty(shape, dtype: str):
    return tvm.runtime.empty(tuple(shape), dtype)


def check(case: str, got, want: np.ndarray) -> None:
    got = got.numpy() if hasattr(got, "numpy") else got
    if got.shape != want.shape or got.dtype != want.dtype or not np.array_equal(got, want):
        detail = (f"shape {got.shape} {got.dtype} vs {want.shape} {want.dtype}"
                  if got.shape != want.shape or got.dtype != want.dtype
                  else f"{int(np.sum(got != want))} elements differ")
        FAILURES.append(f"FAIL {case} rank {RANK}: {detail}")
        print(FAILURES[-1], flush=True)


def needs(ranks: int) -> bool:
    return SIZE >= ranks


def group_call(name: str, m: DeviceMesh, axes, run) -> None:
    """Run ``run(group, members, index)`` on the ranks of ``m`` (a collective along ``axes``)."""
    RAN.append(name)
    if RANK not in m.device_range:
        return
    group = CollectiveGroup.along(m, axes)
    members = group.members(RANK)
    run(tvm_ffi.Shape(group.encode()), members, members.index(RANK))


# ---------------------------------------------------------------------- collectives
def test_allreduce(m: DeviceMesh, axes, kind: str, dtype: str) -> None:
    name = f"allreduce-{kind}-{dtype}-mesh{m.shape}-axes{axes}"
    everyone = data(name, (m.size, 4, 6), dtype)  # device d contributes everyone[d - first]

    def run(group, members, _):
        out = empty(everyone.shape[1:], dtype)
        f = tvm.get_global_func(ccl.ALLREDUCE)
        f(tensor(everyone[RANK - m.device_range.start]), ccl.REDUCE_KINDS[kind], group, out)
        want = REDUCE[kind](everyone[[d - m.device_range.start for d in members]])
        check(name, out, want.astype(dtype))

    group_call(name, m, axes, run)


def test_allreduce_bits(m: DeviceMesh, kind: str, shape, dtype: str = "float32") -> None:
    """Floats whose sum depends on the order: the bits of a fold in member order."""
    name = f"allreduce-bits-{kind}-{dtype}-{shape}-mesh{m.shape}"
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    everyone = (rng.standard_normal((m.size, *shape))
                * 10.0 ** rng.integers(-4, 5, (m.size, *shape))).astype(dtype)
    if kind == "prod":
        everyone = (1 + everyone / 1e5).astype(dtype)

    def run(group, members, _):
        out = empty(shape, dtype)
        tvm.get_global_func(ccl.ALLREDUCE)(tensor(everyone[RANK]), ccl.REDUCE_KINDS[kind],
                                           group, out)
        fold = np.multiply if kind == "prod" else np.add
        want = everyone[members[0]]
        for d in members[1:]:
            want = fold(want, everyone[d])
        if kind == "avg":
            want = want / len(members)
        check(name, out, want.astype(dtype))

    group_call(name, m, (0,), run)


def test_reducescatter(m: DeviceMesh, axes, kind: str, dim: int, dtype: str = "float32") -> None:
    name = f"reducescatter-{kind}-dim{dim}-{dtype}-mesh{m.shape}-axes{axes}"
    everyone = data(name, (m.size, 4, 8, 4), dtype)
    if kind == "prod":
        everyone = np.abs(everyone) + 1  # products of small positive values stay exact

    def run(group, members, index):
        want = np.split(REDUCE[kind](everyone[[d - m.device_range.start for d in members]]),
                        len(members), axis=dim)[index].astype(dtype)
        out = empty(want.shape, dtype)
        for _ in range(2):  # twice: scratch reuse must not leak the first call's data
            tvm.get_global_func(ccl.REDUCE_SCATTER)(
                tensor(everyone[RANK - m.device_range.start]), ccl.REDUCE_KINDS[kind], group,
                tvm_ffi.Shape([dim]), out)
        check(name, out, want)

    group_call(name, m, axes, run)


def test_reducescatter_bits(m: DeviceMesh, kind: str, dim: int, shape) -> None:
    """Floats whose sum depends on the order: each block holds the bits of a fold in member
    order."""
    name = f"reducescatter-bits-{kind}-dim{dim}-{shape}-mesh{m.shape}"
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    everyone = (rng.standard_normal((m.size, *shape))
                * 10.0 ** rng.integers(-4, 5, (m.size, *shape))).astype("float32")

    def run(group, members, index):
        fold = np.multiply if kind == "prod" else np.add
        want = everyone[members[0]]
        for d in members[1:]:
            want = fold(want, everyone[d])
        if kind == "avg":
            want = want / len(members)
        want = np.split(want, len(members), axis=dim)[index]
        out = empty(want.shape, "float32")
        tvm.get_global_func(ccl.REDUCE_SCATTER)(tensor(everyone[RANK]), ccl.REDUCE_KINDS[kind],
                                                group, tvm_ffi.Shape([dim]), out)
        check(name, out, want)

    group_call(name, m, (0,), run)


def test_broadcast(m: DeviceMesh, axes, root: int, dtype: str = "float32") -> None:
    name = f"broadcast-root{root}-{dtype}-mesh{m.shape}-axes{axes}"
    everyone = data(name, (m.size, 4, 6), dtype)

    def run(group, members, _):
        out = empty(everyone.shape[1:], dtype)
        tvm.get_global_func(ccl.BROADCAST)(tensor(everyone[RANK - m.device_range.start]), group,
                                           tvm_ffi.Shape([root]), out)
        check(name, out, everyone[members[root] - m.device_range.start])

    group_call(name, m, axes, run)


def gathered(name: str, members, shape, dtype) -> np.ndarray:
    """The global array of one group (each group of a mesh has its own)."""
    return data(f"{name}-{members}", shape, dtype)


def test_allgather(m: DeviceMesh, axes, dim: int, dtype: str = "float32") -> None:
    name = f"allgather-dim{dim}-{dtype}-mesh{m.shape}-axes{axes}"

    def run(group, members, index):
        whole = gathered(name, members, (4, 8, 12), dtype)
        out = empty(whole.shape, dtype)
        block = np.split(whole, len(members), axis=dim)[index]
        for _ in range(2):  # twice: scratch reuse must not leak the first call's data
            tvm.get_global_func(ccl.ALLGATHER)(tensor(block), group, tvm_ffi.Shape([dim]), out)
        check(name, out, whole)

    group_call(name, m, axes, run)


def test_alltoall(m: DeviceMesh, axes, split: int, concat: int) -> None:
    name = f"alltoall-split{split}-concat{concat}-mesh{m.shape}-axes{axes}"

    def run(group, members, index):
        whole = gathered(name, members, (4, 8, 4), "float32")
        p = len(members)
        x = np.split(whole, p, axis=concat)[index]  # S[concat] -> S[split]
        want = np.split(whole, p, axis=split)[index]
        out = empty(want.shape, "float32")
        tvm.get_global_func(ccl.ALLTOALL)(tensor(x), group, tvm_ffi.Shape([split, concat]), out)
        check(name, out, want)

    group_call(name, m, axes, run)


def test_local_slice(m: DeviceMesh, axes, dim: int) -> None:
    name = f"local_slice-dim{dim}-mesh{m.shape}-axes{axes}"

    def run(group, members, index):
        whole = gathered(name, members, (4, 8, 12), "int32")
        want = np.split(whole, len(members), axis=dim)[index]
        out = empty(want.shape, "int32")
        tvm.get_global_func(ccl.LOCAL_SLICE)(tensor(whole), group, tvm_ffi.Shape([dim]), out)
        check(name, out, want)

    group_call(name, m, axes, run)


def test_allgather_bfloat16() -> None:
    """A dtype numpy lacks moves as raw 16-bit words."""
    name = "allgather-bfloat16"
    m = mesh((SIZE,))

    def run(group, members, index):
        bits = data(name, (2 * len(members), 3), "int64").astype("uint16") + 0x3F80
        x, out = empty((2, 3), "bfloat16"), empty(bits.shape, "bfloat16")
        np.from_dlpack(x._create_view((2, 3), "uint16"))[...] = bits[2 * index:2 * index + 2]
        tvm.get_global_func(ccl.ALLGATHER)(x, group, tvm_ffi.Shape([0]), out)
        check(name, np.from_dlpack(out._create_view(bits.shape, "uint16")), bits)

    group_call(name, m, (0,), run)


# ---------------------------------------------------------------------- send / recv
def test_move(src: str, src_mesh: DeviceMesh, dst: str, dst_mesh: DeviceMesh,
              shape=(8, 12, 4), dtype="float32") -> None:
    name = (f"move-{src}@{src_mesh.shape}:{src_mesh.device_range.start}->"
            f"{dst}@{dst_mesh.shape}:{dst_mesh.device_range.start}-{dtype}")
    RAN.append(name)
    spec = SendRecvSpec(tuple(shape), TensorSharding(src_mesh, Placement.parse(src)),
                        TensorSharding(dst_mesh, Placement.parse(dst)))
    role = spec.role(RANK)
    if role is None:
        return
    whole = data(name, shape, dtype)
    encoded = tvm_ffi.Shape(spec.encode())
    x = tensor(shard_array(whole, spec.src, RANK)) if role != "recv" else None
    want = shard_array(whole, spec.dst, RANK) if role != "send" else None
    out = empty(want.shape, dtype) if want is not None else None
    f = tvm.get_global_func(f"tvm_distx.ccl.{role}")
    result = {"send_recv": lambda: f(x, encoded, out), "send": lambda: f(x, encoded),
              "recv": lambda: f(encoded, out)}[role]()
    if role == "send" and result is not None:
        FAILURES.append(f"FAIL {name} rank {RANK}: send returned {result!r}")
    if want is not None:
        check(name, out, want)


# ---------------------------------------------------------------------- TVM's builtins
def test_disco_builtins() -> None:
    RAN.append("disco-builtins")
    everyone = data("disco", (SIZE, 4, 3))
    out = empty((4, 3), "float32")
    tvm.get_global_func("runtime.disco.allreduce")(tensor(everyone[RANK]), tvm_ffi.Shape([0]),
                                                   False, out)
    check("disco-allreduce-sum", out, everyone.sum(axis=0))
    out = empty((4 * SIZE, 3), "float32")
    tvm.get_global_func("runtime.disco.allgather")(tensor(everyone[RANK]), False, out)
    check("disco-allgather", out, everyone.reshape(4 * SIZE, 3))
    out = empty((4, 3), "float32")
    x = everyone[0] if RANK == 0 else np.zeros((4, 3), "float32")
    tvm.get_global_func("runtime.disco.broadcast_from_worker0")(tensor(x), False, out)
    check("disco-broadcast", out, everyone[0])
    x = everyone if RANK == 0 else np.zeros_like(everyone)
    tvm.get_global_func("runtime.disco.scatter_from_worker0")(tensor(x), False, out)
    check("disco-scatter", out, everyone[RANK])
    out = empty((4 * SIZE, 3), "float32") if RANK == 0 else empty((1,), "float32")
    tvm.get_global_func("runtime.disco.gather_to_worker0")(tensor(everyone[RANK]), False, out)
    if RANK == 0:
        check("disco-gather", out, everyone.reshape(4 * SIZE, 3))
    check("disco-worker-id", np.array(tvm.get_global_func("runtime.disco.worker_id")()),
          np.array([RANK]))


def test_real_disco_session_keeps_tvm_builtins() -> None:
    """A disco session started in a rank still reaches TVM's own functions, after any installs."""
    from tvm_distx.runtime import collectives
    from tvm_distx.runtime.disco_rank import repair_disco

    RAN.append("disco-session-not-shadowed")
    repair_disco()  # the pinned wheel's tvm.runtime.disco needs it before use
    disco = sys.modules["tvm.runtime.disco"]
    kept = dict(collectives._TVM_DISPATCHERS)
    assert set(kept) == {ccl.DISCO_PREFIX + name for name in ccl.DISCO_BUILTINS}, kept
    mpi_ccl.install()  # again: idempotent, TVM's functions are kept, never ours wrapped
    assert collectives._TVM_DISPATCHERS == kept
    session = disco.ThreadedSession(num_workers=3)
    ids = session.get_global_func("runtime.disco.worker_id")()
    got = np.array([ids.debug_get_from_remote(w)[0] for w in range(3)])
    check("disco-session-worker-id", got, np.arange(3))  # TVM's workers, not this rank
    session.shutdown()
    check("disco-worker-id-after", np.array(tvm.get_global_func("runtime.disco.worker_id")()),
          np.array([RANK]))


# ---------------------------------------------------------------------- errors
def expect_error(name: str, call, words: str) -> None:
    """``call`` must raise at once (no communication) with ``words`` in its message."""
    RAN.append(name)
    try:
        call()
    except Exception as err:  # noqa: BLE001 - crossing TVM's FFI keeps only the message
        if words not in str(err):
            FAILURES.append(f"FAIL {name} rank {RANK}: wrong message {err}")
        return
    FAILURES.append(f"FAIL {name} rank {RANK}: no error")


def test_errors() -> None:
    outsider = CollectiveGroup.along(mesh((1,), first=SIZE - 1), (0,))  # only the last rank
    x, out = tensor(np.ones(4, "float32")), empty((4,), "float32")
    allreduce = tvm.get_global_func(ccl.ALLREDUCE)
    if RANK != SIZE - 1:
        expect_error("error-not-in-group",
                     lambda: allreduce(x, 0, tvm_ffi.Shape(outsider.encode()), out),
                     "only the mesh's ranks may call it")
    too_big = CollectiveGroup.along(mesh((SIZE + 1,)), (0,))
    expect_error("error-mesh-too-big",
                 lambda: allreduce(x, 0, tvm_ffi.Shape(too_big.encode()), out),
                 f"launch it with at least {SIZE + 1}")
    world = CollectiveGroup.along(mesh((SIZE,)), (0,))
    expect_error("error-shape", lambda: tvm.get_global_func(ccl.ALLGATHER)(
        x, tvm_ffi.Shape(world.encode()), tvm_ffi.Shape([0]), out), "expected a tensor of shape")
    # rank 0 only sends in a pipeline move: calling recv is a lowering bug
    spec = SendRecvSpec((4,), TensorSharding(mesh((1,)), Placement.parse("R")),
                        TensorSharding(mesh((1,), first=1), Placement.parse("R")))
    if RANK == 0:
        expect_error("error-wrong-role", lambda: tvm.get_global_func(ccl.RECV)(
            tvm_ffi.Shape(spec.encode()), out), "must call tvm_distx.ccl.send")


# ---------------------------------------------------------------------- the cases
def main() -> None:
    world = mesh((SIZE,))
    for kind in REDUCE:
        test_allreduce(world, (0,), kind, "float32")
    for dtype in ("float16", "float64", "int32", "int64"):
        test_allreduce(world, (0,), "sum", dtype)
    test_allreduce(world, (0,), "avg", "int32")
    for kind in ("sum", "avg", "prod"):  # bitwise, as every backend folds
        for shape in ((5, 7), (256, 1030)):  # not divisible by the ranks; large
            test_allreduce_bits(world, kind, shape)
    test_allreduce_bits(world, "sum", (3, 3), "float64")
    for dim in (0, 1, 2):
        test_allgather(world, (0,), dim)
        test_local_slice(world, (0,), dim)
    for dtype in ("float16", "float64", "int32", "int64"):
        test_allgather(world, (0,), 1, dtype)
    for split, concat in ((1, 0), (0, 1), (2, 0), (0, 2), (2, 1), (1, 2)):
        test_alltoall(world, (0,), split, concat)
    for kind in REDUCE:
        for dim in (0, 1, 2):
            test_reducescatter(world, (0,), kind, dim)
    for dtype in ("float16", "float64", "int32", "int64"):
        test_reducescatter(world, (0,), "sum", 1, dtype)
    test_reducescatter(world, (0,), "avg", 2, "int32")
    for kind in ("sum", "avg", "prod"):  # bitwise, as every backend folds
        for dim, shape in ((0, (4, 7)), (1, (3, 256, 1030))):
            test_reducescatter_bits(world, kind, dim, shape)
    for root in range(SIZE):
        test_broadcast(world, (0,), root)
    test_broadcast(world, (0,), SIZE - 1, "int64")
    test_allgather_bfloat16()
    test_disco_builtins()
    test_real_disco_session_keeps_tvm_builtins()
    if needs(4):
        grid = mesh((2, 2))
        for axes in ((0,), (1,), (0, 1)):
            for kind in ("sum", "max"):
                test_allreduce(grid, axes, kind, "float32")
            for dim in (0, 1, 2):
                test_allgather(grid, axes, dim)
            test_local_slice(grid, axes, 1)
            test_alltoall(grid, axes, 2, 0)
            for dim in (0, 1, 2):
                test_reducescatter(grid, axes, "sum", dim)
            test_reducescatter(grid, axes, "max", 1, "int32")
            test_reducescatter(grid, axes, "sum", 2, "float16")
            test_broadcast(grid, axes, 1)
        # a mesh on some of the ranks only, and a 1-D mesh that is not the world
        test_allreduce(mesh((2,), first=2), (0,), "sum", "float32")
        test_reducescatter(mesh((2,), first=2), (0,), "sum", 1)
        test_allgather(mesh((2,), first=1), (0,), 1)

    # send/recv on one mesh, then between meshes
    test_move("S[0]", world, "S[1]", world)
    test_move("S[1]", world, "S[2]", world, dtype="float16")
    test_move("S[2]", world, "R", world, dtype="int64")
    test_move("R", mesh((1,)), "R", mesh((1,), first=1))  # pipeline: stage 0 -> stage 1
    test_move("S[0]", mesh((1,), first=1), "S[0]", mesh((1,)), dtype="int32")  # and back
    test_move("S[1]", world, "R", mesh((1,), first=SIZE - 1))  # gather onto the last rank
    if needs(4):
        grid = mesh((2, 2))
        test_move("S[0]S[1]", grid, "S[1]S[0]", grid)
        test_move("S[2]S[1]", grid, "RS[0]", grid, dtype="float64")
        test_move("S[0]", mesh((2,)), "S[1]", mesh((2,), first=2))  # disjoint stages
        test_move("R", mesh((2,)), "RS[2]", grid)  # overlapping meshes
        test_move("S[1]", mesh((2,)), "S[0]", mesh((2,), first=1))  # share device 1
        test_move("S[0]S[2]", grid, "S[1]", mesh((2,), first=1), dtype="int32")
    test_errors()

    bad = COMM.allreduce(len(FAILURES))
    if bad:
        sys.exit(1)
    if RANK == 0:
        print(f"MPI-CCL OK {len(RAN)} cases on {SIZE} ranks", flush=True)


if __name__ == "__main__":
    try:
        main()
    except SystemExit:
        raise
    except BaseException:  # a rank that dies mid-collective would leave the others waiting
        sys.stderr.write(f"rank {RANK} raised:\n{traceback.format_exc()}")
        sys.stderr.flush()
        COMM.Abort(2)
