"""Measuring a :class:`~tvm_distx.autoshard.costs.CostProfile` on the ranks that will run.

:func:`measure_profile` launches ``num_ranks`` MPI ranks (the ``mpiexec`` of
:func:`tvm_distx.runtime.launcher.mpiexec_path`) running
:mod:`tvm_distx.autoshard._probe`: a matmul for the arithmetic rate, and
ping-pongs between ranks 0 and 1 for the start-up of a message and the
bandwidth. ``backend="local"`` measures the arithmetic rate in this process
and keeps the default communication numbers.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import tempfile
from pathlib import Path

from ..errors import ArgumentError, LaunchError
from .costs import DEFAULT_PROFILE, CostProfile

__all__ = ["measure_profile"]

logger = logging.getLogger(__name__)


def measure_profile(num_ranks: int = 2, backend: str = "mpi", *, timeout: float = 120.0,
                    save: str | Path | None = None) -> CostProfile:
    """Measure flops, bandwidth and message latency.

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
        import time

        import numpy as np

        a = np.ones((512, 512), dtype=np.float32)
        best = min(_timed(lambda: a @ a, time) for _ in range(5))
        profile = CostProfile(2 * 512 ** 3 / best, DEFAULT_PROFILE.bytes_per_s,
                              DEFAULT_PROFILE.latency_s, name="measured local")
    elif backend == "mpi":
        if num_ranks < 2:
            raise ArgumentError(f"profile(num_ranks={num_ranks}): messages need 2 ranks",
                                hint="profile(2, backend='mpi')")
        from ..runtime.launcher import mpiexec_path
        from ..runtime.rank_env import rank_environment

        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "profile.json"
            cmd = [mpiexec_path(), "-n", str(num_ranks), sys.executable, "-m",
                   "tvm_distx.autoshard._probe", str(out)]
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
        raise ArgumentError(f"profile(backend={backend!r}): unknown backend",
                            hint='use backend="mpi" or backend="local"')
    logger.info("measured %s", profile)
    if save is not None:
        profile.save(save)
    return profile


def _timed(fn, time) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
