"""The native exchange: ``generate`` -> ``token``... ``done`` (or ``error``), cancellation by task,
and the same answer as the HTTP API for the same seed."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from text_helpers import ServiceHandle, StepGate, small_model

from chunkline.client.wire.errors import ProtocolError
from chunkline.client.wire.protocol import Done, Generate, Token, parse_client_message, parse_server_message
from chunkline.server.core.loopthread import LoopThread
from chunkline.server.core.tenants import ANONYMOUS_TENANT, TenantInfo
from chunkline.server.entrypoints.text_native import handle_generate

pytestmark = pytest.mark.live  # its tests start servers or proxies on loopback


@pytest.fixture(scope="module")
def env() -> Iterator[tuple[ServiceHandle, StepGate]]:
    loop = LoopThread()
    gate = StepGate()
    handle = ServiceHandle([small_model("tiny"), small_model("other")], loop, yield_to=gate).start()
    try:
        yield handle, gate
    finally:
        gate.open()
        handle.close()
        loop.close()


def generate(handle: ServiceHandle, msg: dict[str, Any], tenant: TenantInfo = ANONYMOUS_TENANT) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def send(m: dict[str, Any]) -> None:
        sent.append(m)

    parsed = parse_client_message(msg)
    assert isinstance(parsed, Generate)
    handle.loop.run(handle_generate(handle.service, parsed, tenant, "sess", send))
    return sent


def test_tokens_then_done_and_same_answer_as_http(env: tuple[ServiceHandle, StepGate]) -> None:
    handle, _ = env
    sent = generate(handle, {"type": "generate", "id": 7, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9,
                             "seed": 11, "ignore_eos": True})
    msgs = [parse_server_message(m) for m in sent]
    tokens = [m for m in msgs if isinstance(m, Token)]
    done = msgs[-1]
    assert isinstance(done, Done) and all(isinstance(m, Token) for m in msgs[:-1])
    assert done.id == 7 and done.model == "tiny" and done.finish_reason == "length"  # the default model is the first
    assert done.usage == {"prompt_tokens": 6, "completion_tokens": 9, "total_tokens": 15}
    assert sum(t.tokens for t in tokens) == 9 and [t.index for t in tokens] == sorted(t.index for t in tokens)
    assert done.timing["ttft_ms"] > 0 and done.fingerprint.startswith("sha256:") and not done.late
    text = "".join(t.text for t in tokens)
    client = openai.OpenAI(base_url=handle.base_url, api_key="none", max_retries=0)
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=9, seed=11,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == text


def test_refusals_are_error_messages(env: tuple[ServiceHandle, StepGate]) -> None:
    handle, _ = env
    [err] = generate(handle, {"type": "generate", "id": "a", "model": "nope", "prompt": "x"})
    assert (err["type"], err["id"], err["code"]) == ("error", "a", "unknown_model")
    [err] = generate(handle, {"type": "generate", "id": "b", "prompt": "x" * 300})
    assert err["code"] == "invalid_message" and "context length" in err["message"]
    [err] = generate(handle, {"type": "generate", "id": "c", "prompt": "x"}, TenantInfo("robots", classes=frozenset({"policy"})))
    assert err["code"] == "forbidden"
    with pytest.raises(ProtocolError):
        parse_client_message({"type": "generate", "id": 1})  # neither prompt nor messages


def test_cancelling_the_task_frees_the_slot(env: tuple[ServiceHandle, StepGate]) -> None:
    handle, gate = env
    sent: list[dict[str, Any]] = []
    first = asyncio.Event()

    async def send(m: dict[str, Any]) -> None:
        sent.append(m)
        first.set()

    async def scenario() -> None:
        gate.allow(1)  # one step (the first token), then the engine holds
        msg = parse_client_message({"type": "generate", "id": 1, "model": "other", "prompt": "go", "max_tokens": 60, "ignore_eos": True})
        assert isinstance(msg, Generate)
        task = asyncio.get_running_loop().create_task(handle_generate(handle.service, msg, ANONYMOUS_TENANT, "s2", send))
        await asyncio.wait_for(first.wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(2000):
            if handle.service.in_flight == 0:
                break
            await asyncio.sleep(0.005)

    try:
        handle.loop.run(scenario())
    finally:
        gate.open()
    assert handle.service.in_flight == 0
    assert handle.service.models["other"].backend.engine.active == 0
    assert sent[0]["type"] == "token" and sent[-1] == {"type": "error", "id": 1, "code": "cancelled", "message": "cancelled by the client"}
    assert handle.metric("chunkline_text_output_tokens_total", model="other", tenant="anonymous") == 1


def test_a_failing_send_cancels_the_request(env: tuple[ServiceHandle, StepGate]) -> None:
    handle, _ = env

    async def send(m: dict[str, Any]) -> None:
        raise ConnectionError("gone")

    msg = parse_client_message({"type": "generate", "id": 2, "prompt": "go", "max_tokens": 60, "ignore_eos": True})
    assert isinstance(msg, Generate)

    async def scenario() -> None:
        with pytest.raises(ConnectionError):
            await handle_generate(handle.service, msg, ANONYMOUS_TENANT, "s3", send)
        for _ in range(2000):
            if handle.service.in_flight == 0:
                break
            await asyncio.sleep(0.005)

    handle.loop.run(scenario())
    assert handle.service.in_flight == 0
