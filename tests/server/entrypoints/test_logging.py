"""The server's logs: quiet probes, one line per session open and close, a JSON format that parses."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import time
from collections.abc import Callable, Iterator

import pytest
from helpers import aloha_obs
from websockets.sync.client import connect as sync_connect

from chunkline.bench.serverproc import ServerProcess, http_get
from chunkline.client import AsyncClient
from chunkline.client.wire.codec import decode, encode
from chunkline.server.entrypoints.logging_setup import JsonFormatter, configure_logging


def _lines(server: ServerProcess) -> list[str]:
    return server.log_path.read_text(errors="replace").splitlines()


def _wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll another process's log (bounded: it has no event to wait on)."""
    give_up = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > give_up:
            raise AssertionError("timed out waiting for the server's log")
        time.sleep(0.02)


@pytest.fixture()
def restore_root_logger() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    ws_level = logging.getLogger("websockets").level
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)
    logging.getLogger("websockets").setLevel(ws_level)


def test_json_lines_carry_time_level_logger_message_fields_and_exceptions(restore_root_logger: None) -> None:
    out = io.StringIO()
    configure_logging("info", "json", stream=out)
    log = logging.getLogger("chunkline.test")
    log.info("session %s open", "abc", extra={"tenant": "acme", "duration_s": 1.5})
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("it failed")
    logging.getLogger("websockets.server").info("connection open")  # per-connection chatter: held back
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(lines) == 2
    first, second = lines
    assert first["level"] == "INFO" and first["logger"] == "chunkline.test" and first["message"] == "session abc open"
    assert first["tenant"] == "acme" and first["duration_s"] == 1.5
    assert first["time"].endswith("+00:00") and "T" in first["time"]
    assert second["level"] == "ERROR" and "ValueError: boom" in second["exception"]


def test_debug_lets_the_websocket_library_speak(restore_root_logger: None) -> None:
    out = io.StringIO()
    configure_logging("DEBUG", "text", stream=out)
    logging.getLogger("websockets.server").debug("< GET / HTTP/1.1")
    assert "websockets.server" in out.getvalue()
    with pytest.raises(ValueError):
        configure_logging("INFO", "xml")
    assert isinstance(JsonFormatter(), logging.Formatter)


def test_probes_log_nothing_and_a_session_logs_one_open_and_one_close_line(noop_server: ServerProcess) -> None:
    server = noop_server
    start = len(_lines(server))
    for i in range(50):
        assert http_get("127.0.0.1", server.port, "/healthz" if i % 2 else "/readyz")[0] == 200

    async def session() -> str:
        async with AsyncClient(server.uri) as client:
            await client.infer(aloha_obs(), deadline_ms=5000)
            assert client.hello is not None
            return client.hello.session

    session_id = asyncio.run(session())
    _wait_for(lambda: any(f"session {session_id} closed" in line for line in _lines(server)))
    # The background timing of batch sizes logs its progress ("policy noop: ...") whenever it
    # finds a quiet spell: not the lines under test here.
    new = [line for line in _lines(server)[start:] if "chunkline.server: policy noop: " not in line]
    # Nothing for the 50 probes (websockets logged one INFO line for each), one line each way for the session.
    assert len(new) == 2, new
    opened, closed = new
    assert f"session {session_id} open: tenant " in opened and "mode native" in opened and "peer 127.0.0.1" in opened
    assert f"session {session_id} closed: " in closed and "close code 1000" in closed


def test_json_format_lines_parse_and_carry_the_sessions_fields(server_process: Callable[..., ServerProcess]) -> None:
    server = server_process(["--policy", "noop", "--log-format", "json"])
    with sync_connect(server.uri, compression=None, max_size=None) as ws:  # no subprotocol: openpi-compatible
        decode(ws.recv())  # the metadata
        ws.send(encode(aloha_obs()))
        assert decode(ws.recv())["actions"].shape == (50, 14)
    _wait_for(lambda: any('"duration_s"' in line for line in _lines(server)))
    lines = [json.loads(line) for line in _lines(server)]  # every line, start-up included
    assert all({"time", "level", "logger", "message"} <= line.keys() for line in lines)
    assert any(line["message"] == "ready" for line in lines)
    sessions = [line for line in lines if "session" in line]
    assert [line["message"].split(":")[0].rsplit(" ", 1)[1] for line in sessions] == ["open", "closed"]
    opened, closed = sessions
    assert opened["mode"] == "openpi" and opened["model"] == "noop" and opened["peer"] == "127.0.0.1"
    assert closed["session"] == opened["session"] and closed["tenant"] == opened["tenant"]
    assert closed["duration_s"] >= 0 and closed["close_code"] in (1000, 1001, 1005)
