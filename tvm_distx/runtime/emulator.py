"""The emulated backend: every rank in a thread of one process, collectives over numpy.

It runs the rank-local program that :class:`tvm_distx.legalize.LowerDistIR`
produces exactly as the real backends will, one TVM virtual machine per rank,
and implements the ``tvm_distx.ccl.*`` runtime functions by exchanging numpy
buffers between the threads. It is the fast unit-test backend: no MPI, no
processes, and the same numbers.
"""

from __future__ import annotations

import logging
import threading
from typing import Sequence

import numpy as np

from tvm_distx.legalize.lower_distir import CollectiveGroup
from tvm_distx.spec import TensorSharding

__all__ = ["emulate", "shard_array"]

logger = logging.getLogger(__name__)

_REDUCERS = {0: np.add, 1: np.multiply, 2: np.minimum, 3: np.maximum}


def shard_array(array: np.ndarray, sharding: TensorSharding, device: int) -> np.ndarray:
    """The part of a global ``array`` that ``device`` holds under ``sharding``.

    A dimension split by several mesh axes is split with the lower-numbered
    mesh axis as the outer (major) split (see :func:`tvm_distx.legalize.planner.shard_bounds`).
    """
    from tvm_distx.legalize.planner import shard_bounds

    bounds = shard_bounds(sharding, array.shape, device)
    if bounds is None:
        raise ValueError(f"device {device} is not in mesh {sharding.mesh.describe()}")
    return np.ascontiguousarray(array[tuple(slice(a, b) for a, b in bounds)])


class _Exchange:
    """Buffers the ranks of one run swap through, one slot per collective call."""

    def __init__(self, devices: Sequence[int]) -> None:
        self.devices = tuple(devices)
        self.barrier = threading.Barrier(len(devices))
        self.slots: dict[int, dict[int, np.ndarray]] = {}
        self.lock = threading.Lock()
        self.local = threading.local()

    def post(self, array: np.ndarray) -> tuple[int, dict[int, np.ndarray]]:
        seq = self.local.seq
        self.local.seq += 1
        with self.lock:
            self.slots.setdefault(seq, {})[self.local.device] = array.copy()
        self.barrier.wait()
        return seq, self.slots[seq]

    def done(self, seq: int) -> None:
        self.barrier.wait()
        if self.local.device == self.devices[0]:
            with self.lock:
                self.slots.pop(seq, None)


_ACTIVE: list[_Exchange] = []  # the run in progress (runs do not overlap)


def _allreduce(x, kind, group, out) -> None:
    exchange = _ACTIVE[-1]
    members = CollectiveGroup.decode(group).members(exchange.local.device)
    seq, posted = exchange.post(np.from_dlpack(x))
    if int(kind) == 4:
        result = sum(posted[d] for d in members) / len(members)
    else:
        reduce = _REDUCERS[int(kind)]
        result = posted[members[0]]
        for d in members[1:]:
            result = reduce(result, posted[d])
    np.from_dlpack(out)[...] = result
    exchange.done(seq)


def _group_of(group) -> tuple[_Exchange, tuple[int, ...], int]:
    exchange = _ACTIVE[-1]
    device = exchange.local.device
    members = CollectiveGroup.decode(group).members(device)
    return exchange, members, members.index(device)


def _local_slice(x, group, axes, out) -> None:
    _, members, me = _group_of(group)
    part = np.split(np.from_dlpack(x), len(members), axis=int(axes[0]))[me]
    np.from_dlpack(out)[...] = part


def _allgather(x, group, axes, out) -> None:
    exchange, members, _ = _group_of(group)
    seq, posted = exchange.post(np.from_dlpack(x))
    np.from_dlpack(out)[...] = np.concatenate([posted[d] for d in members], axis=int(axes[0]))
    exchange.done(seq)


