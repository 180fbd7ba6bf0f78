"""Measuring a :class:`~tvm_distx.autoshard.costs.CostProfile` on the ranks that will run.

:func:`build_kernels` compiles three kernels as :func:`tvm_distx.compile`
compiles a program's (legalized, then our CPU schedules): a matmul with a
transposed weight, an elementwise add and an add of one element.
:func:`measure_cost_profile` launches ``num_ranks`` MPI ranks (the ``mpiexec`` of
:func:`tvm_distx.runtime.mpi.mpiexec_path`) running
:mod:`tvm_distx.autoshard._probe` on them, all at once: the matmul gives the
arithmetic rate, the add the memory rate, the one-element add the fixed cost
of a kernel call, and all-gathers of 4 bytes and 4 MiB the start-up of a
message and the bandwidth. ``backend="local"`` times the kernels in this
process and keeps the default communication numbers.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
import subprocess
import sys
import tempfile

import tvm
from tvm import relax
from tvm.relax.op import add, matmul, permute_dims

from tvm_distx.autoshard import _probe
from tvm_distx.autoshard._probe import ELEMENTWISE, MATMUL
from tvm_distx.autoshard.costs import DEFAULT_PROFILE, CostProfile
from tvm_distx.compiler.pipeline import legalize_ops
from tvm_distx.compiler.schedule import schedule_module
from tvm_distx.compiler.targets import resolve_target
from tvm_distx.errors import ArgumentError, LaunchError
from tvm_distx.runtime.mpi import mpiexec_path
from tvm_distx.runtime.rank_env import rank_environment

__all__ = ["measure_cost_profile"]

logger = logging.getLogger(__name__)


def measure_cost_profile(num_ranks: int = 2, backend: str = "mpi", *, timeout: float = 120.0,
                         save: str | Path | None = None) -> CostProfile:
    """Measure the kernels' rates and call cost, the bandwidth and the message latency.

    Each number is the median of repeated bursts (the typical cost on the host
    as it is); the slowest rank's counts.

    Parameters
    ----------
    num_ranks : int
        Ranks to launch (at least 2 for ``"mpi"``).
    backend : {"mpi", "local"}
    timeout : float
        Seconds before the measurement is abandoned.
    save : path, optional
        Where to write the profile as JSON.

    Raises
    ------
    ArgumentError
        For an unknown backend or too few ranks.
    LaunchError
        When the ranks fail or time out.
    """
    if backend == "local":

        with tempfile.TemporaryDirectory() as tmp:
            found = _probe._kernels(str(build_kernels(Path(tmp))))
        found.pop("work")  # the matmul call the MPI probe puts between collectives
        profile = CostProfile(**found, bytes_per_s=DEFAULT_PROFILE.bytes_per_s,
                              latency_s=DEFAULT_PROFILE.latency_s, name="measured local")
    elif backend == "mpi":
        if num_ranks < 2:
            raise ArgumentError(f"measure_cost_profile(num_ranks={num_ranks}): messages need 2 "
                                "ranks", hint="measure_cost_profile(2, backend='mpi')")

        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "profile.json"
            cmd = [mpiexec_path(), "-n", str(num_ranks), sys.executable, "-m",
                   "tvm_distx.autoshard._probe", str(out), str(build_kernels(Path(tmp)))]
            try:
                done = subprocess.run(cmd, env=rank_environment(), capture_output=True,
                                      text=True, timeout=timeout)
            except subprocess.TimeoutExpired:
                raise LaunchError(f"measuring the profile on {num_ranks} ranks took over "
                                  f"{timeout} s", hint="raise timeout=") from None
            if done.returncode != 0 or not out.is_file():
                raise LaunchError(f"measuring the profile on {num_ranks} ranks failed: "
                                  f"{done.stderr.strip()[-500:]}",
                                  hint="check that mpiexec runs: tvm-distx run on a bundle")
            data = json.loads(out.read_text())
        profile = CostProfile(name=f"measured mpi x{num_ranks}", **data)
    else:
        raise ArgumentError(f"measure_cost_profile(backend={backend!r}): unknown backend",
                            hint='use backend="mpi" or backend="local"')
    logger.info("measured %s", profile)
    if save is not None:
        profile.save(save)
    return profile


def build_kernels(folder: Path, target="x86") -> Path:
    """The probe's kernels, compiled as a program's are, in ``folder``; the library's path.

    Functions ``matmul(x, w)`` (``x @ w.T``, the sizes of
    :data:`tvm_distx.autoshard._probe.MATMUL`), ``add(a, b)`` (of
    :data:`~tvm_distx.autoshard._probe.ELEMENTWISE`) and ``tiny(a, b)`` (one element).
    """


    m, k, n = MATMUL
    bb = relax.BlockBuilder()
    for name, shapes in (("matmul", ((m, k), (n, k))), ("add", (ELEMENTWISE, ELEMENTWISE)),
                         ("tiny", ((1,), (1,)))):
        a, b = (relax.Var(v, relax.TensorType(s, "float32")) for v, s in zip("ab", shapes))
        with bb.function(name, [a, b]):
            with bb.dataflow():
                out = bb.emit_output(bb.emit(matmul(a, bb.emit(permute_dims(b))))
                                     if name == "matmul" else bb.emit(add(a, b)))
            bb.emit_func_output(out)
    resolved = resolve_target(target)
    mod = schedule_module(legalize_ops(bb.get()), resolved.target)
    path = Path(folder) / "probe_kernels.so"
    tvm.compile(mod, target=resolved.target).export_library(str(path))
    return path

