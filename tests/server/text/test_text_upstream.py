"""The upstream adapter against scripted upstreams (httpx mock transports): one retry owner,
retries only before the first byte, deadline and cancellation propagated, translation loss
refused or reported, malformed answers refused, error mapping."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from text_helpers import small_model

from chunkline.server.text.backend import Delta, Finished, GenerationRequest
from chunkline.server.text.errors import UnsupportedParameter
from chunkline.server.text.sampling import SamplingParams
from chunkline.server.text.tokenizer import ChatMessage
from chunkline.server.text.upstream import (
    DEADLINE_HEADER,
    UpstreamBackend,
    map_upstream_error,
)


def chunk(content: str | None = None, finish: str | None = None) -> bytes:
    delta = {} if content is None else {"content": content}
    return b"data: " + json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}).encode() + b"\n\n"


def usage(p: int, c: int) -> bytes:
    return b"data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": p, "completion_tokens": c}}).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def sse_response(parts: list[bytes], *, delay: float = 0.0, on_close: Callable[[], None] | None = None,
                 fail_after: int | None = None) -> httpx.Response:
    async def body() -> AsyncIterator[bytes]:
        try:
            for i, p in enumerate(parts):
                if fail_after is not None and i == fail_after:
                    raise httpx.ReadError("connection reset")
                if delay:
                    await asyncio.sleep(delay)
                yield p
        finally:
            if on_close is not None:
                on_close()

    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())


def request(**params: Any) -> GenerationRequest:
    set_fields = frozenset(k for k in params if k != "max_tokens") | ({"max_tokens"} if "max_tokens" in params else set())
    return GenerationRequest("chat", "up", messages=(ChatMessage("user", "hi"),), params=SamplingParams(**params),
                             max_tokens_set="max_tokens" in params, set_fields=frozenset(set_fields))


def run(handler: Callable[[httpx.Request], Any], req: GenerationRequest, *, deadline_s: float = 5.0,
        cancel_after: int | None = None, **cfg: Any) -> tuple[list[Delta], Finished, UpstreamBackend]:
    async def main() -> tuple[list[Delta], Finished, UpstreamBackend]:
        backend = UpstreamBackend(small_model("up", backend="upstream", upstream_url="http://upstream.test/v1", **cfg),
                                  time.perf_counter, transport=httpx.MockTransport(handler))
        await backend.start()
        events: asyncio.Queue[Any] = asyncio.Queue()
        backend.launch("k", backend.prepare(req), priority=0, deadline=time.perf_counter() + deadline_s, emit=events.put_nowait)
        deltas: list[Delta] = []
        while True:
            ev = await asyncio.wait_for(events.get(), 10)
            if isinstance(ev, Finished):
                await backend.stop()
                return deltas, ev, backend
            deltas.append(ev)
            if cancel_after is not None and len(deltas) == cancel_after:
                backend.cancel("k")

    return asyncio.run(main())


def test_plain_stream_with_usage() -> None:
    seen: list[httpx.Request] = []

    def handler(r: httpx.Request) -> httpx.Response:
        seen.append(r)
        return sse_response([chunk("hel"), chunk("lo"), chunk(None, "stop"), usage(5, 2), DONE])

    deltas, fin, backend = run(handler, request(max_tokens=8, seed=3))
    assert "".join(d.text for d in deltas) == "hello"
    assert (fin.reason, fin.prompt_tokens, fin.completion_tokens, fin.usage_reported, fin.loss) == ("stop", 5, 2, True, ())
    body = json.loads(seen[0].content)
    assert body["model"] == "up" and body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 8 and body["seed"] == 3 and "temperature" not in body  # only what the caller set
    budget = float(seen[0].headers[DEADLINE_HEADER])
    assert 0 < budget <= 5000.0  # the remaining first-token budget travels along
    assert backend.attempts == 1


def test_retries_only_before_the_first_byte() -> None:
    calls = 0

    def flaky(r: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        if calls == 1:
            return httpx.Response(503, headers={"retry-after": "0"}, json={"error": {"message": "busy"}})
        return sse_response([chunk("ok"), chunk(None, "stop"), usage(1, 1), DONE])

    deltas, fin, backend = run(flaky, request(), upstream_retries=1)
    assert fin.reason == "stop" and backend.attempts == 2 and "".join(d.text for d in deltas) == "ok"

    calls = 0

    def breaks_mid_stream(r: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        return sse_response([chunk("a"), chunk("b"), chunk("c")], fail_after=1)

    deltas, fin, backend = run(breaks_mid_stream, request(), upstream_retries=3)
    assert fin.reason == "error" and fin.error is not None and fin.error.code_str == "upstream_error"
    assert calls == 1 and [d.text for d in deltas] == ["a"]  # a byte reached the caller: no retry

    def refuses_connection(r: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    _, fin, backend = run(refuses_connection, request(), upstream_retries=0)
    assert backend.attempts == 1 and fin.error is not None and fin.error.http_status == 502


def test_rate_limit_is_retried_only_when_the_wait_fits_the_deadline() -> None:
    calls = 0

    def limited(r: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        return httpx.Response(429, headers={"retry-after": "30"}, json={"error": {"message": "slow down"}})

    _, fin, _ = run(limited, request(), deadline_s=2.0, upstream_retries=2)
    assert calls == 1 and fin.error is not None
    assert (fin.error.code_str, fin.error.http_status, fin.error.retry_after_ms) == ("rate_limited", 429, 30000.0)


def test_first_token_deadline_and_stall() -> None:
    async def never(r: httpx.Request) -> httpx.Response:
        await asyncio.sleep(30)
        raise AssertionError("unreachable")

    t = time.perf_counter()
    _, fin, _ = run(never, request(), deadline_s=0.2)
    assert fin.error is not None and fin.error.code_str == "upstream_timeout" and fin.error.http_status == 504
    assert time.perf_counter() - t < 5.0
    _, fin, _ = run(lambda r: sse_response([chunk("a"), chunk("b")], delay=0.5), request(), deadline_s=5.0, upstream_stall_timeout_s=0.1)
    assert fin.error is not None and "stalled" in fin.error.message


def test_cancellation_closes_the_upstream_stream() -> None:
    closed: list[bool] = []
    parts = [chunk(str(i)) for i in range(50)] + [chunk(None, "length"), DONE]
    deltas, fin, _ = run(lambda r: sse_response(parts, delay=0.01, on_close=lambda: closed.append(True)), request(), cancel_after=2)
    assert fin.reason == "cancelled" and closed == [True] and len(deltas) < 50


def test_translation_loss_refused_or_reported() -> None:
    def ok(r):
        return sse_response([chunk("x"), chunk(None, "stop"), usage(2, 1), DONE])
    with pytest.raises(UnsupportedParameter) as info:
        run(ok, request(seed=1), upstream_unsupported=["seed"], translation_loss="refuse")
    assert info.value.param == "seed" and info.value.http_status == 400
    seen: list[dict[str, Any]] = []

    def capture(r: httpx.Request) -> httpx.Response:
        seen.append(json.loads(r.content))
        return ok(r)

    _, fin, _ = run(capture, request(seed=1, temperature=0.5), upstream_unsupported=["seed"], translation_loss="report")
    assert "seed" not in seen[0] and seen[0]["temperature"] == 0.5
    assert [(x.field, x.action) for x in fin.loss] == [("seed", "dropped")]
    # a request that does not set the field loses nothing
    _, fin, _ = run(ok, request(), upstream_unsupported=["seed"], translation_loss="refuse")
    assert fin.loss == ()


def test_stop_and_max_tokens_are_enforced_when_the_upstream_ignores_them() -> None:
    def ignores_stop(r):
        return sse_response([chunk("hello "), chunk("EN"), chunk("D and more"), chunk(None, "length"), usage(2, 4), DONE])
    deltas, fin, _ = run(ignores_stop, request(stop=("END",)))
    assert "".join(d.text for d in deltas) == "hello " and fin.reason == "stop"
    assert ("stop", "enforced") in [(x.field, x.action) for x in fin.loss]
    def babbles(r):
        return sse_response([chunk("w") for _ in range(10)] + [chunk(None, "length"), DONE])
    deltas, fin, _ = run(babbles, request(max_tokens=3))
    assert "".join(d.text for d in deltas) == "www" and fin.reason == "length" and fin.completion_tokens == 3
    assert {(x.field, x.action) for x in fin.loss} == {("max_tokens", "enforced"), ("usage", "estimated")}


def test_missing_usage_is_estimated_and_reported() -> None:
    _, fin, _ = run(lambda r: sse_response([chunk("a"), chunk("b"), chunk(None, "stop"), DONE]), request())
    assert fin.completion_tokens == 2 and not fin.usage_reported
    assert [(x.field, x.action) for x in fin.loss] == [("usage", "estimated")]


@pytest.mark.parametrize("body", [
    [b"data: {nope\n\n"],
    [b'data: {"object": "chat.completion.chunk"}\n\n'],
    [b'data: {"choices": [{"delta": {"content": 5}}]}\n\n'],
    [chunk("half"), b'data: {"error": {"message": "engine died"}}\n\n'],
])
def test_malformed_upstream_answers_are_upstream_errors(body: list[bytes]) -> None:
    _, fin, _ = run(lambda r: sse_response(body), request(), upstream_retries=0)
    assert fin.reason == "error" and fin.error is not None and fin.error.code_str == "upstream_error" and fin.error.http_status == 502


def test_error_mapping() -> None:
    h = httpx.Headers({"retry-after": "7"})
    ctx = map_upstream_error(400, b'{"error": {"message": "This model\'s maximum context length is 4096 tokens", "code": null}}', httpx.Headers())
    assert (ctx.code_str, ctx.http_status) == ("context_length_exceeded", 400)
    assert (map_upstream_error(429, b"{}", h).http_status, map_upstream_error(429, b"{}", h).retry_after_ms) == (429, 7000.0)
    assert map_upstream_error(503, b"{}", h).code_str == "overloaded"
    assert map_upstream_error(401, b'{"error": {"message": "bad key"}}', h).http_status == 502  # the gateway's config, not the caller
    assert map_upstream_error(500, b"<html>", h).code_str == "upstream_error"
    assert map_upstream_error(400, b'{"error": {"message": "bad", "param": "top_p"}}', h).param == "top_p"
