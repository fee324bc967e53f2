"""Idle connections to the HTTP port cannot take the robot port down: the port holds at most the
open-files limit minus ``fd_headroom`` connections, closes the rest as soon as they are accepted
(counted in ``chunkline_connections_refused_total{port="http",reason="fd_reserve"}``) without
building uvicorn's protocol for them (an attacker reconnecting as fast as it is closed makes that
path a load of its own), and the robot port keeps answering. Live: a real server at a 1,024
open-files limit against 1,100 idle connections, as the attack was made."""

from __future__ import annotations

import asyncio
import random
import resource
import selectors
import socket
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from text_helpers import ServiceHandle, small_model
from uvicorn.protocols.http.h11_impl import H11Protocol
from wire_helpers import closed_by_server

from chunkline.bench.serverproc import ServerProcess, http_get
from chunkline.client import AsyncClient
from chunkline.server.core.loopthread import LoopThread
from chunkline.server.entrypoints.http import HttpLimits, HttpServer
from chunkline.server.entrypoints.http.server import HEAD_DEADLINE_SPREAD, raise_open_files_limit

pytestmark = pytest.mark.live  # its tests start servers or proxies on loopback

ATTACK = 1100
NOFILE = 1024


#: the first byte of a request head: a connection that sent it is handed to the server at once
#: (one that sends nothing stays in the kernel until the head deadline, TCP_DEFER_ACCEPT)
TRICKLE = b"G"


def _hold(port: int, count: int, first: bytes = TRICKLE) -> list[socket.socket]:
    held = []
    for _ in range(count):
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
        except OSError:
            break
        held.append(s)
        if first:
            s.sendall(first)
    return held


def _open(held: list[socket.socket], within_s: float) -> int:
    """How many of ``held`` the server has not closed within ``within_s``."""
    for s in held:
        s.setblocking(False)
    time.sleep(within_s)
    alive = 0
    for s in held:
        try:
            alive += s.recv(1) != b""
        except BlockingIOError:
            alive += 1
        except OSError:
            pass
    return alive


@pytest.fixture()
def many_fds() -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 3 * ATTACK:
        pytest.skip(f"the hard open-files limit ({hard}) is too low for the attack")
    raise_open_files_limit()
    yield


def test_connections_beyond_the_ports_share_are_closed_at_accept_and_counted(many_fds: None) -> None:
    share = 8
    loop = LoopThread()
    handle = ServiceHandle([small_model("tiny")], loop, limits=HttpLimits(fd_headroom=raise_open_files_limit() - share)).start()
    held = _hold(handle.port, 3 * share)
    try:
        assert _open(held, 0.5) == share
        assert handle.metric("chunkline_connections_refused_total", port="http", reason="fd_reserve") == 2 * share
    finally:
        for s in held:
            s.close()
        handle.close()
        loop.close()


