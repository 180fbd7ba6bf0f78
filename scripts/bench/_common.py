"""Helpers shared by the benchmarks of ``scripts/bench/`` (not a benchmark itself).

Every benchmark prints markdown tables of medians and of ratios measured side by
side in one run; these helpers keep that output uniform.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
from pathlib import Path
from typing import Iterable, Iterator, NoReturn, Sequence

#: The repository root (so the benchmarks run from a checkout without installing).
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def median(values: Iterable[float]) -> float:
    """The median of ``values``."""
    return statistics.median(list(values))


def spread(values: Sequence[float]) -> str:
    """``"min-max"`` of ratios, two decimals."""
    return f"{min(values):.2f}-{max(values):.2f}"


def table(headers: Sequence[str], rows: Iterable[Sequence], align: str | None = None) -> str:
    """A markdown table; ``align`` has one character per column: ``l`` or ``r``."""
    align = align or "l" + "r" * (len(headers) - 1)
    rule = ["---" if a == "l" else "---:" for a in align]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(rule) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a torch.distributed rendezvous)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child Python, with the repository importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def fmt_bytes(n: float) -> str:
    """Bytes as B, KiB or MiB with up to two decimals."""
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f}".rstrip("0").rstrip(".") + f" {unit}"
    return f"{n:.0f} B"


def end_rank_job() -> NoReturn:
    """Leave a benchmark rank process that used torch's gloo, its results written.

    At interpreter exit, the threads of a destroyed gloo process group sometimes
    reach ``std::terminate`` ("terminate called without an active exception",
    SIGABRT): measured in 3 of 25 two-rank jobs here, every time after the
    results were written. So a rank job finalizes MPI if it uses it, flushes,
    and ends with ``os._exit(0)`` instead of the interpreter's teardown.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    os._exit(0)


def run_job(key: str, command: list[str], env: dict, out: Path, timeout: float) -> dict:
    """Run one benchmark job and read the JSON it writes to ``out``.

    A job that fails (or writes nothing) stops the benchmark with its output's tail.
    """
    import json
    import subprocess

    done = subprocess.run(command, env=env, timeout=timeout, capture_output=True, text=True)
    if done.returncode != 0 or not out.exists():
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise SystemExit(f"{key} failed with exit code {done.returncode}")
    return json.loads(out.read_text())


def time_samples(call, barrier, slowest, samples: int, calls: int,
                 warmup: int = 2) -> list[float]:
    """Seconds per call of ``call``: ``samples`` samples of ``calls`` back-to-back calls.

    ``barrier`` lines the ranks up before and after each sample, and ``slowest``
    turns one rank's time into the slowest rank's (identity in one process).
    """
    import time

    for _ in range(warmup):
        call()
    out = []
    for _ in range(samples):
        barrier()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        elapsed = (time.perf_counter() - start) / calls
        barrier()
        out.append(slowest(elapsed))
    return out


def bundle_rank_call(bundle: str, inputs: dict, comm, *, with_signature: bool = False):
    """This MPI rank's entry of a bundle, ready to call: ``(function, arguments)``.

    Reads the bundle as our MPI ranks do (:mod:`tvm_distx.runtime.mpi_rank`):
    its manifest, this rank's weight shards, and the MPI collectives installed
    before the VM resolves its functions. ``inputs`` holds the global value of
    every parameter that is not a weight, by name; each rank takes its shard.
    ``with_signature`` adds the function's global signature to the result.
    """
    import numpy as np
    import tvm
    from tvm import relax

    from tvm_distx.bundle.manifest import read_manifest
    from tvm_distx.runtime import mpi_ccl, shard_array

    rank = comm.Get_rank()
    manifest = read_manifest(bundle)
    signature = manifest.function("main")
    entry = manifest.entry("main", rank)
    mpi_ccl.install(comm)  # before the VM: it resolves its functions once
    stored = {w.name for w in manifest.files_of(rank)}
    args = []
    for spec in signature.params:
        value = (manifest.read_weight(rank, spec.name) if spec.name in stored
                 else shard_array(inputs[spec.name], spec.sharding, rank))
        args.append(tvm.runtime.tensor(np.ascontiguousarray(value)))
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(manifest.library_path)), tvm.cpu())
    if with_signature:  # to assemble results split across the ranks
        return vm[entry], args, signature
    return vm[entry], args


def unscheduled_kernels(built) -> list[str]:
    """The kernels of a compiled module that none of our rules scheduled (TVM's default build).

    A benchmark warns about each: its figures would then measure TVM's naive loops.
    """
    from tvm_distx.compiler.schedule import RULE_ATTR
    import tvm

    return sorted(gv.name_hint for gv, f in built.functions.items()
                  if isinstance(f, tvm.tirx.PrimFunc)
                  and (f.attrs is None or RULE_ATTR not in f.attrs))


def llama_parameters(config: dict) -> int:
    """The parameter count of the Llama of ``config`` (untied LM head, no biases)."""
    hidden, ffn, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = hidden * config["num_key_value_heads"] // config["num_attention_heads"]
    layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * ffn + 2 * hidden
    return config["num_hidden_layers"] * layer + 2 * vocab * hidden + hidden


#: The test-host ids the benchmarks take (the test suite takes 100-199, users the small ones).
BENCH_HOST_IDS = range(200, 256)


@contextlib.contextmanager
def test_hosts(count: int = 2) -> Iterator[dict[str, str]]:
    """``count`` test hosts (``scripts/testhosts``, docs/testhosts.md) for the ``with`` block.

    Takes the first id of :data:`BENCH_HOST_IDS` whose lock file
    (``/run/lock/tvm-distx-testhosts-K.lock``, as the test suite's) no one holds,
    brings the hosts up and yields the variables of ``scripts/testhosts env``
    (``TESTHOSTS_NAMES``, ``TESTHOSTS_RSH``, ``TESTHOSTS_SHARED``, ...); they go
    down at the block's end, whatever happens in it. The hosts see the checkout and the
    Python that runs this (``--share``) at their paths. Needs root.
    """
    import fcntl
    import shlex
    import subprocess

    script = str(ROOT / "scripts" / "testhosts")

    def testhosts(*args: str) -> str:
        done = subprocess.run([script, *args], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise SystemExit(f"scripts/testhosts {shlex.join(args)} failed: "
                             f"{done.stderr.strip() or done.stdout.strip()}")
        return done.stdout

    locks = Path("/run/lock")
    locks.mkdir(parents=True, exist_ok=True)
    for k in BENCH_HOST_IDS:
        fd = os.open(locks / f"tvm-distx-testhosts-{k}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        break
    else:
        raise SystemExit(f"every test-host id in {BENCH_HOST_IDS} is taken")
    try:
        testhosts("down", f"--id={k}")  # whatever a killed run left behind
        try:
            # the Python that runs the benchmark, seen by the hosts wherever it is
            testhosts("up", str(count), f"--id={k}", f"--share={sys.prefix}",
                      f"--share={sys.base_prefix}")
            yield dict(shlex.split(line)[0].split("=", 1)
                       for line in testhosts("env", f"--id={k}").splitlines())
        finally:
            testhosts("down", f"--id={k}")
    finally:
        os.close(fd)
