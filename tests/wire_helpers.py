"""Talking to a live server below the clients: raw HTTP exchanges on a socket, server frames cut
from raw bytes, and a native session that sends frames back to back and collects the final answers."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import websockets

from chunkline.bench.serverproc import ServerProcess
from chunkline.client.wire.codec import decode
from chunkline.client.wire.protocol import SUBPROTOCOL


def exchange(port: int, payload: bytes, source: str | None = None, timeout: float = 10.0) -> bytes:
    """Send raw bytes; read until the server closes the connection, one complete response (by
    Content-Length) came, or a WebSocket handshake was answered 101."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout, source_address=(source, 0) if source else None) as s:
        s.sendall(payload)
        data = b""
        while True:
            try:
                chunk = s.recv(65536)
            except (ConnectionResetError, TimeoutError):
                return data
            if not chunk:
                return data
            data += chunk
            head, sep, body = data.partition(b"\r\n\r\n")
            if sep and head.startswith(b"HTTP/1.1 101 "):
                return data  # a WebSocket session was opened: its head is the answer
            length = [int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")]
            if sep and length and len(body) >= length[0]:
                return data


def closed_by_server(s: socket.socket, timeout: float) -> bool:
    """Whether the server closes ``s`` within ``timeout`` (reads until EOF; a reset counts)."""
    s.settimeout(timeout)
    try:
        while s.recv(65536):
            pass
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return True


async def native_session(server: ServerProcess, frames: list[bytes], answers: int, key: str | None = None) -> list[dict[str, Any]]:
    """Send ``frames`` back to back on one native session, then collect the first ``answers``
    final messages (chunk, done, error)."""
    headers = {"Authorization": f"Api-Key {key}"} if key else None
    async with websockets.connect(server.uri, subprotocols=[SUBPROTOCOL], max_size=None, additional_headers=headers) as ws:
        decode(await ws.recv())  # hello
        for frame in frames:
            await ws.send(frame)
        finals: list[dict[str, Any]] = []
        async with asyncio.timeout(60):
            while len(finals) < answers:
                msg = decode(await ws.recv())
                if msg["type"] in ("chunk", "done", "error"):
                    finals.append(msg)
        return finals


def smuggle(port: int, key: str) -> tuple[bytes, bool]:
    """A request with both ``Content-Length`` and ``Transfer-Encoding`` (request smuggling): the
    server's first answer, and whether it then closed the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nContent-Length: 5\r\n"
                  f"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n".encode())
        s.settimeout(10)
        return s.recv(65536), closed_by_server(s, 10)


def server_frame(data: bytes) -> tuple[bytes | None, bytes]:
    """The payload of the first whole frame in ``data`` (server frames are unmasked) and the bytes
    after it; ``None`` while the frame is incomplete."""
    if len(data) < 2:
        return None, data
    length, start = data[1] & 0x7F, 2
    if length == 126:
        length, start = int.from_bytes(data[2:4], "big"), 4
    elif length == 127:
        length, start = int.from_bytes(data[2:10], "big"), 10
    if len(data) < start + length:
        return None, data
    return data[start:start + length], data[start + length:]