def test_a_connection_refused_at_accept_gets_none_of_uvicorns_protocol(many_fds: None, monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[H11Protocol] = []
    init = H11Protocol.__init__

    def counted(self: H11Protocol, *args: Any, **kwargs: Any) -> None:
        built.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(H11Protocol, "__init__", counted)
    share = 4
    loop = LoopThread()
    handle = ServiceHandle([small_model("tiny")], loop, limits=HttpLimits(fd_headroom=raise_open_files_limit() - share)).start()
    held = _hold(handle.port, 4 * share)  # accepted in this order: the first ``share`` are kept
    try:
        for s in held[share:]:
            assert closed_by_server(s, 10)
        assert handle.metric("chunkline_connections_refused_total", port="http", reason="fd_reserve") == 3 * share
        assert len(built) == share
        for s in held[:share]:  # the kept ones are served
            s.settimeout(10)
            s.sendall(b"ET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")  # the rest of the head
            assert s.recv(65536).startswith(b"HTTP/1.1 200 OK\r\n")
    finally:
        for s in held:
            s.close()
        handle.close()
        loop.close()


@pytest.mark.skipif(not hasattr(socket, "TCP_DEFER_ACCEPT"), reason="the kernel keeps silent connections on Linux")
def test_connections_that_send_nothing_hold_no_fd_so_a_request_after_them_is_served(many_fds: None) -> None:
    share = 4
    loop = LoopThread()
    handle = ServiceHandle([small_model("tiny")], loop, limits=HttpLimits(fd_headroom=raise_open_files_limit() - share)).start()
    silent = _hold(handle.port, 3 * share, first=b"")
    try:
        status, _ = http_get("127.0.0.1", handle.port, "/v1/models", timeout=10)
        assert status == 200  # accepted after the silent ones were (in order), it would be over the cap
        assert handle.metric("chunkline_connections_refused_total", port="http", reason="fd_reserve") == 0
    finally:
        for s in silent:
            s.close()
        handle.close()
        loop.close()


async def _no_app(scope: Any, receive: Any, send: Any) -> None:
    return None


def test_idle_connections_opened_together_are_not_all_closed_together() -> None:
    """Each head deadline is drawn within HEAD_DEADLINE_SPREAD of the timeout: a flood's connections,
    reopened by the attacker as soon as they close, stay spread rather than all expiring (and being
    accepted again) in one turn of the loop."""
    timeout_s, count = 1.0, 24
    loop = LoopThread()
    server = HttpServer(_no_app, HttpLimits(head_timeout_s=timeout_s), deadline_draw=random.Random(7))
    held: list[socket.socket] = []
    try:
        port = loop.run(server.start("127.0.0.1", 0))
        opened = time.monotonic()
        held += _hold(port, count)
        closed_at: list[float] = []
        with selectors.DefaultSelector() as selector:
            for s in held:
                selector.register(s, selectors.EVENT_READ)
            while len(closed_at) < count and time.monotonic() - opened < timeout_s + 10:
                for key, _ in selector.select(timeout=1.0):
                    selector.unregister(key.fileobj)
                    closed_at.append(time.monotonic() - opened)
        assert len(closed_at) == count
        assert min(closed_at) >= (1 - HEAD_DEADLINE_SPREAD) * timeout_s - 0.05
        assert max(closed_at) - min(closed_at) >= 0.1  # the seed's draws span 0.23 s
    finally:
        for s in held:
            s.close()
        loop.run(server.close())
        loop.close()


def test_idle_http_connections_at_the_open_files_limit_leave_the_robot_port_serving(many_fds: None, tmp_path: Path) -> None:
    config = tmp_path / "server.toml"
    config.write_text(textwrap.dedent(f"""
        no_auth = true
        ledger = "{tmp_path / 'ledger.db'}"
        http_port = 0
        metrics_port = 0
        open_timeout_s = 60

        [[policies]]
        ref = "noop"

        [[text]]
        name = "tiny"
    """))
    with ServerProcess(["--config", str(config)], prefix=["prlimit", f"--nofile={NOFILE}:{NOFILE}", "--"]) as server:
        held = _hold(server.http_port, ATTACK)
        try:
            assert len(held) == ATTACK  # the kernel accepted them all; the server decides what it keeps
            alive = _open(held, 1.0)
            assert alive <= NOFILE - 512
            assert http_get("127.0.0.1", server.port, "/healthz", timeout=5)[0] == 200

            async def robot() -> None:
                from helpers import aloha_obs

                async with AsyncClient(server.uri) as client:
                    for i in range(20):
                        await client.infer(aloha_obs(i), deadline_ms=5000)

            asyncio.run(asyncio.wait_for(robot(), 20))
            _, body = http_get("127.0.0.1", server.metrics_port, "/metrics")
            refused = sum(s.value for f in text_string_to_metric_families(body.decode()) for s in f.samples
                          if s.name == "chunkline_connections_refused_total" and s.labels == {"port": "http", "reason": "fd_reserve"})
            assert refused >= ATTACK - alive
            assert "HTTP port full" in server.log_path.read_text(errors="replace")
        finally:
            for s in held:
                s.close()
        assert not closed_by_server(socket.create_connection(("127.0.0.1", server.http_port), timeout=5), 0.2)
