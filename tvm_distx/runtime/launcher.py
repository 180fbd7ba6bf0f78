"""Launching a bundle on MPI ranks: ``mpiexec -n N python -m tvm_distx.runtime.worker``.

:func:`launch` reads only the bundle's manifest to set everything up. Before
any rank starts it checks the rank count and every weight file (see
:func:`tvm_distx.bundle.manifest.check_weights`), cuts the global inputs into each
rank's shards in a private job directory (``tempfile``; for a function lowered
by TVM's ``LowerDistIR``, whose feed is ``"worker0"``, rank 0 gets the global
inputs and the other ranks none, see :mod:`tvm_distx.bundle.signature`), and then runs
``mpiexec`` from the ``mpich`` wheel (or ``mpiexec=``). Across hosts the same
call takes ``hosts=["node0", "node1"]``, which becomes ``mpiexec -hosts
node0,node1``; the bundle and the job directory must then be on a shared
file system, or at the same path on every host.

Failures stop the whole job and raise :class:`tvm_distx.LaunchError` naming
the rank:

* a rank raises: it writes its traceback and aborts the job;
* a rank is killed: ``mpiexec`` tears the others down. Which rank died first
  comes from a watcher thread holding a ``pidfd`` of every rank on this host
  (``mpiexec`` names whichever process it noticed, often one it killed
  itself in the teardown); its exit status comes from ``mpiexec``'s report
  when that names it;
* the job outlives ``timeout``: the process group is terminated, then killed,
  and the ranks that had not finished are named with what they were doing.

The job directory is always removed, and ``mpiexec`` runs in its own process
session so that no rank outlives the call.
"""

from __future__ import annotations

import json
import logging
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from tvm_distx.bundle.manifest import Manifest, check_library, check_weights, read_manifest
from tvm_distx.errors import ArgumentError, BundleError, LaunchError
from tvm_distx.layout.arrays import assemble_array
from tvm_distx.runtime.rank_env import rank_environment

__all__ = ["bind_inputs", "launch", "mpiexec_path"]

logger = logging.getLogger(__name__)

#: How ``mpiexec`` (MPICH's hydra) reports a process that died: its PID, then its exit code.
_BAD_EXIT = re.compile(r"PID\s+(\d+)\s+RUNNING AT\s+\S+\s*\n[=\s]*EXIT CODE:\s*(\d+)")

#: Where MPICH keeps its intra-node shared memory. A job that dies leaves its
#: segments behind; the launcher removes the ones that appeared during a failed job.
SHM_DIR = Path("/dev/shm")
SHM_PATTERN = "mpich_shm_*"


def mpiexec_path() -> str:
    """The ``mpiexec`` to use: the one next to this Python (the ``mpich`` wheel's), else PATH's.

    Raises
    ------
    LaunchError
        If there is none.
    """
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.is_file():
        return str(beside)
    found = shutil.which("mpiexec")
    if found is None:
        raise LaunchError("no mpiexec found",
                          hint='install the "mpich" wheel (pip install mpich) in this environment')
    return found


