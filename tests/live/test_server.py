"""Integration: a real server process on loopback, real clients (native, sync, openpi drop-in, raw)."""

from __future__ import annotations

import asyncio
import time

import msgpack
import numpy as np
import pytest
import repo_paths
from helpers import aloha_obs
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from chunkline.bench.serverproc import ServerProcess, http_get
from chunkline.client import AsyncClient, Client, ErrorCode, ServerError
from chunkline.client.openpi import WebsocketClientPolicy
from chunkline.client.wire.codec import decode, encode
from chunkline.client.wire.protocol import SUBPROTOCOL


def run(coro):
    return asyncio.run(coro)


def test_health_and_readiness(noop_server: ServerProcess) -> None:
    assert http_get("127.0.0.1", noop_server.port, "/healthz")[0] == 200
    assert http_get("127.0.0.1", noop_server.port, "/readyz")[0] == 200
    assert http_get("127.0.0.1", noop_server.port, "/nope")[0] == 404


def test_native_chunk_carries_robot_clock_times_and_timing(noop_server: ServerProcess) -> None:
    async def go():
        async with AsyncClient(noop_server.uri) as client:
            assert client.hello is not None and client.hello.default_model == "noop"
            meta = client.hello.models["noop"]
            assert meta["action_horizon"] == 50 and meta["action_dim"] == 14
            reply = await client.infer(aloha_obs(), obs_time=123.5, deadline_ms=1000)
            return meta, reply

    meta, reply = run(go())
    assert reply.actions.shape == (50, 14) and reply.actions.dtype == np.float32
    assert reply.t0 == pytest.approx(123.5 + meta["action_offset"])
    assert reply.dt == pytest.approx(meta["dt"])
    assert reply.expires == pytest.approx(reply.t0 + meta["valid_for"])
    assert reply.fingerprint == meta["fingerprint"] and not reply.late
    for key in ("decode_ms", "queue_ms", "infer_ms", "encode_ms", "server_ms", "batch_size"):
        assert key in reply.timing
    assert reply.timing["server_ms"] >= reply.timing["infer_ms"]


def test_several_requests_in_flight_are_matched_by_id(noop_server: ServerProcess) -> None:
    async def go():
        async with AsyncClient(noop_server.uri) as client:
            replies = await asyncio.gather(*(client.infer(aloha_obs(i), obs_time=float(i)) for i in range(8)))
            return replies

    replies = run(go())
    assert sorted(r.t0 for r in replies) == [float(i) for i in range(8)]
    assert len({r.id for r in replies}) == 8


def test_sync_client_and_openpi_dropin(noop_server: ServerProcess) -> None:
    with Client.connect(noop_server.uri) as client:
        reply = client.infer(aloha_obs(), obs_time=1.0)
        assert reply.actions.shape == (50, 14)
    policy = WebsocketClientPolicy("127.0.0.1", noop_server.port)
    assert policy.get_server_metadata()["action_horizon"] == 50
    out = policy.infer(aloha_obs())
    assert out["actions"].shape == (50, 14) and "infer_ms" in out["server_timing"]
    policy.close()


def test_nested_openpi_style_observations_are_flattened(noop_server: ServerProcess) -> None:
    obs = aloha_obs()
    nested = {"images": {k.split("/", 1)[1]: obs.pop(k) for k in list(obs) if k.startswith("images/")}, **obs}
    with Client.connect(noop_server.uri) as client:
        assert client.infer(nested).actions.shape == (50, 14)


def test_invalid_observation_fails_the_request_not_the_session(noop_server: ServerProcess) -> None:
    async def go():
        async with AsyncClient(noop_server.uri) as client:
            bad = aloha_obs()
            del bad["state"]
            with pytest.raises(ServerError) as missing:
                await client.infer(bad)
            wrong = aloha_obs()
            wrong["images/cam_high"] = np.zeros((224, 224, 3), np.float32)
            with pytest.raises(ServerError) as dtype:
                await client.infer(wrong)
            with pytest.raises(ServerError) as model:
                await client.infer(aloha_obs(), model="nope")
            ok = await client.infer(aloha_obs())
            return missing.value, dtype.value, model.value, ok

    missing, dtype, model, ok = run(go())
    assert missing.code == ErrorCode.INVALID_OBSERVATION and "state" in missing.message
    assert dtype.code == ErrorCode.INVALID_OBSERVATION and "dtype" in dtype.message
    assert model.code == ErrorCode.UNKNOWN_MODEL
    assert ok.actions.shape == (50, 14)


