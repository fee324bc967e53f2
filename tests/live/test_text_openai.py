"""The real ``openai`` client against the text service's HTTP API, with keys: models, chat and
completions (streamed and not), and the documented errors as the client's own exception types."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator

import openai
import pytest
from text_helpers import ServiceHandle, StepGate, registry_with_keys, small_model

from chunkline.server.core.loopthread import LoopThread
from chunkline.server.core.tenants import TenantInfo, TenantLimits


class Env:
    def __init__(self, handle: ServiceHandle, keys: dict[str, str], gate: StepGate) -> None:
        self.handle = handle
        self.keys = keys
        self.gate = gate

    def client(self, tenant: str = "alice", **kw: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.handle.base_url, api_key=self.keys.get(tenant, tenant), max_retries=0, timeout=30.0, **kw)  # type: ignore[arg-type]

    def raw(self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.handle.port, timeout=10)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    loop = LoopThread()
    gate = StepGate()
    reg, keys = registry_with_keys({
        "alice": TenantInfo("alice"),
        "robots": TenantInfo("robots", classes=frozenset({"policy"})),
        "narrow": TenantInfo("narrow", models=frozenset({"tiny-q"})),
        "small": TenantInfo("small", limits=TenantLimits(text_tokens_per_window=60, text_window_s=1e7)),
    })
    models = [small_model("tiny"), small_model("tiny-q", max_batch=1, max_queue=1)]
    handle = ServiceHandle(models, loop, reg, tmp_path_factory.mktemp("openai") / "ledger.db", yield_to=gate).start()
    try:
        yield Env(handle, keys, gate)
    finally:
        gate.open()
        handle.close()
        loop.close()


def test_models_are_listed_per_tenant(env: Env) -> None:
    assert [m.id for m in env.client().models.list()] == ["tiny", "tiny-q"]
    assert [m.id for m in env.client("narrow").models.list()] == ["tiny-q"]
    assert env.client().models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        env.client("narrow").models.retrieve("tiny")


def test_chat_and_completions_streamed_and_not(env: Env) -> None:
    c = env.client()
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, seed=5)
    assert r.usage.completion_tokens <= 8 and r.choices[0].finish_reason in ("stop", "length")
    assert r.system_fingerprint and r.system_fingerprint.startswith("sha256:")
    text = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, seed=5, stream=True) if ch.choices)
    assert text == r.choices[0].message.content
    # stop strings are honoured and cut out of the answer, streamed or not
    greedy = c.completions.create(model="tiny", prompt="abc", max_tokens=20, temperature=0, extra_body={"ignore_eos": True}).choices[0].text
    stop = greedy[3:5]
    cut = c.completions.create(model="tiny", prompt="abc", max_tokens=20, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == greedy[: greedy.index(stop)]


def test_bad_and_missing_key(env: Env) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        env.client("ck_not-a-real-key").models.list()
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    status, headers, body = env.raw("POST", "/v1/chat/completions", b"{}")
    assert status == 401 and "www-authenticate" in headers and json.loads(body)["error"]["code"] == "invalid_api_key"
    assert env.handle.metric("chunkline_auth_failures_total", reason="missing") >= 1


def test_unauthenticated_request_is_refused_before_its_body_is_read(env: Env) -> None:
    # Headers announce a large body that is never sent: the 401 still comes at once.
    with socket.create_connection(("127.0.0.1", env.handle.port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n")
        reply = s.recv(4096)
    assert reply.startswith(b"HTTP/1.1 401")


def test_unknown_and_forbidden_models(env: Env) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError) as info:
        env.client().chat.completions.create(model="gpt-9", messages=msgs)
    assert info.value.code == "unknown_model"
    with pytest.raises(openai.NotFoundError):  # a model the tenant may not use looks like no model at all
        env.client("narrow").chat.completions.create(model="tiny", messages=msgs)
    with pytest.raises(openai.PermissionDeniedError) as denied:  # a robots-only tenant
        env.client("robots").chat.completions.create(model="tiny", messages=msgs)
    assert denied.value.status_code == 403 and denied.value.code == "forbidden"


def test_invalid_and_unsupported_fields_are_refused_not_dropped(env: Env) -> None:
    c = env.client()
    msgs = [{"role": "user", "content": "hi"}]
    for kwargs, param in [
        ({"temperature": 5}, "temperature"),
        ({"n": 2}, "n"),
        ({"logprobs": True}, "logprobs"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"max_tokens": 1000}, "max_tokens"),
        ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
    ]:
        with pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(model="tiny", messages=msgs, **kwargs)  # type: ignore[call-overload]
        assert info.value.param == param, kwargs
    # neutral values are fine
    c.chat.completions.create(model="tiny", messages=msgs, n=1, presence_penalty=0, max_tokens=2)
    status, _, body = env.raw("POST", "/v1/chat/completions", b"{nope", {"Authorization": f"Bearer {env.keys['alice']}"})
    assert status == 400 and json.loads(body)["error"]["code"] == "invalid_json"
    status, _, _ = env.raw("GET", "/v1/nowhere", None, {"Authorization": f"Bearer {env.keys['alice']}"})
    assert status == 404


def test_over_quota_is_a_rate_limit_error_with_retry_after(env: Env) -> None:
    c = env.client("small")
    msgs = [{"role": "user", "content": "hi"}]
    # 6 + 40 of 60 tokens, all of them used: a sampled EOS would end it early and hand back the
    # unused reservation (the next request would then fit, as it did once in a full run).
    first = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=40, extra_body={"ignore_eos": True})
    assert first.usage is not None and first.usage.completion_tokens == 40
    with pytest.raises(openai.RateLimitError) as info:
        c.chat.completions.create(model="tiny", messages=msgs, max_tokens=40)
    assert info.value.code == "quota_exceeded"
    assert int(info.value.response.headers["retry-after"]) >= 1
    labels = {"class": "text", "model": "tiny", "reason": "quota_exceeded:text_tokens"}
    assert env.handle.metric("chunkline_refusals_total", **labels) >= 1


def test_queue_full_refusal(env: Env) -> None:
    c = env.client()
    env.gate.allow(1)  # the first request gets one step (its first token), then the engine holds
    results: list[object] = []
    threads = []
    try:
        first = c.chat.completions.create(model="tiny-q", messages=[{"role": "user", "content": "one"}], max_tokens=30, stream=True)
        next(iter(first))  # running, and frozen by the gate
        t = threading.Thread(target=lambda: results.append(c.chat.completions.create(
            model="tiny-q", messages=[{"role": "user", "content": "two"}], max_tokens=3)))
        t.start()
        threads.append(t)
        give_up = time.monotonic() + 10
        while env.handle.service.models["tiny-q"].core.queued < 1 and time.monotonic() < give_up:
            time.sleep(0.005)
        with pytest.raises(openai.InternalServerError) as info:
            c.chat.completions.create(model="tiny-q", messages=[{"role": "user", "content": "three"}], max_tokens=3)
        assert info.value.status_code == 503 and info.value.code == "overloaded"
        assert int(info.value.response.headers["retry-after"]) >= 1
    finally:
        env.gate.open()
    first.close()
    for t in threads:
        t.join(10)
    assert len(results) == 1  # the queued one was served once the engine moved again


def test_metrics_and_ledger_record_text_requests(env: Env) -> None:
    c = env.client()
    before = env.handle.metric("chunkline_requests_total", **{"class": "text", "model": "tiny", "tenant": "alice", "outcome": "ok"})
    r = c.completions.create(model="tiny", prompt="count me", max_tokens=6, extra_body={"ignore_eos": True})
    after = env.handle.metric("chunkline_requests_total", **{"class": "text", "model": "tiny", "tenant": "alice", "outcome": "ok"})
    assert after == before + 1
    assert env.handle.metric("chunkline_text_time_to_first_token_seconds_count", model="tiny") >= 1
    assert env.handle.metric("chunkline_text_time_per_output_token_seconds_count", model="tiny") >= 1
    ledger = env.handle.ledger
    assert ledger is not None and ledger.flush(5.0)
    rows = [s for s in ledger.summary() if s.tenant == "alice"]
    assert rows and rows[0].tokens_out >= r.usage.completion_tokens and rows[0].tokens_in >= r.usage.prompt_tokens