def launch(bundle: str | os.PathLike, inputs: Sequence = (), *, params: Mapping | None = None,
           num_ranks: int | None = None, function: str = "main", timeout: float = 300.0,
           hosts: Sequence[str] | None = None, mpiexec: str | None = None,
           env: Mapping[str, str] | None = None,
           backend: str = "mpi") -> np.ndarray | tuple:
    """Run a bundle's function on MPI ranks and return its global results.

    Parameters
    ----------
    bundle : path
        A directory written by :meth:`tvm_distx.DistExecutable.export`.
    inputs : sequence of array
        The global values of the function's parameters that are not weights
        stored in the bundle (nor given in ``params``), in order.
    params : mapping of str to array, optional
        Global values by parameter name (for weights not in the bundle).
    num_ranks : int, optional
        The ``-n`` to launch with; it must equal the manifest's.
    function : str
        The public function to run.
    timeout : float
        Seconds before the job is stopped.
    hosts : sequence of str, optional
        Hosts for ``mpiexec -hosts``.
    mpiexec : str, optional
        The ``mpiexec`` executable (default: :func:`mpiexec_path`).
    env : mapping, optional
        Extra environment variables for the ranks.
    backend : {"mpi", "disco"}
        ``"disco"`` runs the bundle's ranks as disco workers on this host
        instead (``hosts``, ``mpiexec`` and ``env`` do not apply).

    Returns
    -------
    numpy.ndarray or tuple of numpy.ndarray
        The global result (a tuple for a tuple-returning function).

    Raises
    ------
    BundleError
        For a bad manifest or weight file, or a rank count that differs from
        the bundle's; nothing is launched then.
    ArgumentError
        For inputs that do not fit the function, or a timeout that is not positive.
    LaunchError
        If a rank fails or the job times out.
    """
    if not timeout > 0:
        raise ArgumentError(f"timeout must be a positive number of seconds, got {timeout!r}",
                            hint="for example timeout=300")
    manifest = read_manifest(bundle)
    if num_ranks is not None and num_ranks != manifest.num_ranks:
        raise BundleError(f"the bundle at {manifest.root} needs {manifest.num_ranks} ranks, "
                          f"not {num_ranks}", hint=f"launch it with -n {manifest.num_ranks}")
    check_library(manifest)
    check_weights(manifest)
    signature, free, values, sizes = bind_inputs(manifest, function, inputs, params)
    if backend == "disco":
        return _run_disco(manifest, signature, free.params, values, timeout)
    if backend != "mpi":
        raise ArgumentError(f"unknown backend {backend!r}", hint="use mpi or disco")
    job = Path(tempfile.mkdtemp(prefix="tvm-distx-job-"))
    try:
        _write_inputs(job, manifest, free, values)
        (job / SIZES_FILE).write_text(json.dumps(sizes))
        _run_mpiexec(manifest, job, function, timeout, hosts, mpiexec, env)
        return _read_results(job, manifest, signature)
    finally:
        shutil.rmtree(job, ignore_errors=True)


def bind_inputs(manifest: Manifest, function: str, inputs: Sequence, params: Mapping | None):
    """Check a call's run-time inputs against a bundle's function, before any rank runs.

    Returns
    -------
    tuple
        ``(signature, free, values, sizes)``: the function's signature and the
        one of the parameters passed at run time (not stored weights), both
        specialized to the call's symbolic sizes; the global values of the free
        parameters, in order; and those sizes.
    """
    signature = manifest.function(function)
    stored = set(manifest.weights.get(function, ()))
    # a fused weight given whole is cut into the segments the program takes
    derivations = manifest.derivations.get(signature.name)
    runtime_params = derivations.bind(params, stored) if derivations else dict(params or {})
    for name in stored & {m.name for m in (derivations.made if derivations else ())}:
        runtime_params.pop(name, None)  # made from the layout: the bundle holds the same values
    overlap = stored & set(runtime_params)
    if overlap:
        raise ArgumentError(f"{', '.join(sorted(overlap))} are weights stored in the bundle",
                            hint="do not pass them again")
    # bind the run-time inputs against the parameters that are not stored weights
    free = replace(signature, params=tuple(p for p in signature.params if p.name not in stored))
    values = free.bind(list(inputs), runtime_params)
    sizes = free.sizes(values)  # symbolic extents: checked here, before any rank starts
    signature = signature.specialize(sizes) if signature.symbolic else signature
    free = free.specialize(sizes) if free.symbolic else free
    return signature, free, values, sizes


def _run_disco(manifest: Manifest, signature, specs, values, timeout: float):
    from tvm_distx.layout.arrays import assemble_results
    from tvm_distx.runtime.disco import run_disco

    given = {spec.name: value for spec, value in zip(specs, values)}
    per_rank = []
    for rank in range(manifest.num_ranks):
        per_rank.append([
            np.asarray(manifest.read_weight(rank, spec.name))
            if spec.name not in given and signature.fed(spec, rank)
            else signature.rank_input(spec, given.get(spec.name), rank)
            for spec in signature.params if spec.held_by(rank)])
    entries = [manifest.entry(signature.name, r) for r in range(manifest.num_ranks)]
    outs = run_disco(manifest.library_path, entries, per_rank, timeout=timeout)
    return assemble_results(signature, outs)


#: The file of a job folder giving the run's symbolic sizes (a JSON object).
SIZES_FILE = "sizes.json"