BAD_FRAMES = {
    "object dtype": msgpack.packb({"type": "infer", "id": 1, "obs": {"state": {b"__ndarray__": True, b"data": b"\x00" * 8, b"dtype": "|O", b"shape": [1]}}}),
    "length lie": msgpack.packb({"type": "infer", "id": 2, "obs": {"state": {b"__ndarray__": True, b"data": b"\x00" * 7, b"dtype": "<f4", b"shape": [14]}}}),
    "huge shape": msgpack.packb({"type": "infer", "id": 3, "obs": {"state": {b"__ndarray__": True, b"data": b"", b"dtype": "<f4", b"shape": [2**31, 2**31]}}}),
    "truncated": encode({"type": "infer", "id": 4, "obs": aloha_obs()})[:5000],
    "pickle": b"\x80\x04\x95\x1d\x00\x00\x00\x00\x00\x00\x00\x8c\x05posix\x94\x8c\x06system\x94\x93\x94\x8c\x02id\x94\x85\x94R\x94.",
    "not a map": msgpack.packb([1, 2, 3]),
    "unknown type": msgpack.packb({"type": "launch", "id": 5}),
    "bad id": msgpack.packb({"type": "infer", "id": -5, "obs": {}}),
}


@pytest.mark.parametrize("name", sorted(BAD_FRAMES))
def test_bad_frames_get_a_typed_error_and_other_sessions_are_unaffected(noop_server: ServerProcess, name: str) -> None:
    async def go():
        async with AsyncClient(noop_server.uri) as bystander:
            async with connect(noop_server.uri, subprotocols=[SUBPROTOCOL], compression=None) as ws:
                decode(await ws.recv())  # hello
                await ws.send(BAD_FRAMES[name])
                err = decode(await asyncio.wait_for(ws.recv(), 5))
                # The session survives: a valid request on it still works.
                await ws.send(encode({"type": "infer", "id": 99, "obs": aloha_obs()}))
                ok = decode(await asyncio.wait_for(ws.recv(), 5))
            other = await bystander.infer(aloha_obs())
            return err, ok, other

    err, ok, other = run(go())
    assert err["type"] == "error" and err["code"] == ErrorCode.INVALID_MESSAGE.value
    assert ok["type"] == "chunk" and ok["id"] == 99
    assert other.actions.shape == (50, 14)


def test_text_frame_in_native_mode_closes_1003(noop_server: ServerProcess) -> None:
    async def go():
        async with connect(noop_server.uri, subprotocols=[SUBPROTOCOL]) as ws:
            await ws.recv()
            await ws.send("hello?")
            with pytest.raises(ConnectionClosed):
                await asyncio.wait_for(ws.recv(), 5)
            return ws.close_code

    assert run(go()) == 1003


def test_oversized_message_closes_1009_before_buffering(noop_server: ServerProcess) -> None:
    # Only a frame header claiming 9 MiB is sent: the server must close on the header alone.
    import socket
    import struct

    from websockets.sync.client import connect as sync_connect

    with sync_connect(noop_server.uri, subprotocols=[SUBPROTOCOL], max_size=None) as ws:
        ws.recv()
        sock: socket.socket = ws.socket
        mask = b"\x01\x02\x03\x04"
        sock.sendall(b"\x82" + bytes([0x80 | 127]) + struct.pack("!Q", 9 * 1024 * 1024) + mask + b"\x00" * 1024)
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=5)
        assert ws.close_code == 1009


def test_duplicate_id_in_flight_is_refused(noop_server: ServerProcess) -> None:
    async def go():
        async with connect(noop_server.uri, subprotocols=[SUBPROTOCOL], compression=None) as ws:
            await ws.recv()
            frame = encode({"type": "infer", "id": "a", "obs": aloha_obs()})
            await ws.send(frame)
            await ws.send(frame)
            replies = [decode(await asyncio.wait_for(ws.recv(), 5)) for _ in range(2)]
            return replies

    replies = run(go())
    kinds = sorted((r["type"], r.get("code")) for r in replies)
    # The second copy either overlaps the first (duplicate_id) or arrives after it finished.
    assert kinds in ([("chunk", None), ("chunk", None)], [("chunk", None), ("error", "duplicate_id")])


def test_openpi_compat_mode_frames(noop_server: ServerProcess) -> None:
    async def go():
        async with connect(noop_server.uri, compression=None) as ws:
            meta = decode(await ws.recv())
            await ws.send(encode(aloha_obs()))
            reply = decode(await ws.recv())
            bad = aloha_obs()
            del bad["images/cam_high"]
            await ws.send(encode(bad))
            text = await ws.recv()
            with pytest.raises(ConnectionClosed):
                await ws.recv()
            return meta, reply, text, ws.close_code

    meta, reply, text, code = run(go())
    assert meta["action_horizon"] == 50 and "fingerprint" in meta
    assert reply["actions"].shape == (50, 14) and "infer_ms" in reply["server_timing"]
    assert isinstance(text, str) and "invalid_observation" in text
    assert code == 1011


