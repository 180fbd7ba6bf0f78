"""The driver-rank connections: the key is proved both ways, beats flow, silence and ends are seen.

No MPI here: both ends run in this process, over loopback TCP.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from tvm_distx.runtime import control
from tvm_distx.runtime.control import DriverLink, RankLinks, new_key


def _wait(condition, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def fast(monkeypatch):
    """Beats every 0.1 s, and silence of 0.5 s counts as lost."""
    monkeypatch.setattr(control, "BEAT", 0.1)
    monkeypatch.setattr(control, "LOST", 0.5)


def _rank(links: RankLinks, key: bytes, rank: int, lost: list | None = None) -> DriverLink:
    return DriverLink(f"127.0.0.1:{links.port}", key, rank, 1000 + rank, "here",
                      on_lost=(lost.append if lost is not None else lambda why: None))


def test_ranks_that_hold_the_key_connect_and_beat(fast):
    key = new_key()
    links = RankLinks(2, key)
    try:
        ranks = [_rank(links, key, r) for r in range(2)]
        assert _wait(lambda: links.connected() == 2)
        assert {(i.rank, i.pid, i.host) for i in links.ranks.values()} == {(0, 1000, "here"),
                                                                           (1, 1001, "here")}
        ranks[1].status, ranks[1].collectives = "running main", 3
        assert _wait(lambda: links.ranks[1].status == "running main"
                     and links.ranks[1].collectives == 3)
        ranks[0].send(("ready", [(0, 1000, "here")]))
        assert links.replies.get(timeout=5) == ("ready", [(0, 1000, "here")])
        links.send(0, ("run", ["x", "y"]))
        assert ranks[0].requests.get(timeout=5) == ("run", ["x", "y"])
        time.sleep(1.0)  # both sides keep beating: nobody is lost
        assert links.failure is None
        for link in ranks:
            link.finish()
        assert _wait(lambda: all(i.finished for i in links.ranks.values()))
    finally:
        links.close()


def test_a_peer_without_the_key_is_refused_and_the_session_goes_on(fast, caplog):
    key = new_key()
    links = RankLinks(1, key)
    try:
        with pytest.raises(ConnectionError, match="did not prove the session's key"):
            DriverLink(f"127.0.0.1:{links.port}", new_key(), 0, 1, "intruder",
                       on_lost=lambda why: None)
        # a raw client that sends garbage instead of the proof
        with socket.create_connection(("127.0.0.1", links.port)) as raw:
            raw.recv(32)
            raw.sendall(b"\0" * 64)
            assert raw.recv(1) == b""  # dropped
        assert links.connected() == 0 and links.failure is None
        _rank(links, key, 0)
        assert _wait(lambda: links.connected() == 1)
        assert "did not hold the session's key" in caplog.text
    finally:
        links.close()


def _fall_silent(link: DriverLink) -> None:
    link._closing = True  # it stops reading (and would not mind the driver's end)
    link.send = lambda message: None  # and stops beating


def _close(link: DriverLink) -> None:
    link._conn.close()  # as the kernel does when the process is killed


@pytest.mark.parametrize("fault,kind", [(_fall_silent, "lost"), (_close, "died")],
                         ids=["silent", "closed"])
def test_a_silent_rank_is_lost_and_a_closed_connection_died(fast, fault, kind):
    key = new_key()
    links = RankLinks(2, key)
    try:
        link = _rank(links, key, 0)
        _wait(lambda: links.connected() == 1)
        fault(link)
        assert _wait(lambda: links.failure is not None, within=5)
        assert (links.failure.kind, links.failure.rank) == (kind, 0)
    finally:
        links.close()


def test_a_rank_that_raised_reports_its_traceback(fast):
    key = new_key()
    links = RankLinks(1, key)
    try:
        link = _rank(links, key, 0)
        link.finish(("error", "Traceback ...\nValueError: boom", "ValueError: boom"))
        assert _wait(lambda: links.failure is not None)
        assert links.failure.kind == "raised" and "boom" in links.failure.text
        assert links.failure.summary == "ValueError: boom"
        assert links.replies.get(timeout=1) is None  # a waiting caller is woken
    finally:
        links.close()


def test_a_rank_whose_driver_is_gone_gives_up(fast):
    key = new_key()
    links = RankLinks(1, key)
    lost: list[str] = []
    _rank(links, key, 0, lost)
    _wait(lambda: links.connected() == 1)
    links.close()
    assert _wait(lambda: lost, within=5)
    assert lost[0] == "the driver closed the connection"


def test_a_rank_that_hears_nothing_gives_up(fast):
    key = new_key()
    server = socket.create_server(("127.0.0.1", 0))
    lost: list[str] = []

    def mute_driver():  # proves the key, then never says a word
        conn, _ = server.accept()
        conn.settimeout(5)
        assert control._prove_driver(conn, key)
        control.receive_message(conn)  # the hello
        time.sleep(3)
        conn.close()

    thread = threading.Thread(target=mute_driver)
    thread.start()
    DriverLink(f"127.0.0.1:{server.getsockname()[1]}", key, 0, 1, "here", on_lost=lost.append)
    assert _wait(lambda: lost, within=3)
    assert lost[0].startswith("no word from the driver for")
    thread.join()
    server.close()
