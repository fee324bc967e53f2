"""The server's own frame reader on a live server: whatever frames a client mixes (fragmented
messages, pings, observations in one frame, a pipelined handshake), every request is answered as
without the reader, and the session takes messages in the order they were sent (see
:mod:`chunkline.server.entrypoints.frame_reader`)."""

from __future__ import annotations

import asyncio
import base64
import os
import socket
from typing import Any

import numpy as np
from helpers import aloha_obs
from websockets.asyncio.client import connect
from websockets.frames import Frame, Opcode
from wire_helpers import server_frame

from chunkline.bench.serverproc import ServerProcess
from chunkline.client.wire.codec import Encoder, decode
from chunkline.client.wire.protocol import SUBPROTOCOL


def _infer(request_id: int, oob: bool = True) -> bytes:
    message = {"type": "infer", "id": request_id, "obs": aloha_obs(request_id), "obs_time": float(request_id)}
    return Encoder().encode_oob(message) if oob else Encoder().encode(message)


def test_fragmented_pinged_and_whole_observations_are_all_answered(noop_server: ServerProcess) -> None:
    async def go() -> list[dict[str, Any]]:
        async with connect(noop_server.uri, subprotocols=[SUBPROTOCOL], max_size=None, compression=None) as ws:
            decode(await ws.recv())  # hello
            await ws.send(_infer(1))
            whole = _infer(2)
            await ws.send([whole[i:i + 100_000] for i in range(0, len(whole), 100_000)])  # a fragmented message
            await ws.ping(b"between")
            await ws.send(_infer(3, oob=False))  # the msgpack-numpy layout
            await ws.send(_infer(4))
            replies = [decode(await asyncio.wait_for(ws.recv(), 30)) for _ in range(4)]
            pong = await asyncio.wait_for(await ws.ping(b"after"), 30)  # the connection still answers pings
            assert pong >= 0
            return replies

    replies = asyncio.run(go())
    # Each request its own chunk (several are in flight: replies come in the order answered).
    assert sorted((r["type"], r["id"], r["t0"]) for r in replies) == [("chunk", i, float(i)) for i in (1, 2, 3, 4)]


def _frame(payload: bytes) -> bytes:
    return Frame(Opcode.BINARY, payload).serialize(mask=True)


def test_frames_pipelined_behind_the_handshake_are_answered(noop_server: ServerProcess) -> None:
    # A client that does not wait for the 101: the handshake and two requests in one write.
    key = base64.b64encode(os.urandom(16)).decode()
    head = (f"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: {SUBPROTOCOL}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", noop_server.port), timeout=30) as s:
        s.sendall(head + _frame(_infer(7)) + _frame(_infer(8)))
        data = b""
        while b"\r\n\r\n" not in data:
            data += _received(s)
        assert data.startswith(b"HTTP/1.1 101 ")
        body = data.split(b"\r\n\r\n", 1)[1]
        messages: list[dict[str, Any]] = []
        while sum(m["type"] == "chunk" for m in messages) < 2:  # the hello, then a chunk for each request
            message, body = server_frame(body)
            if message is None:
                body += _received(s)
                continue
            messages.append(decode(message))
    chunks = [m for m in messages if m["type"] == "chunk"]
    assert [c["id"] for c in chunks] == [7, 8]
    assert np.asarray(chunks[0]["actions"]).shape == (50, 14)


def _received(s: socket.socket) -> bytes:
    data = s.recv(1 << 20)
    assert data, "the server closed the connection"
    return data




def test_a_message_read_here_never_overtakes_one_websockets_holds() -> None:
    # A fragmented message (websockets parses its frames) and a whole one right behind it: the
    # session takes them in the order they were sent, both already on the server.
    from listener_helpers import listening

    from chunkline.server.entrypoints.connection import BudgetedConnection

    first, second = bytes([1]) * 300_000, bytes([2]) * 300_000

    async def go() -> list[bytes]:
        taken: list[bytes] = []

        async def handler(ws: BudgetedConnection) -> None:
            for _ in range(1000):  # both are on the server before the session takes either
                if ws.held_bytes() >= len(first) + len(second):
                    break
                await asyncio.sleep(0.01)
            taken.extend([bytes(await ws.next_message()), bytes(await ws.next_message())])
            await ws.send(b"done")

        async with listening(handler) as server:
            async with connect(f"ws://127.0.0.1:{server.port}", max_size=None, compression=None) as client:
                await client.send([first[:100_000], first[100_000:]])
                await client.send(second)
                assert await asyncio.wait_for(client.recv(), 30) == b"done"
        return taken

    assert asyncio.run(go()) == [first, second]