def _alltoall(x, group, axes, out) -> None:
    exchange, members, me = _group_of(group)
    split_dim, concat_dim = int(axes[0]), int(axes[1])
    seq, posted = exchange.post(np.from_dlpack(x))
    pieces = [np.split(posted[d], len(members), axis=split_dim)[me] for d in members]
    np.from_dlpack(out)[...] = np.concatenate(pieces, axis=concat_dim)
    exchange.done(seq)


def _send_recv(x, spec, out) -> None:
    from tvm_distx.legalize.legalize_redistribute import SendRecvSpec
    from tvm_distx.legalize.planner import send_recv_transfers, shard_bounds

    exchange = _ACTIVE[-1]
    me = exchange.local.device
    move = SendRecvSpec.decode(spec)
    seq, posted = exchange.post(np.from_dlpack(x))
    mine = shard_bounds(move.dst, move.shape, me)
    target = np.from_dlpack(out)

    def copy(box, sender: int) -> None:
        held = shard_bounds(move.src, move.shape, sender)
        source = posted[sender][tuple(slice(a - h0, b - h0) for (a, b), (h0, _) in zip(box, held))]
        target[tuple(slice(a - m0, b - m0) for (a, b), (m0, _) in zip(box, mine))] = source

    own = shard_bounds(move.src, move.shape, me)
    overlap = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(own, mine))
    if all(a < b for a, b in overlap):
        copy(overlap, me)  # what this rank already holds
    for transfer in send_recv_transfers(move.src, move.dst, move.shape):
        if transfer.receiver == me:
            copy(transfer.bounds, transfer.sender)
    exchange.done(seq)


_FUNCTIONS = {
    "tvm_distx.ccl.send_recv": _send_recv,
    "tvm_distx.ccl.allreduce": _allreduce,
    "tvm_distx.ccl.allgather": _allgather,
    "tvm_distx.ccl.alltoall": _alltoall,
    "tvm_distx.ccl.local_slice": _local_slice,
}


def _register() -> None:
    import tvm_ffi

    for name, func in _FUNCTIONS.items():
        tvm_ffi.register_global_func(name, func, override=True)


def emulate(executable, inputs: Sequence[Sequence[np.ndarray]], devices: Sequence[int],
            entry: str = "main", timeout: float = 120.0) -> list:
    """Run a compiled rank program on every device, each in its own thread.

    Parameters
    ----------
    executable : tvm.relax.VMExecutable
        ``tvm.compile`` of the rank-local module.
    inputs : sequence of sequence of numpy.ndarray
        Per device (in ``devices`` order), the local arguments of ``entry``.
    devices : sequence of int
        The global device ids.
    entry : str
        The function to run.
    timeout : float
        Seconds to wait for every rank.

    Returns
    -------
    list
        Per device, the numpy result (a tuple for tuple results).
    """
    import tvm
    from tvm import relax

    _register()
    exchange = _Exchange(devices)
    results: dict[int, object] = {}
    errors: dict[int, BaseException] = {}

    def rank(device: int, args: Sequence[np.ndarray]) -> None:
        exchange.local.device = device
        exchange.local.seq = 0
        try:
            vm = relax.VirtualMachine(executable, tvm.cpu())
            out = vm[entry](*[tvm.runtime.tensor(a) for a in args])
            results[device] = _to_numpy(out)
        except BaseException as err:  # reported below, with the rank
            errors[device] = err
            exchange.barrier.abort()

    _ACTIVE.append(exchange)
    try:
        threads = [threading.Thread(target=rank, args=(d, a), daemon=True)
                   for d, a in zip(devices, inputs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
    finally:
        _ACTIVE.pop()
    if errors:
        device, err = sorted(errors.items())[0]
        raise RuntimeError(f"rank {device} failed: {err}") from err
    missing = [d for d in devices if d not in results]
    if missing:
        raise TimeoutError(f"ranks {missing} did not finish within {timeout} s")
    return [results[d] for d in devices]


def _to_numpy(value):
    if hasattr(value, "numpy"):
        return value.numpy()
    return tuple(_to_numpy(v) for v in value)
