"""Revoking a key ends what already runs on it: an HTTP event stream started before the
revocation gets a final ``unauthenticated`` error event and nothing more once the tenants file
is reloaded, while another tenant's stream goes on (the native session's 1008 close is tested
live in ``test_security_live.py``)."""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Iterator

import pytest
from text_helpers import ServiceHandle, StepGate, registry_with_keys, small_model

from chunkline.server.core.loopthread import LoopThread
from chunkline.server.core.tenants import TenantInfo, TenantRegistry

pytestmark = pytest.mark.live  # its tests start servers or proxies on loopback

STEPS_BEFORE = 4


@pytest.fixture()
def env() -> Iterator[tuple[ServiceHandle, TenantRegistry, dict[str, str], StepGate]]:
    loop = LoopThread()
    gate = StepGate()
    reg, keys = registry_with_keys({"alice": TenantInfo("alice"), "bob": TenantInfo("bob")})
    handle = ServiceHandle([small_model("tiny")], loop, reg, yield_to=gate).start()
    try:
        yield handle, reg, keys, gate
    finally:
        gate.open()
        handle.close()
        loop.close()


def _stream(port: int, key: str) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    body = json.dumps({"model": "tiny", "prompt": "go on", "max_tokens": 50, "ignore_eos": True, "stream": True}).encode()
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json\r\n"
              f"X-Chunkline-Deadline-Ms: 60000\r\n"
              f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return s


def _read_until(s: socket.socket, marker: bytes, got: bytes = b"") -> bytes:
    give_up = time.monotonic() + 10
    while marker not in got:
        assert time.monotonic() < give_up, got[-300:]
        chunk = s.recv(65536)
        assert chunk, got[-300:]
        got += chunk
    return got


def _events(raw: bytes) -> list[str]:
    """The ``data:`` payloads (each event is written within one chunk of the chunked body)."""
    return [m.decode() for m in re.findall(rb"data: (.*?)\n\n", raw)]


def test_revoking_a_key_ends_its_running_stream_at_once(env: tuple[ServiceHandle, TenantRegistry, dict[str, str], StepGate]) -> None:
    handle, reg, keys, gate = env
    gate.close()
    alice, bob = _stream(handle.port, keys["alice"]), _stream(handle.port, keys["bob"])
    with alice, bob:
        give_up = time.monotonic() + 10
        while handle.service.in_flight < 2:  # both admitted before any step runs
            assert time.monotonic() < give_up
            time.sleep(0.005)
        gate.allow(STEPS_BEFORE)  # a few tokens each, then the engine holds
        before = _read_until(alice, b"data: ")
        _read_until(bob, b"data: ")
        revoked = TenantRegistry(reg.tenants, tuple(k for k in reg.keys if k.tenant != "alice"), "reloaded")
        handle.loop.run(_reload(handle, revoked), timeout=5)
        started = time.monotonic()
        gate.open()  # the engine runs free: any token made now would be sent if the stream went on
        after = _read_until(alice, b"data: [DONE]", before)[len(before):]
        assert time.monotonic() - started < 1.0
        events = _events(after)
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "unauthenticated", events
        # Only the tokens of the steps allowed before the revocation (some still on their way);
        # the engine ran free after it, and nothing it made for alice was sent.
        tokens = [e for e in _events(before + after) if "choices" in e]
        assert 1 <= len(tokens) <= STEPS_BEFORE, tokens
        bob_events = _events(_read_until(bob, b"data: [DONE]"))
        assert not any("error" in e for e in bob_events[:-1])  # the other tenant's stream finished normally
    assert handle.auth.watching == 0


async def _reload(handle: ServiceHandle, registry: TenantRegistry) -> None:
    handle.core.reload(registry)
