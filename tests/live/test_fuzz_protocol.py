"""Structure-aware fuzzing of the WebSocket protocol against a live server.

Every fuzzed frame is checked against an oracle built from docs/protocol.md
(:func:`chunkline.bench.fuzz.expect_native`): the server answers with the documented error or
close code, answers every request id exactly once, never leaves a session hanging, and a
bystander session on the same server keeps being served. The full-size run is
``chunkline bench fuzz``.
"""

from __future__ import annotations

import socket
import struct
import textwrap
import time
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from chunkline.bench import fuzz
from chunkline.bench.serverproc import ServerProcess, http_get
from chunkline.client import Client
from chunkline.client.wire.codec import encode
from chunkline.client.wire.protocol import SUBPROTOCOL

# derandomize: the same examples every run (no flaky failures); database=None: nothing is
# written under the repository.
FUZZ = settings(deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    config = tmp_path_factory.mktemp("fuzz") / "server.toml"
    config.write_text(textwrap.dedent(f"""
        no_auth = true
        max_message_bytes = {fuzz.FUZZ_MAX_MESSAGE_BYTES}
        open_timeout_s = 1.0

        [[policies]]
        ref = "{fuzz.FUZZ_POLICY_REF}"
        name = "fuzz"
    """))
    with ServerProcess(["--config", str(config)]) as proc:
        yield proc


@pytest.fixture(scope="module")
def bystander(server: ServerProcess) -> Iterator[Client]:
    """A session that stays open through all the fuzzing and must keep being served."""
    with Client.connect(server.uri) as client:
        yield client


def assert_unaffected(server: ServerProcess, bystander: Client, session: str) -> None:
    assert bystander.hello is not None and bystander.hello.session == session, "the bystander was disconnected"
    reply = bystander.infer({"state": np.ones(14, np.float32)}, deadline_ms=10_000)
    assert reply.actions.shape == (fuzz.FUZZ_SPEC.horizon, fuzz.FUZZ_SPEC.action_dim)
    assert server.proc is not None and server.proc.poll() is None
    assert http_get(server.host, server.port, "/healthz")[0] == 200
    log = server.log()
    for sign in ("Traceback", "connection handler failed", "Task exception was never retrieved", "internal"):
        assert sign not in log, f"{sign!r} in the server log:\n{log[-3000:]}"


def test_native_frames_get_the_documented_answer(server: ServerProcess, bystander: Client) -> None:
    session = bystander.hello.session if bystander.hello else ""
    probe = fuzz.NativeProbe(server.uri, strict_ids=True)

    @settings(FUZZ, max_examples=400)
    @given(fuzz.native_frames())
    def check(frame: bytes) -> None:
        probe.check(frame)

    try:
        check()
    finally:
        probe.close()
    assert probe.frames >= 400
    # The oracle saw the interesting outcomes, not just one kind of refusal.
    sentinels = probe.frames - sum(probe.closes.values())
    assert probe.chunks - sentinels >= 10  # valid fuzzed infers were answered with chunks
    assert {"invalid_message", "invalid_observation"} <= set(probe.errors)
    assert probe.closes.get(1009, 0) >= 1
    assert_unaffected(server, bystander, session)


def test_websocket_level_abuse(server: ServerProcess, bystander: Client) -> None:
    session = bystander.hello.session if bystander.hello else ""
    seen: set[str] = set()
    kinds = list(fuzz.WS_KINDS)

    @settings(FUZZ, max_examples=100)
    @given(fuzz.ws_scenarios(kinds))
    def check(scenario) -> None:
        fuzz.check_ws_scenario(server.host, server.port, scenario)
        seen.add(scenario[0])

    check()
    assert len(seen) >= len(kinds) - 3
    assert_unaffected(server, bystander, session)


def test_compat_mode_frames(server: ServerProcess, bystander: Client) -> None:
    session = bystander.hello.session if bystander.hello else ""
    kinds: dict[str, int] = {}

    @settings(FUZZ, max_examples=60)
    @given(fuzz.native_frames())
    def check(frame: bytes) -> None:
        expect = fuzz.check_compat(server.uri, frame)
        kinds[expect.kind] = kinds.get(expect.kind, 0) + 1

    check()
    assert kinds.get("error", 0) >= 10
    assert_unaffected(server, bystander, session)


def test_the_oracle_catches_a_wrong_answer(server: ServerProcess) -> None:
    # The probe is only worth something if it fails on a server that answers wrongly: pretend
    # the policy had a different horizon, and a valid infer's chunk no longer matches.
    import dataclasses

    wrong = dataclasses.replace(fuzz.FUZZ_SPEC, horizon=11)
    probe = fuzz.NativeProbe(server.uri, spec=wrong)
    with pytest.raises(fuzz.FuzzFailure, match="chunk of shape"):
        probe.check(encode({"type": "infer", "id": 5, "obs": {"state": np.zeros(14, np.float32)}}))
    probe.close()


def test_an_error_never_echoes_an_invalid_request_id(server: ServerProcess) -> None:
    probe = fuzz.NativeProbe(server.uri, strict_ids=True)
    try:
        for bad_id in (-1, 2**63, "x" * 65, ""):
            probe.check(encode({"type": "infer", "id": bad_id, "obs": {"state": np.zeros(14, np.float32)}}))
    finally:
        probe.close()


def test_invalid_utf8_text_closes_with_a_documented_code(server: ServerProcess) -> None:
    scenario = ("bad-utf8-text", [fuzz.RawFrame(1, b"ok\xff")], ("close", {1003, 1007}))
    fuzz.check_ws_scenario(server.host, server.port, scenario)


def test_slow_loris_handshake_is_cut(server: ServerProcess) -> None:
    # open_timeout_s = 1: a client that trickles its handshake is disconnected, whatever it sends.
    request = (f"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               f"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
               f"Sec-WebSocket-Protocol: {SUBPROTOCOL}\r\nX-Padding: " + "a" * 200).encode()
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        start = time.monotonic()
        cut = False
        for byte in request:
            try:
                sock.sendall(bytes([byte]))
                sock.settimeout(0.05)
                if sock.recv(1) == b"":
                    cut = True
                    break
            except TimeoutError:
                continue
            except (ConnectionResetError, BrokenPipeError):
                cut = True
                break
        held = time.monotonic() - start
    assert cut, "a handshake trickled for longer than open_timeout_s was never cut"
    assert held < 8.0  # a hang guard: the cut comes at about 1 s


def test_a_stalled_partial_frame_blocks_nobody_else(server: ServerProcess, bystander: Client) -> None:
    session = bystander.hello.session if bystander.hello else ""
    ws = fuzz.RawWebSocket(server.host, server.port)
    try:
        ws.read_frame()  # hello
        header = bytes([0x82, 0x80 | 126]) + struct.pack("!H", 1000) + b"\x00\x00\x00\x00"
        ws.send(header + b"\x00" * 10)  # 10 of 1000 promised bytes, then silence
        assert_unaffected(server, bystander, session)
        with Client.connect(server.uri) as other:  # new sessions are served meanwhile
            assert other.infer({"state": np.zeros(14, np.float32)}).actions.shape == (10, 14)
    finally:
        ws.close()


def test_the_seed_frames_on_the_live_server(server: ServerProcess) -> None:
    # The hand-made corpus seeds (ext types, claimed sizes, deep nesting, pickles, ...) each get
    # their documented answer on a real session.
    probe = fuzz.NativeProbe(server.uri, strict_ids=True)
    try:
        for frame in fuzz.seed_corpus().values():
            probe.check(frame)
    finally:
        probe.close()
    assert probe.errors.get("invalid_message", 0) >= 15
