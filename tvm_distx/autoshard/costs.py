"""The cost profile of a machine and the time of one collective plan under it.

A :class:`CostProfile` is five numbers per rank: the arithmetic rate of a
matmul kernel (``flops_per_s``), the rate at which a kernel reads and writes
memory (``memory_bytes_per_s``), the fixed cost of one kernel call
(``kernel_s``), the bandwidth of a collective (``bytes_per_s``) and the
start-up latency of one message (``latency_s``). It is pure data, saved and
loaded as JSON, so that a profile measured once on a machine
(:func:`tvm_distx.autoshard.measure_cost_profile`) is reused by every later plan.
:data:`DEFAULT_PROFILE` stands in when nothing was measured.

The time of one kernel is a roofline: its fixed cost plus the larger of its
arithmetic over the arithmetic rate and the bytes it reads and writes over
the memory rate (:meth:`CostProfile.kernel_time`). A matmul is bound by its
arithmetic, an elementwise kernel by its bytes, and a kernel on a small
shape by its fixed cost; one rate for every kernel would price a relu on a
large tensor like a matmul of the same flop count.

The time of a redistribution is its planner steps' time: for each step,
``messages * latency_s + bytes_received / bytes_per_s``, with the ring message
counts of :func:`step_messages`. The bytes are the planner's
(:func:`tvm_distx.legalize.plan_redistribute`); nothing here recomputes them.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, fields

from tvm_distx.errors import ArgumentError

__all__ = ["CostProfile", "DEFAULT_PROFILE", "step_messages"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CostProfile:
    """What one rank of a machine computes and moves per second.

    Parameters
    ----------
    flops_per_s : float
        Floating-point operations per second of one rank on a matmul.
    bytes_per_s : float
        Bytes per second one rank receives in a collective.
    latency_s : float
        Seconds of start-up per message.
    name : str
        Where the numbers come from (``"default"``, ``"measured mpi x2"``).
    memory_bytes_per_s : float
        Bytes per second a kernel reads and writes (an elementwise kernel's rate).
    kernel_s : float
        Seconds of one kernel call that does nearly nothing.

    Examples
    --------
    >>> CostProfile(1e10, 1e9, 1e-5).message_time(1_000_000, 2)
    0.00102
    """

    flops_per_s: float = 2.0e10
    bytes_per_s: float = 4.0e9
    latency_s: float = 1.0e-5
    name: str = "default"
    memory_bytes_per_s: float = 1.0e10
    kernel_s: float = 2.0e-6

    def __post_init__(self) -> None:
        for f in ("flops_per_s", "bytes_per_s", "memory_bytes_per_s"):
            value = getattr(self, f)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ArgumentError(f"CostProfile.{f} must be a positive number, got {value!r}",
                                    hint="CostProfile(flops_per_s=2e10, bytes_per_s=4e9, "
                                    "latency_s=1e-5)")
        for f in ("latency_s", "kernel_s"):
            value = getattr(self, f)
            if not isinstance(value, (int, float)) or value < 0:
                raise ArgumentError(f"CostProfile.{f} must be >= 0, got {value!r}")

    def compute_time(self, flops: float) -> float:
        """Seconds for ``flops`` operations on one rank."""
        return flops / self.flops_per_s

    def kernel_time(self, flops: float, nbytes: float) -> float:
        """Seconds for one kernel of ``flops`` operations that reads and writes ``nbytes``."""
        return self.kernel_s + max(flops / self.flops_per_s, nbytes / self.memory_bytes_per_s)

    def message_time(self, nbytes: float, messages: int) -> float:
        """Seconds to receive ``nbytes`` in ``messages`` messages."""
        return messages * self.latency_s + nbytes / self.bytes_per_s

    def save(self, path: str | os.PathLike) -> None:
        """Write the profile as JSON."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(asdict(self), f, indent=2)
            f.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CostProfile":
        """Read a profile written by :meth:`save`.

        Raises
        ------
        ArgumentError
            When the file is not a profile (unknown or missing keys, bad values).
        """
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        known = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or set(data) - known:
            raise ArgumentError(f"{os.fspath(path)} is not a cost profile: keys "
                                f"{sorted(data) if isinstance(data, dict) else data!r}",
                                hint=f"a profile has the keys {sorted(known)}")
        return cls(**data)


#: The profile used when none is given: a few cores of one CPU host over shared memory.
DEFAULT_PROFILE = CostProfile()


def step_messages(collective: str, group: int) -> int:
    """Messages one rank receives in a ring ``collective`` over ``group`` ranks.

    ``collective`` is a :class:`tvm_distx.legalize.Collective` value
    (``"all_reduce"``, ...). A local slice sends nothing; a send/recv is one
    message.
    """
    if collective == "local_slice" or group <= 1:
        return 0
    if collective == "all_reduce":
        return 2 * (group - 1)
    if collective == "send_recv":
        return 1
    return group - 1
