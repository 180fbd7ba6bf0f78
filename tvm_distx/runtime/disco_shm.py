"""Collectives over one shared-memory segment, for the ranks of a disco run.

Every rank maps the same anonymous segment (a ``memfd``, see
:mod:`tvm_distx.runtime.disco`). It holds, in this order:

* control words (int64): the first failed rank plus one, one status per rank,
  the byte count and the operation tag each rank posts in the current round,
  and an ``n x n`` matrix of signal counters (``signals[i, j]``: how many
  barriers ``i`` has entered with ``j``; only rank ``i`` writes row ``i``);
* an error-message area per rank (the tail of its traceback);
* a data slot per rank (what the rank posts to a meeting), page-aligned;
* the pickled inputs of every rank, written by the controller.

A *meeting* of some members is the only primitive: each member copies its bytes
into its own slot, a barrier among the members, each reads what it needs from
the slots, a second barrier. Longer buffers go in rounds of one slot each. The
collectives read the slots in place (:meth:`ShmComm.exchange`): they reduce or
copy straight from the slots into their output, so a rank's data is copied once
into its slot and once out of the slots, with no allocation per call; an
all-to-all posts only the pieces of the other members, and a reduce-scatter reads and
folds only this rank's block of each member's post ((p-1)/p of the tensor from
its peers, where an all-reduce reads all of theirs). A barrier bumps the signal
counters towards every other member and waits until each of them has bumped its
counter towards this rank as often, by polling (first yielding the CPU, then
with a growing sleep up to 1 ms; no futex, no lock). Two ranks meet in the same
order on both sides (they run their programs in order), so a barrier needs no
other identity; each post carries a tag of the operation and its members,
checked after the first barrier, so mismatched programs fail instead of
exchanging garbage. The data is copied before the counter is stored, and x86-64
keeps stores (and loads) in program order, so a reader that sees the counter
sees the data; a weakly ordered CPU would need fences here.

Every wait polls the failed word and stops at the run's deadline, so a rank
that raises stops its peers within a few milliseconds and nothing waits forever.

:class:`ShmCollectives` implements the collective-backend interface of
:mod:`tvm_distx.runtime.collectives` over the segment (same semantics as the
emulated backend of :mod:`tvm_distx.runtime.emulated`, bit for bit); :func:`install`
registers it as the functions of :mod:`tvm_distx.ccl` and the per-CCL functions
of TVM's own disco builtins (``runtime.disco..allreduce`` and so on, the empty
CCL name that disco workers use unless a C++ CCL set one).
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import time
import zlib
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from tvm_distx.errors import ArgumentError, CollectiveGroupError, LaunchError, PeerFailedError
from tvm_distx.layout import shard_bounds
from tvm_distx.runtime.collectives import REDUCERS, Collectives, register

__all__ = ["Layout", "ShmComm", "ShmCollectives", "PeerFailedError", "install", "RUNNING",
           "DONE", "FAILED", "ABORTED", "TIMED_OUT"]

logger = logging.getLogger(__name__)

#: Rank status words: running, done, failed (first), aborted (after another
#: rank failed), timed out (waited past the deadline; failed first).
RUNNING, DONE, FAILED, ABORTED, TIMED_OUT = 0, 1, 2, 3, 4

_ERROR_BYTES = 4096
_PAGE = 4096
_MAX_SLEEP = 1e-3  # seconds: the longest sleep between polls
_YIELDS = 100  # polls that only yield the CPU before sleeping


@dataclass(frozen=True)
class Layout:
    """Where everything is in the segment.

    Parameters
    ----------
    world : int
        The number of ranks.
    slot_bytes : int
        The size of each rank's data slot (longer posts go in rounds).
    input_bytes : int
        The size of the controller's input area.
    """

    world: int
    slot_bytes: int
    input_bytes: int

    @property
    def words(self) -> int:
        """The number of int64 control words."""
        return 1 + 3 * self.world + self.world * self.world

    @property
    def errors_offset(self) -> int:
        """Where the error messages start."""
        return 8 * self.words

    @property
    def slots_offset(self) -> int:
        """Where the data slots start (page-aligned, so posts are aligned for every dtype)."""
        end = self.errors_offset + self.world * _ERROR_BYTES
        return -(-end // _PAGE) * _PAGE

    @property
    def inputs_offset(self) -> int:
        """Where the input area starts."""
        return self.slots_offset + self.world * self.slot_bytes

    @property
    def size(self) -> int:
        """The segment size in bytes."""
        return self.inputs_offset + self.input_bytes


class ShmComm:
    """One rank's view of the segment.

    Parameters
    ----------
    buf : mmap.mmap
        The mapped segment.
    layout : Layout
        Its layout.
    rank : int
        This rank (its global device id).
    deadline : float
        ``time.time()`` after which every wait raises a
        :class:`~tvm_distx.errors.LaunchError` (``reason="timeout"``).
    """

    def __init__(self, buf: mmap.mmap, layout: Layout, rank: int, deadline: float) -> None:
        n = layout.world
        self.layout, self.rank, self.deadline = layout, rank, deadline
        words = np.frombuffer(buf, np.int64, layout.words)
        self.failed = words[0:1]
        self.status = words[1:1 + n]
        self.sizes = words[1 + n:1 + 2 * n]
        self.tags = words[1 + 2 * n:1 + 3 * n]
        self.signals = words[1 + 3 * n:].reshape(n, n)
        self.errors = np.frombuffer(buf, np.uint8, n * _ERROR_BYTES,
                                    layout.errors_offset).reshape(n, _ERROR_BYTES)
        self.slots = np.frombuffer(buf, np.uint8, n * layout.slot_bytes,
                                   layout.slots_offset).reshape(n, layout.slot_bytes)
        self.inputs = np.frombuffer(buf, np.uint8, layout.input_bytes, layout.inputs_offset)
        self.seen = np.zeros(n, np.int64)  # signals consumed from each peer (local)
        self._scratch = np.empty(0, np.uint8)  # packing space of all-to-alls (local)
        self.timed_out = False

    # ------------------------------------------------------------------ state
    def finish(self, status: int, message: str = "", rank: int | None = None) -> None:
        """Record a final status and error message, for this rank unless ``rank`` is given."""
        rank = self.rank if rank is None else rank
        if message:
            data = message.encode("utf-8", "replace")[-(_ERROR_BYTES - 1):]
            self.errors[rank, :len(data)] = np.frombuffer(data, np.uint8)
            self.errors[rank, len(data)] = 0
        self.status[rank] = status

    def fail(self, message: str, rank: int | None = None) -> None:
        """Record an error: FAILED (or TIMED_OUT), or ABORTED if another rank failed first."""
        rank = self.rank if rank is None else rank
        if self.failed[0] in (0, rank + 1):
            self.failed[0] = rank + 1
            timed_out = self.timed_out and rank == self.rank
            self.finish(TIMED_OUT if timed_out else FAILED, message, rank)
        else:
            self.finish(ABORTED, message, rank)

    def abort(self) -> None:
        """Stop every rank's waits (the controller gives up on the run)."""
        if self.failed[0] == 0:
            self.failed[0] = self.layout.world + 1

    def message(self, rank: int) -> str:
        """The error message that ``rank`` recorded."""
        raw = self.errors[rank].tobytes()
        return raw.split(b"\0", 1)[0].decode("utf-8", "replace")

    # ------------------------------------------------------------------ waiting
    def _wait(self, peer: int, target: int) -> None:
        me, polls, delay = self.rank, 0, 1e-5
        while self.signals[peer, me] < target:
            failed = int(self.failed[0])
            if failed and failed != me + 1:
                raise PeerFailedError(failed - 1 if failed <= self.layout.world else None)
            if time.time() > self.deadline:
                self.timed_out = True
                raise LaunchError(f"rank {me} timed out waiting for rank {peer}", rank=me,
                                  reason="timeout")
            polls += 1
            if polls < _YIELDS:  # a peer that is about to arrive: give it the core
                os.sched_yield()
            else:
                time.sleep(delay)
                delay = min(2 * delay, _MAX_SLEEP)

    def barrier(self, members: Sequence[int]) -> None:
        """Wait until every one of ``members`` (this rank among them) has arrived."""
        me = self.rank
        peers = [p for p in members if p != me]
        for p in peers:
            self.signals[me, p] += 1
        for p in peers:
            self.seen[p] += 1
            self._wait(p, self.seen[p])

    def meet(self, what: str, members: Sequence[int], data: np.ndarray | None,
             want: Sequence[int]) -> dict[int, np.ndarray]:
        """Post ``data`` to a meeting of ``members``; returns the raw bytes of each in ``want``.

        Every member must call with the same ``what`` (the operation, checked:
        ranks that run mismatched programs get an error, not garbage) and
        ``members``. ``data`` None posts nothing (zero bytes). The arrays
        returned are private copies (this rank's own entry is a view of ``data``).
        """
        me = self.rank
        mine = _raw(data)
        out: dict[int, np.ndarray] = {me: mine} if me in want else {}
        peers = [p for p in want if p != me]

        def copy(offset: int, chunks: dict[int, np.ndarray]) -> None:
            for p in peers:
                if p not in out:
                    out[p] = np.empty(int(self.sizes[p]), np.uint8)
                chunk = chunks[p]
                out[p][offset:offset + len(chunk)] = chunk

        self.exchange(what, members, mine, copy)
        return out

    def exchange(self, what: str, members: Sequence[int],
                 data: np.ndarray | Sequence[np.ndarray] | None,
                 consume: Callable[[int, dict[int, np.ndarray]], None]) -> None:
        """A meeting whose posts are read in place, in the shared slots, by ``consume``.

        The rounds of :meth:`meet` without its private copies: in every round,
        between the two barriers, ``consume(offset, chunks)`` gets the round's
        byte offset and, for every member, a ``uint8`` view of its chunk (bytes
        ``[offset, offset + len(chunk))`` of what it posted; empty past its
        end) in its slot. The views are valid only during that call. ``data``
        may be a list of arrays, posted one after the other.
        """
        me, cap = self.rank, self.layout.slot_bytes
        members = tuple(members)
        tag = zlib.crc32(f"{what} {members}".encode())
        segments = [_raw(d) for d in data] if isinstance(data, (list, tuple)) else [_raw(data)]
        total = sum(len(segment) for segment in segments)
        offset = 0
        while True:
            _copy_range(segments, offset, self.slots[me, :max(0, min(cap, total - offset))])
            self.sizes[me] = total
            self.tags[me] = tag
            self.barrier(members)
            other = [p for p in members if self.tags[p] != tag]
            if other:
                raise CollectiveGroupError(
                    f"rank {me} is in {what} over ranks {list(members)} but rank {other[0]} "
                    "is in another call: the ranks' programs do not match")
            sizes = {p: int(self.sizes[p]) for p in members}
            consume(offset, {p: self.slots[p, :max(0, min(cap, sizes[p] - offset))]
                             for p in members})
            self.barrier(members)
            offset += cap
            if offset >= max(sizes.values()):
                return

    def scratch(self, nbytes: int) -> np.ndarray:
        """A private ``uint8`` buffer of ``nbytes`` (contents undefined), reused by later calls."""
        if self._scratch.size < nbytes:
            self._scratch = np.empty(nbytes, np.uint8)
        return self._scratch[:nbytes]


