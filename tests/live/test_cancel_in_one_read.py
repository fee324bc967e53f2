"""A ``cancel`` that reaches the server in the same read as the request it cancels (a proxy or a
congested link coalesces them) still gets that request answered: ``cancelled``, or ``done`` if
it finished first. A live server, raw frames written in one write."""

from __future__ import annotations

import base64
import os
import socket
from pathlib import Path
from typing import Any

from websockets.frames import Frame, Opcode
from wire_helpers import server_frame

from chunkline.bench.serverproc import ServerProcess
from chunkline.client.wire.codec import Encoder, decode
from chunkline.client.wire.protocol import SUBPROTOCOL


def _frame(message: dict[str, Any]) -> bytes:
    return Frame(Opcode.BINARY, Encoder().encode(message)).serialize(mask=True)


def _messages(s: socket.socket, data: bytes) -> tuple[list[dict[str, Any]], bytes]:
    """Whole server frames at the start of ``data`` (unmasked), decoded, and the bytes after them."""
    out = []
    while True:
        payload, data = server_frame(data)
        if payload is None:
            return out, data
        out.append(decode(payload))


def test_a_cancel_in_the_same_read_as_its_generate_is_answered(tmp_path: Path) -> None:
    with ServerProcess(["--policy", "noop", "--no-auth", "--text-model", "tiny", "--ledger", str(tmp_path / "l.db")]) as server:
        key = base64.b64encode(os.urandom(16)).decode()
        head = (f"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: {SUBPROTOCOL}\r\n\r\n")
        with socket.create_connection((server.host, server.port), timeout=10) as s:
            s.sendall(head.encode())
            data = b""
            while b"\r\n\r\n" not in data:
                data += s.recv(65536)
            data = data.split(b"\r\n\r\n", 1)[1]
            generate = {"type": "generate", "id": "g1", "prompt": "x", "max_tokens": 200, "ignore_eos": True,
                        "deadline_ms": 5000.0}
            s.sendall(_frame(generate) + _frame({"type": "cancel", "id": "g1"}))
            finals: list[dict[str, Any]] = []
            for _ in range(1000):  # bounded; each recv waits at most the socket's timeout
                messages, data = _messages(s, data)
                finals += [m for m in messages if m.get("id") == "g1" and m["type"] in ("done", "error")]
                if finals:
                    break
                chunk = s.recv(65536)
                assert chunk, "the server closed the connection"
                data += chunk
    assert len(finals) == 1 and (finals[0]["type"] == "done" or finals[0]["code"] == "cancelled"), finals
