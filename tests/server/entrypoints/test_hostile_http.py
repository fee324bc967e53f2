"""The HTTP port against request smuggling: a request whose body framing is ambiguous gets one
400 and its connection closed; the request hidden behind it is never read, never answered."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from text_helpers import ServiceHandle, registry_with_keys, small_model

from chunkline.server.core.loopthread import LoopThread
from chunkline.server.core.tenants import TenantInfo

pytestmark = pytest.mark.live  # its tests start servers or proxies on loopback

SMUGGLED = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.fixture(scope="module")
def env() -> Iterator[tuple[ServiceHandle, str]]:
    loop = LoopThread()
    reg, keys = registry_with_keys({"alice": TenantInfo("alice")})
    handle = ServiceHandle([small_model("tiny")], loop, reg).start()
    try:
        yield handle, keys["alice"]
    finally:
        handle.close()
        loop.close()


def _exchange(port: int, data: bytes) -> bytes:
    """Everything the server sends until it closes (a timeout fails: the connection stayed open)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(data)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
        return got


@pytest.mark.parametrize(("framing", "body"), [
    ("Content-Length: 5\r\nTransfer-Encoding: chunked", b"0\r\n\r\n" + SMUGGLED),
    ("Content-Length: 0\r\nTransfer-Encoding: chunked", b"0\r\n\r\n" + SMUGGLED),
    ("Transfer-Encoding: chunked\r\nContent-Length: 40", b"0\r\n\r\n" + SMUGGLED),
    ("Content-Length: 0\r\nContent-Length: 38", SMUGGLED),
    ("Transfer-Encoding: gzip, chunked", b"0\r\n\r\n" + SMUGGLED),
])
def test_ambiguous_framing_is_one_400_and_nothing_after_it_is_answered(env: tuple[ServiceHandle, str], framing: str, body: bytes) -> None:
    handle, key = env
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n{framing}\r\n\r\n".encode()
    answer = _exchange(handle.port, head + body)
    assert answer.startswith(b"HTTP/1.1 400 ") and answer.count(b"HTTP/1.1 ") == 1, answer


def test_plain_requests_on_a_kept_alive_connection_are_all_answered(env: tuple[ServiceHandle, str]) -> None:
    handle, key = env
    get = f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\r\n".encode()
    answer = _exchange(handle.port, get + get.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n"))
    assert answer.count(b"HTTP/1.1 200 ") == 2
