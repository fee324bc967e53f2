"""The attacking side of ``python -m chunkline.bench.hostile``, each run in a process of its own
(the ``--child`` and ``--upstream`` modes): ``decode`` (2048x2048 JPEG frames as fast as
possible, retry times ignored), ``raw`` (the same frames raw, 12 MiB each: the server's reads
alone), ``plan`` (plans with such an image, sent on to a fake upstream), ``fds`` (idle
connections to the HTTP port beyond the open-files limit), and the controls ``control-copy``
(16 MiB copies) and ``control-spin`` (a busy loop) at background priority on the server's CPUs,
where its image work runs: the floor such work sets for the bystander's tail."""

from __future__ import annotations

import asyncio
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["CONTROLS", "FLOODS", "FRAME_SIDE", "OPENED", "UNDER_WAY", "background_load", "decode_flood", "fake_upstream",
           "fd_flood", "plan_flood", "raw_flood", "serve_fake_upstream"]

FRAME_SIDE = 2048

#: What an attacker prints once every session has its first requests sent (fds: once the
#: connections are open); the bystander's block starts after it.
UNDER_WAY = "under way"


class _UnderWay:
    """Prints :data:`UNDER_WAY` once ``sessions`` sessions have called :meth:`sent`."""

    def __init__(self, sessions: int) -> None:
        self.left = sessions

    def sent(self) -> None:
        self.left -= 1
        if self.left == 0:
            print(UNDER_WAY, flush=True)


async def _flood(uri: str, headers: dict[str, str], sessions: int, in_flight: int,
                 message: Callable[[int], dict[str, Any]]) -> None:
    """``sessions`` connections, each keeping ``in_flight`` messages out and sending the next on
    every answer, refusals included (retry times ignored); a dropped connection reconnects."""
    import websockets
    from websockets.typing import Subprotocol

    from chunkline.client.wire.encoder import Encoder
    from chunkline.client.wire.protocol import SUBPROTOCOL

    under_way = _UnderWay(sessions)

    async def session() -> None:
        ids = 0
        while True:
            try:
                async with websockets.connect(uri, subprotocols=[Subprotocol(SUBPROTOCOL)], max_size=None,
                                              additional_headers=headers) as ws:
                    await ws.recv()  # the hello
                    encoder = Encoder()
                    for _ in range(in_flight):
                        ids += 1
                        await ws.send(encoder.encode_oob(message(ids)))
                    under_way.sent()
                    while True:
                        await ws.recv()
                        ids += 1
                        await ws.send(encoder.encode_oob(message(ids)))
            except Exception:  # whatever ended this connection (the server closed or cut it): the attack goes on
                await asyncio.sleep(0.01)

    await asyncio.gather(*(session() for _ in range(sessions)))


async def decode_flood(uri: str, key: str, sessions: int, in_flight: int) -> None:
    from chunkline.client.wire.encodings import ENCODINGS_HEADER, encode_array

    ramp = np.linspace(0, 255, FRAME_SIDE, dtype=np.float32)
    noise = np.random.default_rng(1).normal(0, 1, (FRAME_SIDE, FRAME_SIDE, 3))
    image = np.clip(ramp[:, None, None] * 0.5 + ramp[None, :, None] * 0.5 + noise, 0, 255).astype(np.uint8)
    frame = encode_array(image, "jpeg", 90)  # a camera-like frame: mostly smooth, some noise
    obs = {"cam": frame, "state": np.zeros(2, np.float32)}

    await _flood(uri, {"Authorization": f"Api-Key {key}", ENCODINGS_HEADER: "jpeg"}, sessions, in_flight,
                 lambda i: {"type": "infer", "id": i, "model": "camera", "obs": obs})


def _noise_image() -> np.ndarray:
    """A 2048x2048 RGB image of noise (12 MiB raw; PNG cannot shrink it)."""
    return np.random.default_rng(2).integers(0, 256, (FRAME_SIDE, FRAME_SIDE, 3), dtype=np.uint8)


