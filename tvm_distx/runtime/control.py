"""The connections between an MPI session's driver and its ranks: authenticated, framed, watched.

Every rank of an :class:`~tvm_distx.runtime.mpi.MPISession` opens one TCP
connection to the driver (the process that opened the session) as it starts,
whether it runs on the driver's host or on another one. Over it:

* the rank says who it is (``("hello", rank, pid, host)``) and then, every
  :data:`BEAT` seconds, what it is doing (``("beat", status, collectives)``:
  ``"loading"``, ``"ready"``, ``"running <function>"``, and how many
  collectives it has entered in the current call);
* a rank that fails sends its traceback and the error's one line
  (``("error", text, summary)``) before it aborts
  the job, and a rank that ends cleanly says ``("done",)``;
* the calls: rank 0 says ``("ready", ranks)`` once every rank has built its
  virtual machine; then every rank receives ``("run", message)`` (its own) and
  answers ``("ok", rank, reply)``, until ``("close",)``;
* the driver sends every rank ``("beat",)`` every :data:`BEAT` seconds.

So the driver learns of a rank's end wherever it runs: a rank that raised
reports it, a killed rank's connection closes (the kernel closes it), and a
rank on a host whose network is gone falls silent; after :data:`LOST` seconds
of silence the driver gives it up. A rank that hears nothing from its driver
for :data:`LOST` seconds (the driver died, or was cut off) exits, so no rank
outlives its session on any host.

Authentication
--------------
The driver makes a key of 32 random bytes per session and gives it to the
ranks in their environment (:data:`KEY_ENV`; ``mpiexec`` forwards the
environment over its own connections, never on a command line, and the rank
removes it from its environment as it starts). Each connection opens with a
mutual challenge-response before either side reads a single message::

    driver -> rank     32-byte challenge c_d
    rank   -> driver   32-byte challenge c_r, HMAC-SHA256(key, "rank" | c_d | c_r)
    driver -> rank     HMAC-SHA256(key, "driver" | c_r | c_d)

A peer without the key (another user on the network) is dropped, and the
session goes on waiting for its ranks. The traffic itself is not encrypted:
run sessions across hosts on a network you trust, as MPI's own traffic is.

Messages are length-prefixed pickles (:func:`send_message`,
:func:`receive_message`); both ends are the same package, and nothing is
unpickled before the peer has proved it holds the key.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import pickle
import queue
import secrets
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from tvm_distx.errors import ArgumentError

__all__ = ["BEAT", "LOST", "KEY_ENV", "send_message", "receive_message", "new_key",
           "RankInfo", "RankLinks", "DriverLink", "Failure"]

logger = logging.getLogger(__name__)

#: Seconds between heartbeats, both ways.
BEAT = 1.0
#: The environment variable that sets :data:`LOST` (driver and ranks read it as they start).
LOST_ENV = "TVM_DISTX_LOST_AFTER"


def _lost_after() -> float:
    text = os.environ.get(LOST_ENV, "10")
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not seconds > 2 * BEAT:
        raise ArgumentError(f"{LOST_ENV}={text!r} is not a number of seconds above "
                            f"{2 * BEAT:g}", hint=f"unset it (10 s), or for example {LOST_ENV}=20")
    return seconds


#: Seconds of silence after which a peer is given up.
LOST = _lost_after()
#: The environment variable that gives the ranks the session's key (hex).
KEY_ENV = "TVM_DISTX_SESSION_KEY"

_HEADER = struct.Struct("!Q")
_NONCE = 32
_HANDSHAKE_TIMEOUT = 10.0


def new_key() -> bytes:
    """A fresh session key."""
    return secrets.token_bytes(32)


def send_message(conn: socket.socket, message) -> None:
    """Send one length-prefixed pickle."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    conn.sendall(_HEADER.pack(len(data)) + data)


def receive_message(conn: socket.socket):
    """Receive one length-prefixed pickle; ``None`` when the peer has closed."""
    header = _read(conn, _HEADER.size)
    if header is None:
        return None
    data = _read(conn, _HEADER.unpack(header)[0])
    return None if data is None else pickle.loads(data)