def test_a_long_inference_does_not_block_the_event_loop(sleepy_server: ServerProcess) -> None:
    """Checked by order, not by the clock: health checks and a new session's handshake are all
    answered while a 2 s inference is still running. A loop blocked by the inference would answer
    the first check only once the inference ended, and its reply would then be in before the
    next check's answer, however busy the machine."""
    async def go():
        async with AsyncClient(sleepy_server.uri) as client:
            inference = asyncio.create_task(client.infer(aloha_obs(), deadline_ms=10_000))
            await asyncio.sleep(0.3)  # let the 2 s inference start
            assert not inference.done()
            loop = asyncio.get_running_loop()
            for _ in range(3):
                status, _ = await loop.run_in_executor(None, http_get, "127.0.0.1", sleepy_server.port, "/healthz")
                assert status == 200
            async with connect(sleepy_server.uri, subprotocols=[SUBPROTOCOL]) as other:
                await other.recv()  # hello: a new handshake completes during the inference
                pong = await other.ping()
                await asyncio.wait_for(pong, 1)
            still_running = not inference.done()
            reply = await inference
            return still_running, reply

    still_running, reply = run(go())
    assert still_running, "health checks and a handshake waited for the inference: the event loop was blocked"
    assert reply.timing["infer_ms"] >= 1900


def test_deadline_passed_in_queue_is_refused_not_run(sleepy_server: ServerProcess) -> None:
    async def go():
        async with AsyncClient(sleepy_server.uri) as client:
            first = asyncio.create_task(client.infer(aloha_obs(), deadline_ms=10_000))
            await asyncio.sleep(0.2)
            with pytest.raises(ServerError) as info:
                await client.infer(aloha_obs(1), deadline_ms=300)  # queued behind a 2 s inference
            await first
            return info.value

    err = run(go())
    assert err.code in (ErrorCode.DEADLINE_EXCEEDED, ErrorCode.DEADLINE_UNMEETABLE)


def test_sigterm_drains_in_flight_then_closes_1001() -> None:
    with ServerProcess(["--policy", "sleep:1", "--shutdown-grace", "10"]) as server:
        async def go():
            async with AsyncClient(server.uri) as client:
                request = asyncio.create_task(client.infer(aloha_obs(), deadline_ms=10_000))
                await asyncio.sleep(0.3)
                server.terminate()
                reply = await request
                # Readiness goes off during the drain; the session then closes with 1001.
                await asyncio.sleep(0.1)
                ws = client._ws
                if ws is not None:
                    await asyncio.wait_for(ws.wait_closed(), 10)
                return reply, None if ws is None else ws.close_code

        reply, code = run(go())
        assert reply.actions.shape == (50, 14)
        assert code in (None, 1001)
        assert server.proc is not None and server.proc.wait(20) == 0


def test_policy_failure_fails_only_that_request_and_the_lane_survives() -> None:
    with ServerProcess(["--policy", "policies_for_tests:flaky"], env=repo_paths.env_with_tests_on_path()) as server:
        with Client.connect(server.uri) as client:
            poison = aloha_obs()
            poison["state"] = poison["state"].copy()
            poison["state"][0] = 1000.0
            with pytest.raises(ServerError) as info:
                client.infer(poison)
            assert info.value.code == ErrorCode.POLICY_FAILED
            assert client.infer(aloha_obs()).actions.shape == (50, 14)  # same lane, next request fine


def test_a_policy_that_fails_warmup_is_never_served() -> None:
    server = ServerProcess(["--policy", "policies_for_tests:bad_shape"], env=repo_paths.env_with_tests_on_path())
    with pytest.raises(RuntimeError) as info:
        server.start()
    assert "server exited with 2" in str(info.value) and "expected [1, 50, 14]" in str(info.value)


@pytest.mark.slow
def test_cancel_withdraws_a_queued_request(sleepy_server: ServerProcess) -> None:
    async def go():
        async with AsyncClient(sleepy_server.uri) as client:
            running = asyncio.create_task(client.infer(aloha_obs(), deadline_ms=10_000))
            await asyncio.sleep(0.2)
            queued = asyncio.create_task(client.infer(aloha_obs(1), deadline_ms=10_000))
            await asyncio.sleep(0.1)
            t = time.perf_counter()
            queued.cancel()  # the client sends `cancel`; the server withdraws it from the queue
            with pytest.raises(asyncio.CancelledError):
                await queued
            first = await running
            # The cancelled request never ran: the second 2 s inference would push this past 3.5 s.
            third = await client.infer(aloha_obs(2), deadline_ms=10_000)
            return first, third, time.perf_counter() - t

    first, third, elapsed = run(go())
    assert first.actions.shape == third.actions.shape == (50, 14)
    assert third.timing["queue_ms"] < 100, "the cancelled request must not have occupied the lane"