def _write_inputs(job: Path, manifest: Manifest, free, values) -> None:
    """Each rank's inputs: its shards, or under TVM's feed rank 0's global values only."""
    for rank in range(manifest.num_ranks):
        folder = job / f"rank{rank}" / "in"
        folder.mkdir(parents=True)
        for spec, value in zip(free.params, values):
            if free.fed(spec, rank):
                np.save(folder / f"{spec.name}.npy", free.rank_input(spec, value, rank))


def _run_mpiexec(manifest: Manifest, job: Path, function: str, timeout: float,
                 hosts, mpiexec, env) -> None:
    command = [mpiexec or mpiexec_path(), "-n", str(manifest.num_ranks)]
    if hosts:
        command += ["-hosts", ",".join(hosts)]
    command += [sys.executable, "-m", "tvm_distx.runtime.worker", str(manifest.root.resolve()),
                str(job), "--function", function]
    full_env = rank_environment(os.environ, env)
    log = job / "mpiexec.log"
    logger.info("launching %s", " ".join(command))
    started = time.monotonic()
    segments = _segments()
    try:
        code, died = _wait(command, full_env, log, job, manifest.num_ranks, timeout)
    except BaseException:
        _remove_new_segments(segments)
        raise
    logger.info("mpiexec finished in %.2f s with code %d", time.monotonic() - started, code)
    if code != 0:
        _remove_new_segments(segments)
        raise _failure(job, manifest.num_ranks, code, log.read_text(errors="replace"), died)


def _segments() -> set[Path]:
    return set(SHM_DIR.glob(SHM_PATTERN)) if SHM_DIR.is_dir() else set()


def _remove_new_segments(before: set[Path]) -> None:
    for path in _segments() - before:
        logger.info("removing %s, left by the failed job", path)
        path.unlink(missing_ok=True)


def _wait(command, full_env, log: Path, job: Path, num_ranks: int,
          timeout: float) -> tuple[int, tuple[int, int] | None]:
    """Run ``mpiexec``; returns its exit code and the (rank, pid) that died first, if any."""
    watch = _DeathWatch(job, num_ranks)
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=full_env,
                                start_new_session=True)
        watch.start()
        try:
            return proc.wait(timeout=timeout), watch.result()
        except subprocess.TimeoutExpired:
            _stop(proc)
            unfinished = _unfinished(job, num_ranks)
            straggler = _straggler(unfinished)
            blame = (f"rank {straggler} never reached the collective its peers wait in; "
                     if straggler is not None else "")
            raise LaunchError(
                f"the job did not finish within {timeout:g} s; {blame}ranks not done: "
                + ", ".join(f"{r} ({state}, {calls} collectives)"
                            for r, state, calls in unfinished),
                rank=straggler, reason="timeout",
                hint="a rank is stuck (often in a collective some rank never reached); "
                "raise timeout= if the program is just slow",
            ) from None
        finally:
            _stop(proc)
            watch.result()


class _DeathWatch(threading.Thread):
    """Notes the first rank of this host whose process ends without having finished.

    Every rank writes ``<pid> <host>`` to its ``pid`` file as it starts; the
    watcher opens a ``pidfd`` for each one on this host and waits on them all
    with ``select``, so the first exit is seen as it happens, before
    ``mpiexec``'s teardown ends the others. A rank that ends after writing
    ``done`` or its ``error.txt`` finished (or reported its own failure).
    """

    _POLL = 0.02  # seconds between looks for new pid files

    def __init__(self, job: Path, num_ranks: int) -> None:
        super().__init__(name="tvm-distx-death-watch", daemon=True)
        self.job, self.num_ranks = job, num_ranks
        self.first: tuple[int, int] | None = None
        self._done = threading.Event()

    def result(self) -> tuple[int, int] | None:
        """Stop watching; the (rank, pid) that died first, or None."""
        self._done.set()
        if self.is_alive():
            self.join()
        return self.first

    def _finished(self, rank: int) -> bool:
        folder = self.job / f"rank{rank}"
        status = folder / "status"
        return (folder / "error.txt").exists() or (
            status.is_file() and status.read_text().strip() == "done")

    def run(self) -> None:
        host, watched, fds = socket.gethostname(), set(), {}
        try:
            while self.first is None:
                for rank in set(range(self.num_ranks)) - watched:
                    try:
                        pid_text, _, where = (self.job / f"rank{rank}" / "pid").read_text(
                        ).partition(" ")
                        pid = int(pid_text)
                    except (OSError, ValueError):  # not started, or half written
                        continue
                    if not where.strip():  # half written
                        continue
                    watched.add(rank)
                    if where.strip() != host:
                        continue  # another host: its processes are not ours to see
                    try:
                        fds[os.pidfd_open(pid)] = (rank, pid)
                    except ProcessLookupError:  # already gone
                        if not self._finished(rank):
                            self.first = (rank, pid)
                    except OSError:  # no pidfd on this kernel: mpiexec's word only
                        return
                if self.first is not None or (self._done.is_set() and not fds):
                    return
                ready = select.select(list(fds), [], [], self._POLL)[0] if fds else []
                if not fds:
                    self._done.wait(self._POLL)
                for fd in ready:
                    rank, pid = fds.pop(fd)
                    os.close(fd)
                    if self.first is None and not self._finished(rank):
                        self.first = (rank, pid)
                if self._done.is_set() and not ready:
                    return
        finally:
            for fd in fds:
                os.close(fd)