def _read(conn: socket.socket, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        try:
            chunk = conn.recv(min(left, 1 << 22))
        except OSError:  # reset, timed out, or closed under us
            return None
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _mac(key: bytes, side: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(key, side + first + second, hashlib.sha256).digest()


def _prove_driver(conn: socket.socket, key: bytes) -> bool:
    """The driver's half of the handshake: True if the peer holds ``key``."""
    challenge = secrets.token_bytes(_NONCE)
    conn.sendall(challenge)
    answer = _read(conn, _NONCE + hashlib.sha256().digest_size)
    if answer is None:
        return False
    theirs, proof = answer[:_NONCE], answer[_NONCE:]
    if not hmac.compare_digest(proof, _mac(key, b"rank", challenge, theirs)):
        return False
    conn.sendall(_mac(key, b"driver", theirs, challenge))
    return True


def _prove_rank(conn: socket.socket, key: bytes) -> bool:
    """The rank's half of the handshake: True if the driver holds ``key``."""
    challenge = _read(conn, _NONCE)
    if challenge is None:
        return False
    mine = secrets.token_bytes(_NONCE)
    conn.sendall(mine + _mac(key, b"rank", challenge, mine))
    proof = _read(conn, hashlib.sha256().digest_size)
    return proof is not None and hmac.compare_digest(proof, _mac(key, b"driver", mine, challenge))


# -- the driver's side


@dataclass
class RankInfo:
    """What the driver knows of one rank, from its connection."""

    rank: int
    pid: int
    host: str
    status: str = "started"
    collectives: int = 0
    heard: float = field(default_factory=time.monotonic)
    finished: bool = False


@dataclass(frozen=True)
class Failure:
    """The first thing that went wrong with a session's ranks, as the connections tell it.

    ``kind`` is ``"raised"`` (the rank sent its traceback, ``text``, and the
    error's one line, ``summary``), ``"died"``
    (its connection closed before it said it was done) or ``"lost"`` (nothing
    heard from it for :data:`LOST` seconds).
    """

    kind: str
    rank: int
    text: str = ""
    summary: str = ""


class RankLinks:
    """The driver's end: listens for its ranks, and watches them on a thread of its own.

    Parameters
    ----------
    num_ranks : int
        How many ranks will connect.
    key : bytes
        The session's key (:func:`new_key`).
    bind : str
        The address to listen on: ``"127.0.0.1"`` when every rank runs on
        this host, ``""`` (every interface) otherwise.
    """

    def __init__(self, num_ranks: int, key: bytes, bind: str = "127.0.0.1") -> None:
        self.num_ranks = num_ranks
        self.ranks: dict[int, RankInfo] = {}
        self.failure: Failure | None = None
        self.replies: queue.Queue = queue.Queue()
        self._key = key
        self._server = socket.create_server((bind, 0))
        self.port = self._server.getsockname()[1]
        self._conns: dict[int, socket.socket] = {}
        self._locks: dict[int, threading.Lock] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = os.pipe()
        self._thread = threading.Thread(target=self._watch, name="tvm-distx-rank-links",
                                        daemon=True)
        self._thread.start()

    def send(self, rank: int, message, *, wait: bool = True) -> None:
        """Send ``message`` to ``rank``; a connection that fails is left to the watcher.

        With ``wait=False`` (the watcher's heartbeats) nothing is sent while
        another send to that rank is under way, nor while its connection is
        backed up: a call's message to a rank whose host went away fills the
        connection's buffer, and the watcher must go on beating the others.
        """
        conn = self._conns.get(rank)
        if conn is None or not self._locks[rank].acquire(blocking=wait):
            return
        try:
            if not wait and not select.select([], [conn], [], 0)[1]:
                return
            send_message(conn, message)
        except OSError:  # a send that stalls for LOST seconds gives up too
            pass
        finally:
            self._locks[rank].release()

    def silent(self) -> list[int]:
        """The ranks, not finished, that nothing has been heard from for :data:`LOST` seconds."""
        now = time.monotonic()
        return [i.rank for i in self.ranks.values() if not i.finished and now - i.heard > LOST]

    def connected(self) -> int:
        """How many ranks have connected so far."""
        return len(self.ranks)

    def close(self) -> None:
        """Stop watching and close every connection; a second call does nothing."""
        if self._stop.is_set():
            return
        self._stop.set()
        os.write(self._wake[1], b"x")
        self._thread.join()
        for conn in self._conns.values():
            conn.close()
        self._server.close()
        for fd in self._wake:
            os.close(fd)

    # -- the watcher
    def _fail(self, failure: Failure) -> None:
        with self._lock:
            if self.failure is None and not self._stop.is_set():
                self.failure = failure
                logger.info("session: rank %d %s %s", failure.rank, failure.kind, failure.text)
                self.replies.put(None)  # wakes a caller waiting for a reply

    def _watch(self) -> None:
        next_beat = time.monotonic() + BEAT
        while not self._stop.is_set():
            socks = {conn: rank for rank, conn in self._conns.items()}
            wait = max(0.0, next_beat - time.monotonic())
            ready = select.select([self._server, self._wake[0], *socks], [], [], wait)[0]
            for sock in ready:
                if sock is self._server:
                    self._accept()
                elif sock in socks:
                    self._read(socks[sock])
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + BEAT
                for rank in list(self._conns):
                    self.send(rank, ("beat",), wait=False)
                for rank in self.silent():
                    self._fail(Failure("lost", rank, f"{now - self.ranks[rank].heard:.0f}"))

    def _accept(self) -> None:
        conn, peer = self._server.accept()
        _no_delay(conn)
        conn.settimeout(_HANDSHAKE_TIMEOUT)
        try:
            hello = receive_message(conn) if _prove_driver(conn, self._key) else None
        except (OSError, pickle.UnpicklingError, EOFError):
            hello = None
        if not (isinstance(hello, tuple) and len(hello) == 4 and hello[0] == "hello"):
            logger.warning("session: refused a connection from %s that did not hold the "
                           "session's key", peer[0])
            conn.close()
            return
        conn.settimeout(LOST)  # a stalled send or a half-received message gives up
        _, rank, pid, host = hello
        self.ranks[rank] = RankInfo(rank, pid, host)
        self._locks[rank] = threading.Lock()
        self._conns[rank] = conn

    def _read(self, rank: int) -> None:
        info = self.ranks[rank]
        message = receive_message(self._conns[rank])
        info.heard = time.monotonic()
        if message is None:  # the connection closed
            self._conns.pop(rank).close()
            if not info.finished:
                self._fail(Failure("died", rank))
            return
        kind = message[0]
        if kind == "beat":
            info.status, info.collectives = message[1], message[2]
        elif kind == "error":
            info.finished = True
            self._fail(Failure("raised", rank, message[1], message[2]))
        elif kind == "done":
            info.finished = True
        else:  # rank 0's "ready", every rank's "ok"
            self.replies.put(message)


# -- the rank's side


class DriverLink:
    """A rank's end: its connection to the driver, with a thread that beats and listens.

    Parameters
    ----------
    address : str
        ``host:port`` of the driver.
    key : bytes
        The session's key.
    rank, pid, host
        Who this rank is, as the driver will name it.
    on_lost : callable
        Called (on the link's thread) with a reason when the driver is gone:
        it must end the process.
    connect_timeout : float
        Seconds to keep trying to connect.

    Attributes
    ----------
    status : str
        What the rank is doing, sent with every beat.
    collectives : int
        The collectives entered in the current call, sent with every beat.
    requests : queue.Queue
        The driver's calls and its ``close``.
    """

    def __init__(self, address: str, key: bytes, rank: int, pid: int, host: str, *,
                 on_lost: Callable[[str], None], connect_timeout: float = 30.0) -> None:
        self.status = "started"
        self.collectives = 0
        self.requests: queue.Queue = queue.Queue()
        self._on_lost = on_lost
        self._send_lock = threading.Lock()
        self._closing = False
        where, _, port = address.rpartition(":")
        self._conn = _connect(where, int(port), connect_timeout)
        _no_delay(self._conn)
        self._conn.settimeout(_HANDSHAKE_TIMEOUT)
        if not _prove_rank(self._conn, key):
            self._conn.close()
            raise ConnectionError(f"the driver at {address} did not prove the session's key")
        self._conn.settimeout(LOST)  # a stalled send or a half-received message gives up
        self.send(("hello", rank, pid, host))
        self._thread = threading.Thread(target=self._run, name="tvm-distx-driver-link",
                                        daemon=True)
        self._thread.start()

    def send(self, message) -> None:
        """Send one message to the driver (thread-safe)."""
        with self._send_lock:
            send_message(self._conn, message)

    def finish(self, message=("done",)) -> None:
        """Say ``message`` (``("done",)`` or ``("error", text)``) and stop listening."""
        self._closing = True
        try:
            self.send(message)
        except OSError:
            pass

    def _run(self) -> None:
        heard = time.monotonic()
        next_beat = heard
        while True:
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + BEAT
                try:
                    self.send(("beat", self.status, self.collectives))
                except OSError:
                    pass  # the silence below decides
            if now - heard > LOST and not self._closing:
                self._on_lost(f"no word from the driver for {now - heard:.0f} s")
                return
            try:
                ready = select.select([self._conn], [], [], max(0.0, next_beat - now))[0]
            except (OSError, ValueError):  # closed under us
                message = None
            else:
                if not ready:
                    continue
                message = receive_message(self._conn)
            if message is None:
                if not self._closing:
                    self._on_lost("the driver closed the connection")
                return
            heard = time.monotonic()
            if message[0] != "beat":
                if message[0] == "close":
                    self._closing = True
                self.requests.put(message)


def _no_delay(conn: socket.socket) -> None:
    """Send each message at once: a call is a small message waited for, not a stream."""
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _connect(host: str, port: int, timeout: float) -> socket.socket:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return socket.create_connection((host, port), timeout=5.0)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
