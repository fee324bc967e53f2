"""Faults and transport limits against a real server: hung policy, slow readers, connection caps, TLS."""

from __future__ import annotations

import asyncio
import socket
import ssl
import subprocess
import time
from pathlib import Path

import pytest
import repo_paths
from helpers import aloha_obs
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from chunkline.bench.serverproc import ServerProcess, http_get
from chunkline.client import ChunklineError, Client, ErrorCode, ServerError
from chunkline.client.wire.codec import encode
from chunkline.client.wire.protocol import SUBPROTOCOL


@pytest.mark.slow
def test_a_hung_policy_fails_requests_at_their_deadline_and_its_lane_is_replaced() -> None:
    with ServerProcess(["--policy", "policies_for_tests:hangs", "--hang-timeout", "1", "--max-batch-size", "1"],
                       env=repo_paths.env_with_tests_on_path()) as server:
        with Client.connect(server.uri) as client:
            wedge = aloha_obs()
            wedge["state"] = wedge["state"].copy()
            wedge["state"][0] = 555.0
            t = time.monotonic()
            with pytest.raises(ServerError) as info:
                client.infer(wedge, deadline_ms=300)
            waited = time.monotonic() - t
            assert info.value.code == ErrorCode.DEADLINE_EXCEEDED and waited < 1.0
            time.sleep(1.2)  # past the hang timeout: the lane is declared hung and replaced
            assert http_get("127.0.0.1", server.port, "/readyz")[0] == 503
            assert client.infer(aloha_obs(), deadline_ms=1000).actions.shape == (50, 14)  # the new lane serves
            give_up = time.monotonic() + 10
            while http_get("127.0.0.1", server.port, "/readyz")[0] != 200:  # ready again once the stuck call returns
                assert time.monotonic() < give_up
                time.sleep(0.1)


def test_a_client_that_does_not_read_is_disconnected() -> None:
    import numpy as np

    with ServerProcess(["--policy", "policies_for_tests:big_reply", "--send-timeout", "1"], env=repo_paths.env_with_tests_on_path()) as server:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
        sock.connect(("127.0.0.1", server.port))
        key = "dGhlIHNhbXBsZSBub25jZQ=="
        sock.sendall((f"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                      f"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: {SUBPROTOCOL}\r\n\r\n").encode())
        mask = b"\x00\x00\x00\x00"
        # Send requests for 256 KiB chunks and never read a reply: the server's buffers fill, then
        # the reply cannot be written within the send timeout and the server cuts the peer off.
        cut = False
        give_up = time.monotonic() + 30
        sock.settimeout(0.2)
        i = 0
        while time.monotonic() < give_up and not cut:
            payload = encode({"type": "infer", "id": i, "obs": {"state": np.zeros(14, np.float32)}})
            i += 1
            try:
                sock.sendall(b"\x82" + bytes([0x80 | len(payload)]) + mask + payload if len(payload) < 126 else
                             b"\x82" + bytes([0x80 | 126]) + len(payload).to_bytes(2, "big") + mask + payload)
            except (BrokenPipeError, ConnectionResetError):
                cut = True
            except TimeoutError:
                time.sleep(0.2)
        sock.close()
        assert cut, "the server must disconnect a peer that never reads"
        with Client.connect(server.uri) as other:  # and it keeps serving everyone else
            assert other.infer({"state": np.zeros(14, np.float32)}).actions.shape == (1000, 64)


def test_connections_per_address_are_capped() -> None:
    with ServerProcess(["--policy", "noop", "--max-connections-per-address", "2"]) as server:
        async def go():
            a = await connect(server.uri, subprotocols=[SUBPROTOCOL])
            b = await connect(server.uri, subprotocols=[SUBPROTOCOL])
            with pytest.raises(InvalidStatus) as info:
                await connect(server.uri, subprotocols=[SUBPROTOCOL])
            await a.close()
            await asyncio.sleep(0.1)
            c = await connect(server.uri, subprotocols=[SUBPROTOCOL])  # a slot freed up
            await b.close()
            await c.close()
            return info.value.response.status_code

        assert asyncio.run(go()) == 503


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True)
    return cert, key


def test_tls(certificate: tuple[Path, Path]) -> None:
    cert, key = certificate
    with ServerProcess(["--policy", "noop", "--tls-cert", str(cert), "--tls-key", str(key)]) as server:
        context = ssl.create_default_context(cafile=str(cert))
        uri = f"wss://127.0.0.1:{server.port}"
        with Client.connect(uri, ssl=context) as client:
            assert client.infer(aloha_obs()).actions.shape == (50, 14)
        with pytest.raises((ssl.SSLError, ChunklineError, OSError)):  # an unverified certificate is refused by default
            Client.connect(uri, connect_timeout=1)