def _stop(proc: subprocess.Popen) -> None:
    """End ``mpiexec`` and everything it started (its own process group)."""
    if proc.poll() is None:
        for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
    try:  # ranks that escaped mpiexec's teardown share its process group
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _unfinished(job: Path, num_ranks: int) -> list[tuple[int, str, int]]:
    """The ranks that did not finish: (rank, last status, collectives entered)."""
    out = []
    for rank in range(num_ranks):
        folder = job / f"rank{rank}"
        status = folder / "status"
        state = status.read_text().strip() if status.is_file() else "not started"
        progress = folder / "progress"
        calls = int(np.fromfile(progress, dtype=np.int64)[0]) if progress.is_file() else 0
        if state != "done":
            out.append((rank, state, calls))
    return out


def _straggler(unfinished: list[tuple[int, str, int]]) -> int | None:
    """The one rank that entered fewer collectives than the others, if there is one."""
    if len(unfinished) < 2:
        return unfinished[0][0] if unfinished else None
    fewest = min(calls for _, _, calls in unfinished)
    behind = [rank for rank, _, calls in unfinished if calls == fewest]
    return behind[0] if len(behind) == 1 else None


def _failure(job: Path, num_ranks: int, code: int, log: str,
             died: tuple[int, int] | None = None) -> LaunchError:
    raised = [(r, job / f"rank{r}" / "error.txt") for r in range(num_ranks)]
    raised = [(r, p) for r, p in raised if p.is_file()]
    if raised:
        rank, path = min(raised, key=lambda item: item[1].stat().st_mtime)
        text = path.read_text(errors="replace")
        last = text.strip().splitlines()[-1] if text.strip() else "an error"
        return LaunchError(f"rank {rank} failed: {last}", rank=rank, reason="raised",
                           details=text)
    statuses = {int(m.group(1)): int(m.group(2)) for m in _BAD_EXIT.finditer(log)}
    if died is None:  # no watcher's word (ranks on other hosts): mpiexec's report
        pids = {}
        for r in range(num_ranks):
            path = job / f"rank{r}" / "pid"
            if path.is_file():
                pids[int(path.read_text().split()[0])] = r
        died = next(((pids[pid], pid) for pid in statuses if pid in pids), None)
    if died is None:
        return LaunchError(f"mpiexec exited with code {code}", reason="exited",
                           details=_tail(log))
    rank, pid = died
    status = statuses.get(pid)
    if status is None:
        how = "died without reporting an error (killed, or it exited early)"
    else:
        try:
            name = signal.Signals(status).name
        except ValueError:
            name = "no signal"
        how = f"died with status {status} ({name})"
    return LaunchError(f"rank {rank} (pid {pid}) {how}", rank=rank, reason="killed",
                       details=_tail(log))


def _tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _read_results(job: Path, manifest: Manifest, signature):
    results = []
    for index, spec in enumerate(signature.results):
        shards = {}
        for rank in spec.sharding.mesh.device_range:
            path = job / f"rank{rank}" / f"out{index}.npy"
            if path.is_file():
                shards[rank] = np.load(path, allow_pickle=False)
        results.append(assemble_array(shards, spec.sharding, spec.shape))
    return tuple(results) if signature.tuple_result else results[0]
