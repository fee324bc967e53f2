"""A raw WebSocket client on a plain socket: it writes any frame, valid or not (RFC 6455 section 5.2)."""

from __future__ import annotations

import base64
import dataclasses
import os
import socket
import struct
from collections.abc import Mapping

import numpy as np

from chunkline.client.wire.protocol import SUBPROTOCOL

__all__ = ["RawFrame", "frame_bytes", "RawWebSocket"]


# ---------------------------------------------------------------------------------- raw WebSocket frames


@dataclasses.dataclass(frozen=True)
class RawFrame:
    """One WebSocket frame as a client would put it on the wire (RFC 6455 section 5.2).

    Args:
        opcode: 0 continuation, 1 text, 2 binary, 8 close, 9 ping, 10 pong; others are reserved.
        payload: the payload (unmasked).
        fin: last fragment of its message.
        rsv: the three reserved bits (0 without extensions).
        masked: clients must mask every frame.
        claimed_length: a length to put in the header instead of ``len(payload)`` (a lie).
    """

    opcode: int
    payload: bytes = b""
    fin: bool = True
    rsv: int = 0
    masked: bool = True
    claimed_length: int | None = None


def frame_bytes(frame: RawFrame, mask: bytes = b"\x1f\x2e\x3d\x4c") -> bytes:
    """Serialise a :class:`RawFrame`."""
    n = len(frame.payload) if frame.claimed_length is None else frame.claimed_length
    head = bytes([(0x80 if frame.fin else 0) | (frame.rsv & 7) << 4 | (frame.opcode & 0x0F)])
    m = 0x80 if frame.masked else 0
    if n < 126:
        head += bytes([m | n])
    elif n < 1 << 16:
        head += bytes([m | 126]) + struct.pack("!H", n)
    else:
        head += bytes([m | 127]) + struct.pack("!Q", n)
    if not frame.masked:
        return head + frame.payload
    body = bytes(b ^ mask[i % 4] for i, b in enumerate(frame.payload)) if len(frame.payload) < 4096 else (
        np.bitwise_xor(np.frombuffer(frame.payload, np.uint8),
                       np.resize(np.frombuffer(mask, np.uint8), len(frame.payload))).tobytes())
    return head + mask + body


class RawWebSocket:
    """A deliberately naive client on a plain socket: it sends any frame, valid or not, and
    reads the server's frames back (servers never mask).

    Args:
        host, port: the server.
        subprotocol: offer this subprotocol (``None``: openpi-compatible mode).
        headers: extra handshake headers.
        timeout: socket timeout for every read.
        source: local address to connect from (to test per-address limits).
    """

    def __init__(self, host: str, port: int, *, subprotocol: str | None = SUBPROTOCOL,
                 headers: Mapping[str, str] | None = None, timeout: float = 10.0, source: str | None = None) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout,
                                             source_address=(source, 0) if source else None)
        key = base64.b64encode(os.urandom(16)).decode()
        lines = ["GET / HTTP/1.1", f"Host: {host}:{port}", "Upgrade: websocket", "Connection: Upgrade",
                 f"Sec-WebSocket-Key: {key}", "Sec-WebSocket-Version: 13"]
        if subprotocol:
            lines.append(f"Sec-WebSocket-Protocol: {subprotocol}")
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        self._buf = b""
        head = self._read_until(b"\r\n\r\n")
        self.status = int(head.split(b" ", 2)[1])
        self.response_head = head.decode(errors="replace")
        self.close_code: int | None = None

    def _fill(self) -> bool:
        try:
            data = self.sock.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            data = b""
        self._buf += data
        return bool(data)

    def _read_until(self, marker: bytes) -> bytes:
        while marker not in self._buf:
            if not self._fill():
                raise ConnectionError("closed during the handshake")
        head, self._buf = self._buf.split(marker, 1)
        return head

    def _read_exact(self, n: int) -> bytes:
        while len(self._buf) < n:
            if not self._fill():
                raise ConnectionError("closed mid-frame")
        out, self._buf = self._buf[:n], self._buf[n:]
        return out

    def send(self, *frames: RawFrame | bytes) -> None:
        """Send frames (or raw bytes) in one write, as one burst."""
        self.sock.sendall(b"".join(f if isinstance(f, bytes) else frame_bytes(f) for f in frames))

    def read_frame(self) -> tuple[int, bytes]:
        """The next frame from the server as ``(opcode, payload)``.

        Raises:
            ConnectionError: the connection ended.
            TimeoutError: nothing within the socket timeout.
        """
        b0, b1 = self._read_exact(2)
        n = b1 & 0x7F
        if n == 126:
            n = struct.unpack("!H", self._read_exact(2))[0]
        elif n == 127:
            n = struct.unpack("!Q", self._read_exact(8))[0]
        if b1 & 0x80:
            raise ConnectionError("the server masked a frame")
        payload = self._read_exact(n)
        opcode = b0 & 0x0F
        if opcode == 8:
            self.close_code = struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else 1005
        return opcode, payload

    def read_messages(self, limit: int = 100) -> tuple[list[tuple[int, bytes]], int | None]:
        """Read frames until the server closes (or ``limit`` frames); returns the data frames and
        the close code (``None`` if the connection ended without a close frame)."""
        out: list[tuple[int, bytes]] = []
        for _ in range(limit):
            try:
                opcode, payload = self.read_frame()
            except ConnectionError:
                return out, self.close_code
            if opcode == 8:
                return out, self.close_code
            out.append((opcode, payload))
        return out, self.close_code

    def close(self) -> None:
        self.sock.close()