def _raw(data: np.ndarray | None) -> np.ndarray:
    if data is None:
        return np.empty(0, np.uint8)
    return np.ascontiguousarray(data).reshape(-1).view(np.uint8)


def _copy_range(segments: Sequence[np.ndarray], offset: int, target: np.ndarray) -> None:
    """Copy bytes ``[offset, offset + len(target))`` of the concatenated ``segments``."""
    filled, base = 0, 0
    for segment in segments:
        end = base + len(segment)
        if filled < len(target) and end > offset + filled:
            start = offset + filled - base
            count = min(len(segment) - start, len(target) - filled)
            target[filled:filled + count] = segment[start:start + count]
            filled += count
        base = end


def _as(raw: np.ndarray, like: np.ndarray, shape: Sequence[int] | None = None) -> np.ndarray:
    return raw.view(like.dtype).reshape(like.shape if shape is None else tuple(shape))


# ---------------------------------------------------------------------- the collectives
_ACTIVE: list[ShmComm] = []  # the comm of this process's rank, while it runs


class ShmCollectives(Collectives):
    """The collectives of this process's rank over the segment of the run in progress.

    Every collective is one :meth:`ShmComm.exchange`: each member posts its
    buffer into its slot and reads, in place, only the bytes it needs from the
    others' slots.
    """

    @property
    def comm(self) -> ShmComm:
        if not _ACTIVE:
            raise CollectiveGroupError("no disco run is in progress in this process")
        return _ACTIVE[-1]

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def devices(self) -> range:
        return range(self.comm.layout.world)

    def all_reduce(self, x, out, op, group) -> None:
        members, reduce = group.members, REDUCERS[op]
        if not out.flags.c_contiguous:
            raw = self.comm.meet("allreduce", members, x, members)
            posted = [_as(raw[d], x) for d in members]
            result = posted[0]
            for value in posted[1:]:
                result = reduce(result, value)
            out[...] = result
            return
        # Reduce every round's chunks straight from the slots into ``out``, in member
        # order: the same operations on the same values as the emulator, so the same bits.
        flat, itemsize = out.reshape(-1), x.itemsize

        def fold(offset: int, chunks: dict[int, np.ndarray]) -> None:
            parts = [chunks[d].view(x.dtype) for d in members]
            _fold_into(flat[offset // itemsize:offset // itemsize + len(parts[0])], parts,
                       reduce)

        self.comm.exchange("allreduce", members, x, fold)

    def reduce_scatter(self, x, out, op, dim, group) -> None:
        # Every member posts its blocks, block k (for member k) after block k - 1; this
        # rank folds only its own block of every post, in member order: it reads
        # 1/p of what an all-reduce reads.
        members, reduce, p = group.members, REDUCERS[op], group.size
        pieces = self._pieces(x, dim, p)
        size, lo = pieces.shape[1], group.index * pieces.shape[1]
        flat = _columns(out, 0, 1).reshape(-1)  # this rank's block, as bytes

        def fold(offset: int, chunks: dict[int, np.ndarray]) -> None:
            start, stop = max(lo, offset), min(lo + size, offset + len(chunks[members[0]]))
            if start >= stop:
                return
            parts = [chunks[d][start - offset:stop - offset].view(x.dtype) for d in members]
            _fold_into(flat[start - lo:stop - lo].view(x.dtype), parts, reduce)

        self.comm.exchange("reducescatter", members, pieces.reshape(-1), fold)

    def all_gather(self, x, out, dim, group) -> None:
        members = group.members
        # Member k's block, flattened, is column block k of ``out`` seen as (outer, p, inner).
        blocks = _columns(out, dim, group.size)

        def place(offset: int, chunks: dict[int, np.ndarray]) -> None:
            for k, d in enumerate(members):
                _write_range(blocks[:, k, :], offset, chunks[d])

        self.comm.exchange("allgather", members, x, place)

    def all_to_all(self, x, out, split, concat, group) -> None:
        members, me, p = group.members, group.index, group.size
        pieces = self._pieces(x, split, p)
        size = pieces.shape[1]
        # Member k's piece, flattened, is column block k of ``out`` seen as (outer, p, inner).
        blocks = _columns(out, concat, p)
        _write_range(blocks[:, me, :], 0, pieces[me])  # this rank's own piece moves locally

        def place(offset: int, chunks: dict[int, np.ndarray]) -> None:
            for k, d in enumerate(members):
                if k == me:
                    continue
                # member k posts the pieces of every member but itself, in member order
                lo = (me - (me > k)) * size
                chunk = chunks[d]
                start, stop = max(lo, offset), min(lo + size, offset + len(chunk))
                if start < stop:
                    _write_range(blocks[:, k, :], start - lo, chunk[start - offset:stop - offset])

        self.comm.exchange("alltoall", members, [pieces[k] for k in range(p) if k != me], place)

    def broadcast(self, x, out, root, group) -> None:
        flat = _columns(out, 0, 1).reshape(-1)
        source = group.members[root]

        def copy(offset: int, chunks: dict[int, np.ndarray]) -> None:
            chunk = chunks[source]
            flat[offset:offset + len(chunk)] = chunk

        self.comm.exchange("broadcast", group.members, x, copy)

    def scatter(self, x, out, root, group) -> None:
        flat = _columns(out, 0, 1).reshape(-1)
        source, size = group.members[root], flat.size
        lo = group.index * size

        def copy(offset: int, chunks: dict[int, np.ndarray]) -> None:
            chunk = chunks[source]
            start, stop = max(lo, offset), min(lo + size, offset + len(chunk))
            if start < stop:
                flat[start - lo:stop - lo] = chunk[start - offset:stop - offset]

        self.comm.exchange("scatter", group.members, x, copy)

    def gather(self, x, out, root, group) -> None:
        members = group.members
        raw = self.comm.meet("gather", members, x, members if out is not None else ())
        if out is not None:
            out[...] = _as(np.concatenate([raw[d] for d in members]), out)

    def move(self, x, out, spec) -> None:
        comm = self.comm
        me = comm.rank
        pieces = spec.pieces(me) if out is not None else []
        senders = sorted({p.sender for p in pieces if p.sender != me})
        raw = comm.meet("send/recv", spec.participants(), x, senders)
        for piece in pieces:
            if piece.sender == me:
                held = x
            else:
                block = shard_bounds(spec.src, spec.shape, piece.sender)
                held = _as(raw[piece.sender], out, [b - a for a, b in block])
            out[piece.target] = held[piece.source]

    def _pieces(self, x: np.ndarray, dim: int, parts: int) -> np.ndarray:
        """The bytes of ``x`` as ``(parts, n)``: row ``k`` is block ``k`` along ``dim``,
        flattened (packed into scratch unless ``dim`` is the outermost non-trivial one)."""
        raw = _raw(x)
        if math.prod(x.shape[:dim]) != 1:
            packed = self.comm.scratch(raw.size).reshape(parts, -1)
            np.copyto(packed.reshape(parts, math.prod(x.shape[:dim]), -1),
                      _columns(x, dim, parts).transpose(1, 0, 2))
            raw = packed.reshape(-1)
        return raw.reshape(parts, -1)


def _fold_into(into: np.ndarray, parts: Sequence[np.ndarray], reduce) -> None:
    """``into = ((parts[0] op parts[1]) op parts[2]) ...``, in place."""
    reduce(parts[0], parts[1], out=into)
    for part in parts[2:]:
        reduce(into, part, out=into)


def _columns(array: np.ndarray, dim: int, parts: int) -> np.ndarray:
    """The bytes of a C-contiguous ``array`` as ``(outer, parts, inner)`` along ``dim``.

    Block ``k`` of ``parts`` equal blocks along ``dim``, flattened, is ``[:, k, :]``.
    """
    if not array.flags.c_contiguous:
        raise ArgumentError("the disco collectives need C-contiguous tensors",
                            hint="a rank program's buffers are C-contiguous; this is a bug")
    outer = math.prod(array.shape[:dim])
    inner = array.nbytes // (outer * parts) if outer * parts else 0
    return array.reshape(-1).view(np.uint8).reshape(outer, parts, inner)


def _write_range(target: np.ndarray, offset: int, data: np.ndarray) -> None:
    """Write ``data``, bytes ``[offset, offset + len(data))`` of the row-major
    flattening of the 2-D ``target``, into ``target``."""
    if not len(data):
        return
    cols = target.shape[1]
    row, col = divmod(offset, cols)
    done = 0
    if col:  # the end of a first, partial row
        done = min(cols - col, len(data))
        target[row, col:col + done] = data[:done]
        row += 1
    full = (len(data) - done) // cols
    if full:
        target[row:row + full] = data[done:done + full * cols].reshape(full, cols)
        done += full * cols
        row += full
    if done < len(data):  # the start of a last, partial row
        target[row, :len(data) - done] = data[done:]


_BACKEND = ShmCollectives()


def install(comm: ShmComm | None) -> None:
    """Make ``comm`` this process's communicator and register the functions over it.

    Registers every ``tvm_distx.ccl.*`` function and TVM's per-CCL disco
    builtins (``runtime.disco..allreduce`` and so on) over
    :class:`ShmCollectives`. Registration is repeated on every run: another
    backend (the emulator) may have overridden the same names in this process
    since. None uninstalls: the functions then raise.
    """
    _ACTIVE.clear()
    if comm is None:
        return
    _ACTIVE.append(comm)
    register(_BACKEND, builtins="runtime.disco..")
