"""Adapter conformance: the same cases, through the real ``openai`` client, against every text
backend: the embedded model, and the upstream adapter pointed at a second chunkline text server on
loopback. Cases: plain messages, streaming, a cancelled stream, the context-length error, usage
accounting, a first-token timeout, a rate limit, a malformed upstream response."""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from text_helpers import ServiceHandle, StepGate, registry_with_keys, small_model

from chunkline.server.core.loopthread import LoopThread
from chunkline.server.core.tenants import TenantInfo, TenantLimits
from chunkline.server.text.backend import GenerationRequest
from chunkline.server.text.job import TextJob
from chunkline.server.text.sampling import SamplingParams

pytestmark = pytest.mark.live  # its tests start servers or proxies on loopback

CAP = 100  # text tokens of the capped tenant: one request of ~75 fits, the second does not


@dataclasses.dataclass
class Harness:
    kind: str
    loop: LoopThread
    front: ServiceHandle  # what the client talks to
    backing: ServiceHandle  # where tokens are generated (the same service for the embedded backend)
    key: str
    capped_key: str
    capped_model: str
    gate: StepGate  # holds the backing engine between steps
    ledger_path: Path
    reference: str  # base URL whose answers this backend must reproduce
    reference_key: str

    def client(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.front.base_url, api_key=key or self.key, max_retries=0, timeout=30.0)

    def hold_slots(self, n: int) -> list[TextJob]:
        """Occupy ``n`` of the backing engine's slots with long requests (they never finish while gated)."""
        svc = self.backing.service
        tenant = self.backing.auth.registry.get("holder")
        assert tenant is not None

        async def submit() -> list[TextJob]:
            jobs = []
            for i in range(n):
                req = GenerationRequest("completion", "tiny", prompt=f"hold {i}", params=SamplingParams(max_tokens=64, ignore_eos=True, seed=i),
                                        max_tokens_set=True)
                jobs.append(svc.submit(req, tenant, "holder"))
            return jobs

        return self.loop.run(submit())

    def release(self, jobs: list[TextJob]) -> None:
        async def cancel() -> None:
            for job in jobs:
                self.backing.service.cancel(job)

        self.loop.run(cancel())

    def wait_idle(self, handle: ServiceHandle, timeout: float = 10.0) -> None:
        give_up = time.monotonic() + timeout
        while handle.service.in_flight and time.monotonic() < give_up:
            time.sleep(0.005)
        assert handle.service.in_flight == 0


def _tenants() -> dict[str, TenantInfo]:
    big = TenantLimits(text_tokens_per_window=10_000_000, text_window_s=1e7)
    return {
        "user": TenantInfo("user", limits=big),
        "holder": TenantInfo("holder", limits=big),
        "capped": TenantInfo("capped", limits=TenantLimits(text_tokens_per_window=CAP, text_window_s=1e7)),
    }


