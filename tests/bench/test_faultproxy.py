"""The fault proxy: its sans-I/O delivery schedule (properties) and the relay process (live, loopback)."""

from __future__ import annotations

import math
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkline.bench.faultproxy import (
    Direction,
    FaultProxy,
    FaultProxyError,
    LinkFaults,
    Outage,
    Scenario,
    check_loopback,
    retransmit_arrival,
)

pytestmark = pytest.mark.live  # its tests start servers or proxies on loopback

reads = st.lists(st.tuples(st.floats(0.0, 0.05), st.integers(1, 100_000)), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(reads, st.floats(0.0, 0.2), st.floats(0.0, 0.1), st.one_of(st.none(), st.floats(1e5, 1e9)),
       st.floats(0.0, 5.0), st.integers(0, 10))
def test_bytes_are_never_reordered_nor_early(gaps: list[tuple[float, int]], delay: float, jitter: float,
                                             bw: float | None, stalls: float, seed: int) -> None:
    d = Direction(LinkFaults(delay, jitter, bw, stalls, 0.2), seed=seed)
    t = 0.0
    last = -math.inf
    for gap, n in gaps:
        t += gap
        at = d.schedule(t, n)
        assert at is not None
        assert at >= last  # a byte stream: in order
        assert at >= t + max(0.0, delay - jitter) - 1e-12  # never before the shortest delay
        last = at


@settings(max_examples=60, deadline=None)
@given(reads, st.floats(0.0, 0.1), st.floats(0.1, 3.0), st.floats(0.0, 1.0))
def test_a_blackhole_delivers_nothing_inside_it(gaps: list[tuple[float, int]], delay: float, length: float,
                                               start: float) -> None:
    outage = Outage(start, length, "blackhole")
    d = Direction(LinkFaults(delay), Scenario([outage]))
    t = 0.0
    for gap, n in gaps:
        t += gap
        at = d.schedule(t, n)
        assert at is not None
        assert not (outage.start <= at < outage.end)
        if outage.overlaps(t, t + delay):  # hit: arrives after a retransmission past the end
            assert at >= outage.end + delay - 1e-12


def test_a_reset_destroys_what_crosses_it() -> None:
    d = Direction(LinkFaults(0.05), Scenario([Outage(1.0, 0.5, "reset")]))
    assert d.schedule(0.5, 10) == pytest.approx(0.55)
    assert d.schedule(0.97, 10) is None  # in transit at the reset
    assert d.schedule(1.2, 10) is None
    d.reset()
    assert d.schedule(1.6, 10) == pytest.approx(1.65)


def test_retransmissions_back_off_from_200ms() -> None:
    assert retransmit_arrival(0.0, 0.01, 0.1) == pytest.approx(0.21)
    assert retransmit_arrival(0.0, 0.01, 0.5) == pytest.approx(0.61)  # 0.2, then 0.6
    assert retransmit_arrival(0.0, 0.01, 1.0) == pytest.approx(1.41)  # 0.2, 0.6, 1.4
    assert retransmit_arrival(0.0, 0.0, 1e6) is None  # TCP gives up


def test_only_loopback_targets() -> None:
    assert check_loopback("127.0.0.1", 80)[0] == "127.0.0.1"
    with pytest.raises(FaultProxyError):
        check_loopback("8.8.8.8", 80)
    with pytest.raises(FaultProxyError):
        LinkFaults(delay_s=-1.0)
    with pytest.raises(FaultProxyError):
        Outage(0.0, 1.0, "flood")


# ------------------------------------------------------------------ the live relay


@pytest.fixture(scope="module")
def echo_port() -> Iterator[int]:
    """A loopback echo server (threads; ends with the test module)."""
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.2)
    stop = threading.Event()

    def serve_one(conn: socket.socket) -> None:
        conn.settimeout(10.0)
        with conn:
            try:
                while not stop.is_set():
                    data = conn.recv(65536)
                    if not data:
                        return
                    conn.sendall(data)
            except OSError:
                return

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            threading.Thread(target=serve_one, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield srv.getsockname()[1]
    stop.set()
    thread.join(2.0)
    srv.close()


def _round_trip(port: int, payload: bytes, timeout: float = 10.0) -> tuple[float, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        t = time.monotonic()
        s.sendall(payload)
        got = b""
        while len(got) < len(payload):
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
        return time.monotonic() - t, got


def test_the_relay_delays_each_direction_and_keeps_the_bytes(echo_port: int) -> None:
    payload = bytes(range(256)) * 1000  # 256 kB
    with FaultProxy(echo_port, up=LinkFaults(0.04), down=LinkFaults(0.03), max_seconds=60) as proxy:
        rtt, got = _round_trip(proxy.port, payload)
        assert got == payload
        assert 0.07 <= rtt < 1.0
        proxy.set(up={"delay_ms": 0}, down={"delay_ms": 0})
        rtt2, got2 = _round_trip(proxy.port, b"ping")
        assert got2 == b"ping" and rtt2 < 0.05
        assert proxy.stats()["connections"] == 2


def test_the_relay_blackholes_then_delivers(echo_port: int) -> None:
    with FaultProxy(echo_port, max_seconds=60) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10.0) as s:
            s.sendall(b"a")
            assert s.recv(10) == b"a"
            proxy.outage(0.6, "blackhole")
            t = time.monotonic()
            s.sendall(b"b")
            assert s.recv(10) == b"b"  # held, then retransmitted after the outage
            assert time.monotonic() - t >= 0.55


def test_the_relay_resets_and_refuses_during_a_reset_outage(echo_port: int) -> None:
    with FaultProxy(echo_port, max_seconds=60) as proxy:
        s = socket.create_connection(("127.0.0.1", proxy.port), timeout=5.0)
        s.sendall(b"x")
        assert s.recv(10) == b"x"
        proxy.outage(0.8, "reset")
        with pytest.raises(OSError):
            for _ in range(50):  # bounded: the reset arrives within a few tries
                s.sendall(b"y")
                if not s.recv(10):
                    raise ConnectionResetError("closed")
                time.sleep(0.02)
        s.close()
        with pytest.raises(OSError):  # refused while the outage lasts
            c = socket.create_connection(("127.0.0.1", proxy.port), timeout=2.0)
            c.sendall(b"z")
            if not c.recv(10):
                raise ConnectionResetError("closed")
        time.sleep(0.9)
        _, got = _round_trip(proxy.port, b"back")
        assert got == b"back"
        stats = proxy.stats()
        assert stats["resets"] >= 1 and stats["refused"] >= 1


def test_the_proxy_refuses_a_non_loopback_target() -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "chunkline.bench.faultproxy", "--target-host", "192.0.2.1",
                          "--target-port", "80", "--max-seconds", "1"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "loopback" in out.stderr
