"""Collectives on 2 ranks: ours over MPI (via the VM), mpi4py, our disco shared memory, gloo.

Measured for all-reduce (sum), all-gather and all-to-all of float32 buffers of
1, 4, 16 and 64 MiB **per rank** (the size of each rank's input; an all-gather's
output is twice that), on 2 ranks of this host:

(a) **ours, MPI, through the VM**: a tiny Relax module whose functions call
    ``R.call_dps_packed("tvm_distx.ccl.allreduce" | "allgather" | "alltoall", ...)``
    with the argument encodings of :mod:`tvm_distx.ccl` (the calls our lowering
    emits), built for the host; :func:`tvm_distx.runtime.mpi_ccl.install` runs
    before the ``relax.VirtualMachine`` is created, as in our MPI worker. Each
    call includes what a lowered program pays: the VM's dispatch and the
    allocation of the output by the VM's (pooled) allocator.
(a') **the same, into a fixed output**: the call writes into a tensor the caller
    passes (an impure ``call_packed``), as a collective whose result is an
    intermediate of a lowered program writes into memory the VM's planner reuses
    from call to call. In (a) the collective's result is the function's result:
    the VM keeps the previous result in a register until the next call returns,
    so consecutive calls alternate between two output buffers, and at 4 MiB two
    buffers no longer sit in the caches as one does (raw mpi4py alternating two
    outputs is as much slower).
(b'') **raw mpi4py alternating two output buffers**, as (a) does.
(b) **raw mpi4py** ``Allreduce`` / ``Allgather`` / ``Alltoall`` on preallocated
    numpy buffers, in the same processes; and (b') the same calls on buffers
    allocated by TVM (``tvm.runtime.empty``, viewed through DLPack), which
    isolates what the memory costs from what our code costs.
(c) **our disco shared-memory collectives** (:mod:`tvm_distx.runtime.disco_shm`):
    the same Relax module in a second VM created after
    :func:`tvm_distx.runtime.disco_shm.install`, over a :class:`ShmComm` on one
    ``memfd`` segment with the slot size that ``run_disco`` uses (rank 0 creates
    it, rank 1 maps it through ``/proc/<pid>/fd``, since here ``mpiexec`` rather
    than disco started the processes). It is exactly what a disco worker runs,
    minus disco's start-up.
(d) **torch.distributed gloo** over TCP on 127.0.0.1: ``all_reduce`` (in place,
    as gloo does it), ``all_gather_into_tensor`` and ``all_to_all_single`` on
    preallocated tensors.

The all-to-all moves a ``(1, n)`` block to ``(2, n / 2)`` (split along
dimension 1, concatenate along 0), a layout that needs no packing on any side.

All four run in the same two processes, started by ``mpiexec -n 2`` (the
``mpich`` wheel's). A *sample* is ``k`` back-to-back calls between two MPI
barriers, timed on every rank, the slowest rank counting; ``k`` grows as the
size shrinks. Each round takes one sample of every contender for every size and
collective, in an order that rotates from round to round; the tables show
medians over the rounds, and ratios as the median of per-round ratios. Every
contender's output is checked against numpy first.

Both processes start with the environment our launcher gives every rank
(:func:`tvm_distx.runtime.rank_env.rank_environment`), which adds
``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``: numpy asks for transparent huge pages
for its large buffers (``madvise``), TVM's allocator does not, and on a host
whose huge pages are ``madvise``-only MPI moves data between 4 KiB pages
markedly slower; with the tunable glibc's ``malloc`` asks for huge pages too, so
the VM's tensors get them as well. To show what that setting is worth, (a) and
(b) run once more in a second job without it (``TVM_DISTX_HUGEPAGES=0``);
``--no-plain`` skips that job.

**Across hosts** (``--hosts``, as root): the script brings up 2 test hosts
(``scripts/testhosts``, docs/testhosts.md: network namespaces on this machine,
between which MPICH goes over TCP) and runs the same rank job for (a) and (b)
in turns: ``mpiexec -n 2`` on this host (shared memory between the ranks), and
``mpiexec -n 2`` with one rank on each test host (TCP over a veth pair and a
bridge), ``--jobs`` times each. The table beside the two gives the ratio (the
median of the ratios of jobs run one after the other) and the effective
bandwidth: each rank's input bytes over the time, which for 2 ranks is the
bytes every rank sends (NCCL's "bus bandwidth"). The test hosts share this
machine's cores and memory: TCP between namespaces measures the network stack,
not a wire.

Usage::

    python scripts/bench/collectives.py                       # both jobs, 7 rounds
    python scripts/bench/collectives.py --sizes 1 4 --rounds 3
    python scripts/bench/collectives.py --hosts --sizes 1 16 --rounds 3   # across test hosts
    mpiexec -n 2 python scripts/bench/collectives.py --rank-job out.json   # one job (internal)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (child_env, end_rank_job, free_port, median, spread, table,  # noqa: E402
                     test_hosts)

from tvm_distx.runtime.mpi import mpiexec_path  # noqa: E402

SIZES_MIB = [1, 4, 16, 64]
OPS = ["allreduce", "allgather", "alltoall"]
#: The collectives and contenders of ``--hosts`` (shared memory and gloo are single-host).
HOST_OPS = ["allreduce", "allgather"]
HOST_CONTENDERS = ["vm", "raw"]
CONTENDERS = ["vm", "vminto", "raw", "shm", "gloo", "rawtvm", "raw2"]
LABELS = {"vm": "(a) ours MPI via VM", "vminto": "(a') ours MPI via VM, fixed output",
          "raw": "(b) mpi4py", "shm": "(c) ours disco shm",
          "gloo": "(d) gloo", "rawtvm": "(b') mpi4py on TVM buffers",
          "raw2": "(b'') mpi4py, two outputs in turn"}


# ---------------------------------------------------------------------- inside the ranks
def _module(world: int, sizes: list[int]):
    """The Relax module calling our collectives, one function per collective and size."""
    import tvm
    from tvm import relax

    from tvm_distx import ccl
    from tvm_distx.ccl import CollectiveGroup

    group = relax.ShapeExpr(CollectiveGroup((world,), 0, (0,)).encode())
    bb = relax.BlockBuilder()
    for mib in sizes:
        n = mib * (1 << 20) // 4
        flat = relax.Var("x", relax.TensorType((n,), "float32"))
        calls = {
            "allreduce": (flat, ccl.ALLREDUCE, [flat, relax.prim_value(0), group], (n,)),
            "allgather": (flat, ccl.ALLGATHER, [flat, group, relax.ShapeExpr([0])],
                          (world * n,)),
        }
        row = relax.Var("x", relax.TensorType((1, n), "float32"))
        calls["alltoall"] = (row, ccl.ALLTOALL, [row, group, relax.ShapeExpr([1, 0])],
                             (world, n // world))
        for op, (param, name, args, shape) in calls.items():
            with bb.function(f"{op}_{mib}", [param]):
                out = bb.emit(relax.call_dps_packed(name, relax.Tuple(args),
                                                    out_ty=relax.TensorType(shape, "float32")))
                bb.emit_func_output(out)
            # the same call writing into a caller's tensor (as into planned memory)
            into = relax.Var("out", relax.TensorType(shape, "float32"))
            with bb.function(f"{op}_{mib}_into", [param, into], pure=False):
                bb.emit(relax.Call(relax.ExternFunc(name), [*args, into],
                                   ty_args=[relax.ObjectType()]))
                bb.emit_func_output(into)
    return tvm.compile(bb.get(), target=tvm.target.Target({"kind": "llvm"}))


def _shm_comm(comm):
    """A :class:`ShmComm` of this rank on a memfd segment laid out as ``run_disco`` does."""
    import mmap

    from tvm_distx.runtime.disco import _SLOT_BYTES, _segment
    from tvm_distx.runtime.disco_shm import Layout, ShmComm

    layout = Layout(comm.Get_size(), _SLOT_BYTES, 0)
    path = None
    if comm.Get_rank() == 0:
        path = f"/proc/{os.getpid()}/fd/{_segment(layout.size)}"
    path = comm.bcast(path)
    fd = os.open(path, os.O_RDWR)
    buf = mmap.mmap(fd, layout.size)
    comm.Barrier()  # rank 1 has mapped it before anyone moves on
    return ShmComm(buf, layout, comm.Get_rank(), time.time() + 3600)


def rank_job(out_path: str, sizes: list[int], rounds: int, contenders: list[str],
             ops: list[str] = OPS) -> None:
    """One MPI job: every contender, every size and collective of ``ops``, ``rounds`` times."""
    import warnings

    import numpy as np
    from mpi4py import MPI

    import tvm
    from tvm import relax

    from tvm_distx.runtime import disco_shm, mpi_ccl

    warnings.filterwarnings("ignore")
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    exe = _module(world, sizes)
    vms = {}
    if {"vm", "vminto"} & set(contenders):
        mpi_ccl.install(comm)  # before the VM: it resolves its functions once
        vms["vm"] = relax.VirtualMachine(exe, tvm.cpu())
    shm = None
    if "shm" in contenders:
        shm = _shm_comm(comm)
        disco_shm.install(shm)
        vms["shm"] = relax.VirtualMachine(exe, tvm.cpu())
    dist = None
    if "gloo" in contenders:
        import torch
        import torch.distributed as dist

        port = comm.bcast(free_port() if rank == 0 else None)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)

    def sample(fn, reps: int) -> float:
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        elapsed = (time.perf_counter() - start) / reps
        comm.Barrier()
        return comm.allreduce(elapsed, op=MPI.MAX)

    cases = []  # (mib, op, {contender: (call, check)})
    keep = []
    for mib in sizes:
        n = mib * (1 << 20) // 4
        everyone = [(np.arange(n, dtype=np.float32) % 1000) * (r + 1) for r in range(world)]
        x = everyone[rank]
        want = {"allreduce": sum(everyone), "allgather": np.concatenate(everyone),
                "alltoall": np.stack([np.split(e, world)[rank] for e in everyone])}
        outs = {"allreduce": np.empty(n, np.float32),
                "allgather": np.empty(world * n, np.float32),
                "alltoall": np.empty(n, np.float32)}
        tx, trow = tvm.runtime.tensor(x), tvm.runtime.tensor(x.reshape(1, n))
        keep += [tx, trow, outs]
        for op in ops:
            arg = trow if op == "alltoall" else tx
            fns = {}  # contender: (one call, its output after the call)
            for key, vm in vms.items():
                func = vm[f"{op}_{mib}"]
                fns[key] = (lambda f=func, a=arg: f(a), lambda result: result.numpy())
            if "vminto" in contenders:
                func = vms["vm"][f"{op}_{mib}_into"]
                fixed = tvm.runtime.empty(outs[op].shape if op != "alltoall"
                                          else (world, n // world), "float32")
                keep.append(fixed)
                fns["vminto"] = (lambda f=func, a=arg, o=fixed: f(a, o),
                                 lambda result: result.numpy())
            out = outs[op]
            mpi_op = {"allreduce": comm.Allreduce, "allgather": comm.Allgather,
                      "alltoall": comm.Alltoall}[op]
            if "raw" in contenders:
                fns["raw"] = (lambda f=mpi_op, i=x, o=out: f(i, o), lambda _, o=out: o)
            if "raw2" in contenders:  # what (a) does: two output buffers in turn
                turns = [out, np.empty_like(out)]
                keep.append(turns)

                def alternate(f=mpi_op, i=x, o=turns):
                    o.reverse()
                    f(i, o[0])

                fns["raw2"] = (alternate, lambda _, o=turns: o[0])
            if "rawtvm" in contenders:
                tvm_in = np.from_dlpack(tx)
                tvm_out = np.from_dlpack(tvm.runtime.empty(out.shape, "float32"))
                keep.append(tvm_out)
                fns["rawtvm"] = (lambda f=mpi_op, i=tvm_in, o=tvm_out: f(i, o),
                                 lambda _, o=tvm_out: o)
            if dist is not None:
                import torch

                # its own output; gloo reduces in place: start from x for the check
                t_in = torch.from_numpy(x)
                t_out = torch.from_numpy(x.copy() if op == "allreduce" else np.empty_like(out))
                keep.append(t_out)
                gloo_op = {"allreduce": lambda o=t_out: dist.all_reduce(o),
                           "allgather": lambda i=t_in, o=t_out: dist.all_gather_into_tensor(o, i),
                           "alltoall": lambda i=t_in, o=t_out: dist.all_to_all_single(o, i)}[op]
                fns["gloo"] = (gloo_op, lambda _, o=t_out: o.numpy())
            for key, (fn, read) in fns.items():  # warm up, and check the numbers
                got = read(fn())
                if not np.array_equal(got.reshape(-1), want[op].reshape(-1)):
                    raise SystemExit(f"rank {rank}: {key} {op} {mib} MiB gives wrong numbers")
            cases.append((mib, op, {k: f for k, (f, _) in fns.items()}))

    if shm is not None and "vm" in vms:  # the MPI VM must not have picked up the shm functions
        disco_shm.install(None)
        vms["vm"][f"allreduce_{sizes[0]}"](keep[0])
        disco_shm.install(shm)

    times: dict[str, list[float]] = {}
    order = [c for c in CONTENDERS if c in contenders]
    for r in range(rounds):
        rotated = order[r % len(order):] + order[:r % len(order)]
        for mib, op, fns in cases:
            reps = max(2, 32 // mib)
            for key in rotated:
                times.setdefault(f"{key} {op} {mib}", []).append(sample(fns[key], reps))
    if dist is not None:
        dist.destroy_process_group()
    if rank == 0:
        Path(out_path).write_text(json.dumps(times))


# ---------------------------------------------------------------------- the controller
def run_job(sizes, rounds, contenders, hugepages: bool, timeout: float,
            ops: list[str] = OPS, where: list[str] = (), folder: str | None = None) -> dict:
    """Start one 2-rank MPI job of :func:`rank_job` in the environment our launcher
    gives ranks (``hugepages=False``: without its huge-page tunable); returns its samples.

    ``where`` goes to ``mpiexec`` before the program (``-hosts`` and a launcher);
    ``folder`` holds rank 0's JSON (one that rank 0's host sees, too).
    """
    from tvm_distx.runtime.rank_env import HUGEPAGES_ENV, rank_environment

    with tempfile.TemporaryDirectory(prefix="tvm-distx-bench-", dir=folder) as tmp:
        os.chmod(tmp, 0o755)
        out = Path(tmp) / "times.json"
        command = [mpiexec_path(), "-n", "2", *where, sys.executable,
                   str(Path(__file__).resolve()), "--rank-job", str(out), "--rounds", str(rounds),
                   "--sizes", *map(str, sizes), "--contenders", *contenders, "--ops", *ops]
        env = rank_environment(child_env(TVM_NUM_THREADS="1", OMP_NUM_THREADS="1"),
                               {HUGEPAGES_ENV: "1" if hugepages else "0"})
        done = subprocess.run(command, env=env, timeout=timeout, capture_output=True, text=True)
        if done.returncode != 0 or not out.exists():
            sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
            raise SystemExit(f"the MPI job failed with exit code {done.returncode}")
        return json.loads(out.read_text())


def _ms(values) -> str:
    return f"{median(values) * 1e3:.2f}"


def report(times: dict, plain: dict | None, sizes: list[int]) -> str:
    main_rows, ratio_rows = [], []
    for op in OPS:
        for mib in sizes:
            t = {c: times[f"{c} {op} {mib}"] for c in CONTENDERS if f"{c} {op} {mib}" in times}
            row = [op, f"{mib} MiB"] + [_ms(t[c]) if c in t else "-" for c in CONTENDERS]
            main_rows.append(row)
            ratios = [op, f"{mib} MiB"]
            for fast, slow in (("vm", "raw"), ("vminto", "raw"), ("vm", "rawtvm"), ("raw2", "raw"),
                               ("shm", "gloo"), ("shm", "raw")):
                if fast in t and slow in t:
                    per_round = [b / a for a, b in zip(t[fast], t[slow])]
                    ratios.append(f"{median(per_round):.2f} ({spread(per_round)})")
                else:
                    ratios.append("-")
            if plain is not None:
                h = {c: plain[f"{c} {op} {mib}"] for c in ("vm", "raw")}
                per_round = [b / a for a, b in zip(h["vm"], h["raw"])]
                ratios += [_ms(h["vm"]), _ms(h["raw"]),
                           f"{median(per_round):.2f} ({spread(per_round)})"]
            ratio_rows.append(ratios)
    out = ["Milliseconds per call, 2 ranks, float32, size = each rank's input (medians):", "",
           table(["collective", "size"] + [LABELS[c] for c in CONTENDERS], main_rows), "",
           "Speed ratios (time of the second / time of the first; > 1: the first is faster):",
           ""]
    headers = ["collective", "size", "(a) vs (b): mpi4py / ours MPI",
               "(a') vs (b): mpi4py / ours MPI, fixed output",
               "(a) vs (b'): mpi4py on TVM buffers / ours MPI",
               "(b'') vs (b): one output / two in turn",
               "(c) vs (d): gloo / disco shm", "(c) vs (b): mpi4py / disco shm"]
    if plain is not None:
        headers += ["(a) ms, plain malloc", "(b) ms, plain malloc",
                    "(a) vs (b), plain malloc: mpi4py / ours MPI"]
    out.append(table(headers, ratio_rows))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=SIZES_MIB, help="MiB per rank")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--contenders", nargs="*", default=CONTENDERS, choices=CONTENDERS)
    parser.add_argument("--no-plain", action="store_true",
                        help="skip the second MPI job, without the launcher's huge-page tunable")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per MPI job")
    parser.add_argument("--json", help="also write every sample to this JSON file")
    parser.add_argument("--hosts", action="store_true",
                        help="(a) and (b) on 2 test hosts (TCP) beside one host (shared memory); "
                             "needs root")
    parser.add_argument("--jobs", type=int, default=3,
                        help="with --hosts: jobs on each side, in turns")
    parser.add_argument("--ops", nargs="*", default=OPS, choices=OPS, help=argparse.SUPPRESS)
    parser.add_argument("--rank-job", metavar="JSON", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.rank_job:
        rank_job(opts.rank_job, opts.sizes, opts.rounds, opts.contenders, opts.ops)
        if "gloo" in opts.contenders:
            end_rank_job()
        return 0
    if opts.hosts:
        return across_hosts(opts)

    started = time.perf_counter()
    times = run_job(opts.sizes, opts.rounds, opts.contenders, True, opts.timeout)
    plain = None
    if not opts.no_plain and {"vm", "raw"} <= set(opts.contenders):
        plain = run_job(opts.sizes, opts.rounds, ["vm", "raw"], False, opts.timeout)
    print(f"2 ranks under mpiexec on {os.cpu_count()} cores, {opts.rounds} rounds "
          f"({time.perf_counter() - started:.0f} s)\n")
    print(report(times, plain, opts.sizes))
    if opts.json:
        Path(opts.json).write_text(json.dumps({"sizes": opts.sizes, "times": times,
                                               "plain_malloc": plain}))
    return 0


# ---------------------------------------------------------------------- across test hosts
def across_hosts(opts) -> int:
    """``--hosts``: (a) and (b) on one host and on 2 test hosts, jobs in turns; prints the table."""
    contenders = [c for c in HOST_CONTENDERS if c in opts.contenders] or HOST_CONTENDERS
    started = time.perf_counter()
    jobs: dict[str, list[dict]] = {"one": [], "two": []}
    with test_hosts(2) as hosts:
        names = hosts["TESTHOSTS_NAMES"].split(",")
        where = {"one": [], "two": ["-hosts", ",".join(names), "-launcher", "ssh",
                                    "-launcher-exec", hosts["TESTHOSTS_RSH"]]}
        for j in range(opts.jobs):
            for side in ("one", "two") if j % 2 == 0 else ("two", "one"):
                jobs[side].append(run_job(opts.sizes, opts.rounds, contenders, True, opts.timeout,
                                          HOST_OPS, where[side], hosts["TESTHOSTS_SHARED"]))
                print(f"  job {j + 1}: {side} host{'s' if side == 'two' else ''} done",
                      file=sys.stderr, flush=True)
    print(f"2 ranks under mpiexec on {os.cpu_count()} cores: on this host, and one on each of "
          f"2 test hosts ({', '.join(names)}); {opts.jobs} jobs on each side in turns, "
          f"{opts.rounds} rounds each ({time.perf_counter() - started:.0f} s)\n")
    print(hosts_report(jobs, contenders, opts.sizes))
    if opts.json:
        Path(opts.json).write_text(json.dumps({"sizes": opts.sizes, "jobs": jobs}))
    return 0


def hosts_report(jobs: dict[str, list[dict]], contenders: list[str], sizes: list[int]) -> str:
    """The table of :func:`across_hosts`: medians over every job's samples, ratios per job pair."""
    rows = []
    for op in HOST_OPS:
        for mib in sizes:
            for c in contenders:
                key = f"{c} {op} {mib}"
                one = [t for job in jobs["one"] for t in job[key]]
                two = [t for job in jobs["two"] for t in job[key]]
                pairs = [median(b[key]) / median(a[key]) for a, b in zip(jobs["one"], jobs["two"])]
                rate = [mib * (1 << 20) / t / 1e9 for t in (median(one), median(two))]
                rows.append((op, f"{mib} MiB", LABELS[c], _ms(one), _ms(two),
                             f"{median(pairs):.2f} ({spread(pairs)})",
                             f"{rate[0]:.2f}", f"{rate[1]:.2f}"))
    return "\n".join([
        "Milliseconds per call, 2 ranks, float32, size = each rank's input (medians); ratio = "
        "two hosts / one host (median of job pairs, min-max); GB/s = each rank's input bytes "
        "per second (what each rank sends, for 2 ranks):", "",
        table(["collective", "size", "contender", "one host (shm) ms", "two hosts (TCP) ms",
               "ratio", "one host GB/s", "two hosts GB/s"], rows, "lllrrrrr")])


if __name__ == "__main__":
    sys.exit(main())
