"""Whether each host has the memory for its ranks, checked before any rank starts; and a
rank the kernel killed for memory, told as such.

:func:`check_host_memory` adds up, per host, what each of its ranks holds
(:func:`tvm_distx.bundle.footprint.rank_bytes`: weights, the key-value cache at
``max_length``, activations of a call of up to
:data:`~tvm_distx.generation.generator.PREFILL_CHUNK` tokens, as a runner prefills a long
prompt) and what the rank process itself costs
(:data:`RANK_RUNTIME_BYTES`), and compares it with what the host has
(:func:`tvm_distx.hosts.memory.read_memory`: its ``mem=``, its memory cgroup's limit,
or its available memory). A host that is short refuses the launch in one line::

    [host-memory] host t1 needs 1.9 GiB for ranks 0-1 (weights 1.6 GiB, cache 64 MiB,
    activations 12 MiB, runtime 240 MiB), but has 800 MiB (its memory cgroup's limit)

:func:`oom_death` tells, after a rank died of SIGKILL, whether its host's count of
processes killed for memory grew since the launch, and gives the error that says so.
"""

from __future__ import annotations

import logging
from typing import Mapping, Sequence

from tvm_distx.bundle.footprint import RankBytes, rank_bytes
from tvm_distx.bundle.manifest import Manifest
from tvm_distx.errors import HostMemoryError
from tvm_distx.generation.generator import PREFILL_CHUNK
from tvm_distx.hosts.hostfile import Host, RankPlacement
from tvm_distx.hosts.memory import HostMemory, format_size, oom_kills, read_memory

__all__ = ["RANK_RUNTIME_BYTES", "check_host_memory", "oom_death", "MEMORY_HINT",
           "MEMORY_CLI_HINT"]

logger = logging.getLogger(__name__)

#: What a rank process costs on its own, beside its weights, cache and activations: Python,
#: numpy, mpi4py and MPICH, TVM's runtime library and the bundle's. Measured once
#: (2026-11-28, TVM 0.27, the mpich wheel, x86-64): an MPISession of the seed
#: tensor-parallel MLP (tests/data/seed_tensor_parallel.py, 2 ranks, 64 KiB of weights
#: each), after one call, one second idle; ``/proc/PID/status`` of each rank gave VmRSS
#: 103 and 104 MiB (RssAnon 56, RssFile 41, RssShmem 5 MiB; VmHWM the same). Rounded up
#: to 128 MiB, and counted for each rank (the libraries' file pages, which ranks on one
#: host share, are counted for each: a margin).
RANK_RUNTIME_BYTES = 128 << 20

#: What to do about a host that is short, in Python and on the command line.
MEMORY_HINT = ("cut the model into more pipeline stages (stages=), spread the ranks over "
               "more hosts, or use a smaller format (quantization=\"q8\" or \"q4\")")
MEMORY_CLI_HINT = ("cut the model into more pipeline stages (--stages), spread the ranks over "
                   "more hosts (--hostfile), or use a smaller format (--quantization q8 or q4)")


def _ranks_text(ranks: Sequence[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ",".join(map(str, ranks))


def check_host_memory(manifest: Manifest, placement: RankPlacement | None, *,
                      local: Sequence[str] = (), rsh=None,
                      runtime_bytes: int = RANK_RUNTIME_BYTES) -> dict[str, HostMemory]:
    """Refuse a launch a host has too little memory for; returns what each host has.

    Parameters
    ----------
    manifest : Manifest
        The bundle.
    placement : RankPlacement or None
        Which ranks run where; None: all on this host.
    local : sequence of str
        The names that are this host (read directly, not over the remote shell).
    rsh : str or sequence of str, optional
        The remote shell.
    runtime_bytes : int
        What one rank process costs before its weights.

    Raises
    ------
    HostMemoryError
        For the first host (in placement order) whose ranks need more than it has, in
        one line naming it, what its ranks need and what it has.
    DeployError
        For a host that does not answer the remote shell.
    """
    if placement is None:
        placement = RankPlacement((Host("localhost", manifest.num_ranks),))
        local = ["localhost"]
    per_rank: list[RankBytes] = rank_bytes(manifest, tokens=PREFILL_CHUNK)
    memory = read_memory(placement.hosts, local=local, rsh=rsh)
    for host in placement.hosts:
        have = memory.get(host.name)
        ranks = placement.ranks_of(host.name)
        parts = {"weights": sum(per_rank[r].weights for r in ranks),
                 "cache": sum(per_rank[r].cache for r in ranks),
                 "activations": sum(per_rank[r].activations for r in ranks),
                 "runtime": runtime_bytes * len(ranks)}
        need = sum(parts.values())
        logger.info("host %s: %s need %s, it has %s", host.name, _ranks_text(ranks),
                    format_size(need), have.describe() if have else "an unknown amount")
        if have is None or need <= have.bytes:
            continue
        shown = ", ".join(f"{k} {format_size(v)}" for k, v in parts.items() if v)
        raise HostMemoryError(
            f"host {host.name} needs {format_size(need)} for {_ranks_text(ranks)} ({shown}), "
            f"but has {have.describe()}", host=host.name, needed=need, available=have.bytes,
            hint=MEMORY_HINT, cli_hint=MEMORY_CLI_HINT)
    return memory


def oom_death(rank: int | None, host: str, before: Mapping[str, HostMemory], *,
              local: Sequence[str] = (), rsh=None, details: str = "") -> HostMemoryError | None:
    """The error for ``rank`` on ``host``, killed by the kernel out of memory, or None.

    It is the kernel's doing when the host's count of processes killed for memory
    (its memory cgroup's, else the whole host's) grew since ``before`` (read before
    the launch).
    """
    was = before.get(host)
    if was is None or was.oom_kills is None:
        return None
    now = oom_kills([host], local=local, rsh=rsh).get(host)
    if now is None or now.oom_kills is None or now.oom_kills <= was.oom_kills:
        return None
    limit = f" (limit {format_size(now.bytes)})" if now.source in ("cgroup", "mem=") else ""
    who = f"rank {rank}" if rank is not None else "a rank"
    return HostMemoryError(f"{who} on host {host} was killed by the kernel: out of "
                           f"memory{limit}", host=host, rank=rank, reason="oom",
                           available=now.bytes, details=details, hint=MEMORY_HINT,
                           cli_hint=MEMORY_CLI_HINT)
