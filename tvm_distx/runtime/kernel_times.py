"""Time every kernel and collective a rank runs: ``TVM_DISTX_PROFILE=folder``.

When a rank's environment sets :data:`PROFILE_ENV` to a folder, its virtual
machine (:func:`tvm_distx.runtime.mpi_rank.vm_program`) calls
:class:`KernelTimes` before and after every call it makes (TVM's VM
instrument): each kernel (``call_tir``), each collective and each other
built-in. When the rank ends, it writes ``rank<r>.tsv`` into the folder: one
line per callee with its calls, total seconds and share of the rank's time in
calls, slowest first. A collective's time includes its wait for the slowest
rank, so on a balanced program it is the cost of the exchange, and on an
unbalanced one it shows where the others wait.

The figures cover every call of the session; to profile one function, serve it
alone (for example ``generate(ids, max_new_tokens=1)`` profiles the prefill
and the argmax). The instrument costs a few microseconds per call.

Usage::

    with CausalLM.from_bundle("bundle", env={"TVM_DISTX_PROFILE": "prof"}) as lm:
        lm.generate(ids, max_new_tokens=1)
    # prof/rank0.tsv, prof/rank1.tsv
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

__all__ = ["PROFILE_ENV", "KernelTimes", "read_times"]

logger = logging.getLogger(__name__)

#: The environment variable naming the folder a rank writes its kernel times to.
PROFILE_ENV = "TVM_DISTX_PROFILE"

#: What TVM's instrument returns to let the call run as usual (``VMInstrumentReturnKind.NO_OP``).
_RUN = 0


class KernelTimes:
    """Seconds and calls per callee, accumulated by a VM instrument.

    Parameters
    ----------
    rank : int
        The rank, for the file's name.
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._started: list[float] = []

    def __call__(self, _func, symbol: str, before_run: bool, _ret, *_args) -> int:
        """TVM's instrument: start a clock before a call, add its time after."""
        if before_run:
            self._started.append(time.perf_counter())
            return _RUN
        elapsed = time.perf_counter() - self._started.pop()
        name = str(symbol)
        self.seconds[name] = self.seconds.get(name, 0.0) + elapsed
        self.calls[name] = self.calls.get(name, 0) + 1
        return _RUN

    def table(self) -> str:
        """Tab-separated lines ``callee, calls, seconds, share``, slowest first, with a header."""
        total = sum(self.seconds.values()) or 1.0
        lines = ["callee\tcalls\tseconds\tshare"]
        for name, seconds in sorted(self.seconds.items(), key=lambda kv: -kv[1]):
            lines.append(f"{name}\t{self.calls[name]}\t{seconds:.6f}\t{seconds / total:.4f}")
        return "\n".join(lines) + "\n"

    def write(self, folder: str | os.PathLike) -> Path:
        """Write ``rank<r>.tsv`` into ``folder`` (made if missing); its path."""
        path = Path(folder) / f"rank{self.rank}.tsv"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.table())
        logger.info("rank %d: kernel times written to %s", self.rank, path)
        return path


def read_times(path: str | os.PathLike) -> dict[str, tuple[int, float]]:
    """``{callee: (calls, seconds)}`` from a file :meth:`KernelTimes.write` wrote."""
    out = {}
    for line in Path(path).read_text().splitlines()[1:]:
        name, calls, seconds, _share = line.split("\t")
        out[name] = (int(calls), float(seconds))
    return out