async def _bad_upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers every request 200 with an event stream that is not JSON."""
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
                 b"data: {this is not json\n\n")
    await writer.drain()
    writer.close()


@pytest.fixture(scope="module", params=["embedded", "upstream"])
def harness(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    loop = LoopThread()
    gate = StepGate()
    tmp = tmp_path_factory.mktemp(request.param)
    model = small_model("tiny", max_batch=2, max_queue=4, max_output_tokens=96)
    handles: list[ServiceHandle] = []
    try:
        if request.param == "embedded":
            reg, keys = registry_with_keys(_tenants())
            front = ServiceHandle([model], loop, reg, tmp / "ledger.db", yield_to=gate).start()
            handles.append(front)
            h = Harness("embedded", loop, front, front, keys["user"], keys["capped"], "tiny", gate, tmp / "ledger.db",
                        front.base_url, keys["user"])
        else:
            tenants = _tenants()
            tenants["gw"] = TenantInfo("gw", limits=TenantLimits(text_tokens_per_window=10_000_000, text_window_s=1e7))
            tenants["gwcap"] = TenantInfo("gwcap", limits=TenantLimits(text_tokens_per_window=CAP, text_window_s=1e7))
            back_reg, back_keys = registry_with_keys(tenants)
            backing = ServiceHandle([model], loop, back_reg, tmp / "backing.db", yield_to=gate).start()
            handles.append(backing)
            bad = loop.run(asyncio.start_server(_bad_upstream, "127.0.0.1", 0))
            bad_url = f"http://127.0.0.1:{bad.sockets[0].getsockname()[1]}/v1"
            up = {"backend": "upstream", "upstream_url": backing.base_url, "upstream_model": "tiny", "max_batch": 8, "max_queue": 16,
                  "max_output_tokens": 96}
            front_reg, front_keys = registry_with_keys({"user": TenantInfo("user"), "capped": TenantInfo("capped")})
            front = ServiceHandle([
                small_model("tiny", **up, upstream_api_key=back_keys["gw"]),
                small_model("tiny-capped", **up, upstream_api_key=back_keys["gwcap"]),
                small_model("tiny-bad", backend="upstream", upstream_url=bad_url, upstream_retries=0),
            ], loop, front_reg, tmp / "ledger.db").start()
            handles.append(front)
            h = Harness("upstream", loop, front, backing, front_keys["user"], front_keys["user"], "tiny-capped", gate,
                        tmp / "ledger.db", backing.base_url, back_keys["user"])
        yield h
    finally:
        gate.open()
        for handle in reversed(handles):
            handle.close()
        loop.close()


MESSAGES = [{"role": "system", "content": "answer briefly"}, {"role": "user", "content": "what is a chunk?"}]
PROMPT_TOKENS = 1 + (1 + len("answer briefly") + 1) + (1 + len("what is a chunk?") + 1) + 1  # byte-level template


def _chat(client: openai.OpenAI, model: str = "tiny", **kw: object) -> object:
    args: dict[str, object] = {"model": model, "messages": MESSAGES, "max_tokens": 12, "seed": 42, "temperature": 0.8,
                               "extra_body": {"ignore_eos": True}}
    args.update(kw)
    return client.chat.completions.create(**args)  # type: ignore[call-overload]


def test_plain_messages(harness: Harness) -> None:
    r = _chat(harness.client())
    assert r.object == "chat.completion" and r.model == "tiny"
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "length"
    assert len(r.choices[0].message.content.encode()) >= 1
    assert r.usage.prompt_tokens == PROMPT_TOKENS and r.usage.completion_tokens == 12
    # The same seed gives the same answer as the model's own server: nothing lost in translation.
    ref = _chat(openai.OpenAI(base_url=harness.reference, api_key=harness.reference_key, max_retries=0))
    assert r.choices[0].message.content == ref.choices[0].message.content
    loss = (r.model_extra or {}).get("chunkline")
    assert loss is None  # everything was honoured


def test_streaming(harness: Harness) -> None:
    whole = _chat(harness.client()).choices[0].message.content
    stream = _chat(harness.client(), stream=True, stream_options={"include_usage": True})
    parts, reasons, usage, roles = [], [], None, 0
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            roles += c.delta.role == "assistant"
            if c.delta.content:
                parts.append(c.delta.content)
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert "".join(parts) == whole
    assert reasons == ["length"] and roles == 1
    assert usage is not None and usage.prompt_tokens == PROMPT_TOKENS and usage.completion_tokens == 12
    # completions endpoint, streamed, too
    text = "".join(c.choices[0].text for c in harness.client().completions.create(
        model="tiny", prompt="once upon", max_tokens=5, seed=1, stream=True) if c.choices)
    assert text == harness.client().completions.create(model="tiny", prompt="once upon", max_tokens=5, seed=1).choices[0].text


def _outcomes(path: Path, cls: str = "text") -> list[tuple[str, int, int]]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT outcome, tokens_in, tokens_out FROM requests WHERE class = ? ORDER BY rowid", (cls,)).fetchall()
    finally:
        conn.close()


def test_cancelled_stream_frees_the_slot(harness: Harness) -> None:
    client = harness.client()
    harness.gate.allow(1)  # one step (the first token), then the engine holds: the cancel alone must free the slot
    try:
        stream = _chat(client, stream=True, max_tokens=64)
        first = next(iter(stream))  # the role chunk: the request is running
        assert first.choices[0].delta.role == "assistant"
        stream.close()
        harness.wait_idle(harness.front)
        harness.wait_idle(harness.backing)
    finally:
        harness.gate.open()
    assert harness.backing.service.models["tiny"].backend.engine.active == 0
    for handle in {id(harness.front): harness.front, id(harness.backing): harness.backing}.values():
        assert handle.metric("chunkline_requests_total", **{"class": "text", "model": "tiny", "outcome": "cancelled",
                                                            "tenant": "user" if handle is harness.front else "gw"}) >= 1
    handle = harness.backing
    assert handle.ledger is not None and handle.ledger.flush(5.0)
    cancelled = [r for r in _outcomes(handle.ledger.path) if r[0] == "cancelled"]
    assert cancelled and cancelled[-1][2] == 1  # generation stopped after the first token
    # and the model is free for the next request
    assert _chat(client, max_tokens=3).usage.completion_tokens == 3


def test_context_length_error(harness: Harness) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        harness.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * 400}], max_tokens=5)
    assert info.value.status_code == 400 and info.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as info:
        harness.client().completions.create(model="tiny", prompt="y" * 180, max_tokens=96)
    assert info.value.code == "context_length_exceeded"  # prompt + max_tokens over the context of 256


def test_usage_accounting(harness: Harness) -> None:
    ledger = harness.front.ledger
    assert ledger is not None and ledger.flush(5.0)
    before = len(_outcomes(ledger.path))
    tokens_in = harness.front.metric("chunkline_text_input_tokens_total", model="tiny", tenant="user")
    tokens_out = harness.front.metric("chunkline_text_output_tokens_total", model="tiny", tenant="user")
    r = _chat(harness.client(), max_tokens=7)
    c = harness.client().completions.create(model="tiny", prompt="abc", max_tokens=4, stop=["\x00"], seed=3)
    assert c.usage.prompt_tokens == 4 and c.usage.completion_tokens == 4 and c.usage.total_tokens == 8
    assert ledger.flush(5.0)
    rows = _outcomes(ledger.path)[before:]
    assert rows == [("ok", r.usage.prompt_tokens, 7), ("ok", 4, 4)]
    assert harness.front.metric("chunkline_text_input_tokens_total", model="tiny", tenant="user") - tokens_in == r.usage.prompt_tokens + 4
    assert harness.front.metric("chunkline_text_output_tokens_total", model="tiny", tenant="user") - tokens_out == 11
    usage = harness.front.quotas.usage("user", time.monotonic())
    assert usage.in_flight == 0  # every reservation was released


def test_first_token_timeout(harness: Harness) -> None:
    harness.gate.close()
    jobs = harness.hold_slots(2)  # the backing model is busy and will not move
    try:
        t = time.monotonic()
        with pytest.raises(openai.APIStatusError) as info:
            _chat(harness.client(), extra_headers={"X-Chunkline-Deadline-Ms": "300"})
        elapsed = time.monotonic() - t
    finally:
        harness.release(jobs)
        harness.gate.open()
    assert info.value.status_code in (503, 504)
    assert info.value.code in ("deadline_unmeetable", "deadline_exceeded", "upstream_timeout", "overloaded")
    assert elapsed < 10.0  # answered, not left hanging behind requests that never finish
    harness.wait_idle(harness.backing)


def test_rate_limit(harness: Harness) -> None:
    client = harness.client(harness.capped_key)
    first = _chat(client, model=harness.capped_model, max_tokens=40)
    assert first.usage.total_tokens <= CAP
    with pytest.raises(openai.RateLimitError) as info:
        _chat(client, model=harness.capped_model, max_tokens=40)
    assert info.value.status_code == 429
    assert int(info.value.response.headers["retry-after"]) >= 1


def test_malformed_upstream_response(harness: Harness) -> None:
    if harness.kind == "embedded":
        pytest.skip("the embedded backend has no upstream whose answers could be malformed")
    for stream in (False, True):
        with pytest.raises(openai.APIStatusError) as info:
            r = _chat(harness.client(), model="tiny-bad", stream=stream)
            if stream:
                list(r)
        assert info.value.status_code == 502 and info.value.code == "upstream_error"