async def raw_flood(uri: str, key: str, sessions: int, in_flight: int) -> None:
    """The plan attack's 12 MiB images as raw camera frames to a robot model: the server reads
    them as it reads a plan's, with nothing to decode, encode or upload."""
    obs = {"cam": _noise_image(), "state": np.zeros(2, np.float32)}

    await _flood(uri, {"Authorization": f"Api-Key {key}"}, sessions, in_flight,
                 lambda i: {"type": "infer", "id": i, "model": "camera", "obs": obs})


async def plan_flood(uri: str, key: str, sessions: int, in_flight: int) -> None:
    obs = {"images/cam": _noise_image(), "position": np.zeros(2, np.float32)}

    await _flood(uri, {"Authorization": f"Api-Key {key}"}, sessions, in_flight,
                 lambda i: {"type": "plan", "id": i, "obs": obs, "instruction": "go", "deadline_ms": 30000.0})


#: The attacks that flood the robot port, each ``flood(uri, key, sessions, in_flight)``.
FLOODS = {"decode": decode_flood, "raw": raw_flood, "plan": plan_flood}


def background_load(copy: bool) -> None:
    """A control on the server's CPUs at background priority (as the server's image work runs
    there), until killed: copying 16 MiB buffers (``copy``, what encoding and uploading a plan's
    image does to the core's caches) or spinning (only the scheduler's hand-over)."""
    from chunkline.server.core.background import to_background

    to_background()
    if not copy:
        print(UNDER_WAY, flush=True)
        while True:
            pass
    src = np.random.default_rng(3).integers(0, 256, 16 << 20, dtype=np.uint8)
    dst = np.empty_like(src)
    print(UNDER_WAY, flush=True)
    while True:
        np.copyto(dst, src)


def serve_fake_upstream() -> None:
    """An OpenAI-compatible upstream answering every chat completion with one fixed plan; prints
    its port, serves until killed."""
    import http.server
    import json

    body = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": json.dumps(
        {"steps": [{"skill": "hold", "target": None, "goal": None}], "note": ""})}, "finish_reason": "stop"}]}).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", "0")))
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            return None

    class Server(http.server.ThreadingHTTPServer):
        def handle_error(self, request: Any, client_address: Any) -> None:
            return None  # a plan cancelled while its answer was written: nothing to report

    server = Server(("127.0.0.1", 0), Handler)
    print(server.server_address[1], flush=True)
    server.serve_forever()


def fake_upstream() -> tuple[int, subprocess.Popen[str]]:
    """The fake upstream in a process of its own: reading megabytes of plan requests must not
    take the bystander robot's turns in this process (a real upstream is another machine)."""
    proc = subprocess.Popen([sys.executable, "-m", "chunkline.bench.hostile", "--attack", "plan", "--upstream"],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return int(proc.stdout.readline()), proc


def fd_flood(port: int, count: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    held: list[socket.socket] = []
    under_way = _UnderWay(1)
    opened = 0
    while True:
        while len(held) < count:
            try:
                held.append(socket.create_connection(("127.0.0.1", port), timeout=1))
            except OSError:
                break
            opened += 1
        if under_way.left:
            under_way.sent()
        print(f"{OPENED} {time.monotonic():.4f} {opened}", flush=True)
        alive = []
        for s in held:  # reopen what the server closed
            s.setblocking(False)
            try:
                closed = s.recv(1) == b""
            except BlockingIOError:
                closed = False
            except OSError:
                closed = True
            if closed:
                s.close()
            else:
                alive.append(s)
        held = alive
        time.sleep(0.05)



#: What the fds attacker prints after each round of reconnecting: the time and how many
#: connections it has opened so far.
OPENED = "opened"


#: The conditions that attack nothing: background load on the server's CPUs (:func:`background_load`).
CONTROLS = ("control-copy", "control-spin")
