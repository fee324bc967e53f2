"""Acceptance against a real ``chunkline serve`` process with text enabled: the ``openai`` client
(keys, models, streamed and whole chat completions, the documented errors as its own exception
types), the native ``generate`` exchange on the robot port, and ledger rows with token counts."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import openai
import pytest
import websockets
from tenants_files import TenantsFile

from chunkline.bench.serverproc import ServerProcess
from chunkline.client.wire.codec import decode, encode
from chunkline.client.wire.protocol import SUBPROTOCOL
from chunkline.server.core.ledger import summarize


@pytest.fixture(scope="module")
def served(tenants_file: TenantsFile) -> Iterator[tuple[ServerProcess, dict[str, str]]]:
    path, keys = tenants_file({"alice": {}, "small": {"limits": {"text_tokens_per_window": 60, "text_window_s": 3600.0}}},
                              keys=("alice", "small"))
    with ServerProcess(["--policy", "noop", "--tenants", str(path), "--text-model", "tiny", "--http-port", "0"]) as server:
        yield server, keys


def _client(server: ServerProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key=key, max_retries=0, timeout=30.0)


def test_openai_client_against_chunkline_serve(served: tuple[ServerProcess, dict[str, str]]) -> None:
    server, keys = served
    c = _client(server, keys["alice"])
    assert [m.id for m in c.models.list()] == ["tiny"]
    msgs = [{"role": "user", "content": "hello robots"}]
    whole = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, seed=4, extra_body={"ignore_eos": True})
    assert whole.usage.prompt_tokens == 1 + 1 + len("hello robots") + 1 + 1 and whole.usage.completion_tokens == 10
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=10, seed=4, stream=True, extra_body={"ignore_eos": True}) if ch.choices)
    assert streamed == whole.choices[0].message.content
    with pytest.raises(openai.AuthenticationError):
        _client(server, "ck_wrong").models.list()
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="no-such-model", messages=msgs)
    small = _client(server, keys["small"])
    small.chat.completions.create(model="tiny", messages=msgs, max_tokens=30)
    with pytest.raises(openai.RateLimitError) as info:
        small.chat.completions.create(model="tiny", messages=msgs, max_tokens=30)
    assert int(info.value.response.headers["retry-after"]) >= 1


def test_native_generate_on_the_robot_port(served: tuple[ServerProcess, dict[str, str]]) -> None:
    server, keys = served

    async def main() -> list[dict[str, object]]:
        async with websockets.connect(server.uri, subprotocols=[SUBPROTOCOL],
                                      additional_headers={"Authorization": f"Api-Key {keys['alice']}"}) as ws:
            hello = decode(await ws.recv())
            assert hello["text_models"] == ["tiny"]
            await ws.send(encode({"type": "generate", "id": 1, "prompt": "hi", "max_tokens": 6, "ignore_eos": True}))
            out = []
            while True:
                msg = decode(await ws.recv())
                out.append(msg)
                if msg["type"] in ("done", "error"):
                    return out

    msgs = asyncio.run(main())
    assert msgs[-1]["type"] == "done" and msgs[-1]["usage"]["completion_tokens"] == 6
    assert sum(m["tokens"] for m in msgs if m["type"] == "token") == 6


def test_ledger_rows_carry_token_counts(served: tuple[ServerProcess, dict[str, str]]) -> None:
    server, keys = served
    _client(server, keys["alice"]).completions.create(model="tiny", prompt="bill me", max_tokens=3, extra_body={"ignore_eos": True})
    give_up = time.monotonic() + 10
    while time.monotonic() < give_up:  # the ledger writes in batches, at most ~1 s old
        rows = {s.tenant: s for s in summarize(server.ledger_path)}
        if "alice" in rows and rows["alice"].tokens_out >= 3 + 10 + 10 + 6:
            break
        time.sleep(0.1)
    assert rows["alice"].tokens_out >= 3 + 10 + 10 + 6 and rows["alice"].tokens_in > 0
