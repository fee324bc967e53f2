"""The upstream adapter: a text backend that forwards to any OpenAI-compatible engine by URL
(vLLM, SGLang, llama.cpp's server, another chunkline server).

Rules it keeps:

* **Deadline propagated.** The first token must arrive before the request's time-to-first-token
  deadline: connecting, sending and waiting for the first token are bounded by what is left of
  it, and what is left is sent along (``X-Chunkline-Deadline-Ms``; a chunkline upstream admits
  against it, others ignore it). Once streaming, a silence longer than
  ``upstream_stall_timeout_s`` ends the request.
* **Cancellation propagated.** Cancelling closes the upstream stream (its connection), which an
  engine takes as the client going away and frees the sequence.
* **One retry owner.** This adapter is the only layer that retries (the HTTP client is built with
  no transport retries), and only before the first byte reached the caller: connection
  failures and ``502/503/504``, and ``429`` when its ``Retry-After`` fits the deadline.
* **No silent translation loss.** A field the upstream is configured as unable to honour is
  refused (400) or, with ``translation_loss = "report"``, left out and reported; ``stop`` and
  ``max_tokens`` are enforced here when the upstream ignores them (reported ``enforced``); usage
  the upstream does not report is estimated and reported ``estimated``. The report is in the
  response body (``chunkline.translation_loss``) and the ``X-Chunkline-Translation-Loss`` header.
* **Malformed upstream data** (not JSON, no choices, a broken stream) ends the request with
  ``upstream_error`` (502), never a half-truth.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from typing import Any, TypeVar

import httpx

from chunkline.server.text.backend import (
    Delta,
    Emit,
    Finished,
    GenerationRequest,
    LossItem,
    PreparedRequest,
    TextBackend,
    text_fingerprint,
)
from chunkline.server.text.config import TextModelConfig
from chunkline.server.text.errors import (
    TextError,
    UnsupportedParameter,
    UpstreamError,
    UpstreamTimeout,
)
from chunkline.server.text.load import TextLoadModel
from chunkline.server.text.sampling import OutputText

__all__ = ["UpstreamBackend", "DEADLINE_HEADER", "map_upstream_error"]

log = logging.getLogger("chunkline.server.text")

DEADLINE_HEADER = "X-Chunkline-Deadline-Ms"
_RETRY_STATUS = frozenset({502, 503, 504})
# Fields the gateway can apply itself when the upstream cannot.
_ENFORCEABLE = frozenset({"stop", "max_tokens"})
_MAX_ERROR_BODY = 64 * 1024
T = TypeVar("T")


def _retry_after_ms(headers: httpx.Headers) -> float | None:
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds * 1000.0 if math.isfinite(seconds) and seconds >= 0 else None


def map_upstream_error(status: int, body: bytes, headers: httpx.Headers) -> UpstreamError:
    """The error to give the caller for an upstream's non-200 answer.

    Args:
        status: the upstream's HTTP status.
        body: its body (an OpenAI error object, usually).
        headers: its headers (``Retry-After``).
    """
    message, code, param = "", None, None
    try:
        err = json.loads(body).get("error")
        if isinstance(err, dict):
            message = str(err.get("message") or "")[:500]
            code = err.get("code")
            param = err.get("param") if isinstance(err.get("param"), str) else None
        elif isinstance(err, str):
            message = err[:500]
    except (ValueError, AttributeError):
        message = body[:200].decode("utf-8", "replace")
    retry = _retry_after_ms(headers)
    text = f"upstream answered {status}" + (f": {message}" if message else "")
    lowered = message.lower()
    if status == 400 and (code == "context_length_exceeded" or "context length" in lowered or "maximum context" in lowered):
        return UpstreamError(message or text, "context_length_exceeded", param=param or "messages")
    if status in (400, 422):
        return UpstreamError(f"the upstream refused the request: {message or status}", "invalid_message", param=param)
    if status == 429:
        return UpstreamError(text, "rate_limited", retry_after_ms=retry if retry is not None else 1000.0)
    if status == 503:
        return UpstreamError(text, "overloaded", retry_after_ms=retry if retry is not None else 1000.0)
    if status in (408, 504):
        return UpstreamError(text, "upstream_timeout")
    # 401/403/404 here are the gateway's configuration (key, model name), not the caller's fault.
    return UpstreamError(text)


async def _within(awaitable: Awaitable[T], seconds: float) -> T:
    """``awaitable`` bounded by ``seconds`` (``asyncio.TimeoutError`` past it).

    On Python 3.11+ this is ``asyncio.timeout``: ``asyncio.wait_for`` there can return a result
    that completed at the moment its task was cancelled and so lose the cancellation, which would
    keep a cancelled stream reading.
    """
    timeout = getattr(asyncio, "timeout", None)
    if timeout is None:  # pragma: no cover - Python 3.10
        return await asyncio.wait_for(awaitable, seconds)
    async with timeout(seconds):
        return await awaitable


async def _sse_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """Lines of an event stream from raw body bytes (cheaper than httpx's decoding layers)."""
    buf = b""
    async for chunk in chunks:
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode("utf-8", "replace")
    if buf:
        yield buf.rstrip(b"\r").decode("utf-8", "replace")


class _Malformed(Exception):
    """The upstream sent something that is not the OpenAI stream format."""


@dataclasses.dataclass
class _Run:
    key: Hashable
    prepared: PreparedRequest
    deadline: float
    emit: Emit
    started: float
    loss: list[LossItem]
    sent_any: bool = False  # a byte reached the caller: no more retries
    cancelled: bool = False
    first_token_at: float | None = None
    chunks: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None


class UpstreamBackend(TextBackend):
    """Forwards to an OpenAI-compatible engine (see the module docstring).

    Args:
        config: the model's configuration (``backend = "upstream"``).
        clock: the service's clock.
        transport: an httpx transport (tests inject faults; default: a real connection pool).
    """

    def __init__(self, config: TextModelConfig, clock: Callable[[], float], transport: httpx.AsyncBaseTransport | None = None) -> None:
        super().__init__(config, clock)
        assert config.upstream_url is not None
        self.base_url = config.upstream_url.rstrip("/")
        self._transport = transport
        self._started = False
        self._tasks: dict[Hashable, asyncio.Task[None]] = {}
        self._runs: dict[Hashable, _Run] = {}
        self.fingerprint = text_fingerprint({"upstream": self.base_url, "model": config.remote_model})
        self.attempts = 0  # upstream requests sent, retries included (tests and metrics)

    async def start(self) -> None:
        # The adapter drives the transport directly (no httpx.AsyncClient: its auth, redirect
        # and cookie layers are not needed and cost time on every request); retries belong to the
        # adapter alone, and the transport makes none.
        if self._transport is None:
            from chunkline.server.text.transport import H11Transport

            self._transport = H11Transport(max_idle_per_host=self.config.max_batch + 4)
        self._headers: list[tuple[bytes, bytes]] = [(b"Accept", b"text/event-stream"), (b"Content-Type", b"application/json")]
        if self.config.upstream_api_key is not None:
            self._headers.append((b"Authorization", f"Bearer {self.config.upstream_api_key.get_secret_value()}".encode()))
        self._urls = {"chat": httpx.URL(self.base_url + "/chat/completions"), "completion": httpx.URL(self.base_url + "/completions")}
        self._started = True
        self.load = TextLoadModel(self.config.max_batch)

    async def stop(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        if self._started and self._transport is not None:
            await self._transport.aclose()
        self._started = False

    # ------------------------------------------------------------------ requests

    def prepare(self, request: GenerationRequest) -> PreparedRequest:
        cfg = self.config
        loss: list[LossItem] = []
        for field in sorted(request.set_fields & set(cfg.upstream_unsupported)):
            if field in _ENFORCEABLE:
                continue  # applied by the gateway; reported when it had to act
            if cfg.translation_loss == "refuse":
                raise UnsupportedParameter(field, f"the upstream engine behind {cfg.name!r} cannot honour {field}")
            loss.append(LossItem(field, "dropped", f"the upstream engine cannot honour {field}; it was not sent"))
        if request.kind == "chat":
            size = sum(len(m.content.encode("utf-8", "replace")) for m in request.messages)
            overhead = 2 * len(request.messages) + 2  # role and end markers of a chat template
        else:
            size = len(request.prompt.encode("utf-8", "replace"))
            overhead = 1
        estimate = math.ceil(size / cfg.upstream_bytes_per_token) + overhead
        max_tokens = self._resolve_max_tokens(request, estimate, None)
        params = dataclasses.replace(request.params, max_tokens=max_tokens)
        return PreparedRequest(request, params, estimate, False, (), tuple(loss))

    def launch(self, key: Hashable, prepared: PreparedRequest, *, priority: int, deadline: float, emit: Emit) -> None:
        run = _Run(key, prepared, deadline, emit, self.clock(), list(prepared.loss))
        task = asyncio.get_running_loop().create_task(self._run(run))
        self._tasks[key] = task
        self._runs[key] = run
        task.add_done_callback(lambda _t: (self._tasks.pop(key, None), self._runs.pop(key, None)))

    def cancel(self, key: Hashable) -> None:
        run = self._runs.get(key)
        if run is not None:
            run.cancelled = True  # checked after every event too, so no race can outlive it
        task = self._tasks.get(key)
        if task is not None:
            task.cancel()

    # ------------------------------------------------------------------ one request

    def _body(self, prepared: PreparedRequest) -> dict[str, Any]:
        req, p = prepared.request, prepared.params
        unsupported = set(self.config.upstream_unsupported)
        body: dict[str, Any] = {"model": self.config.remote_model, "stream": True, "stream_options": {"include_usage": True}}
        if req.kind == "chat":
            body["messages"] = [{"role": m.role, "content": m.content} for m in req.messages]
        else:
            body["prompt"] = req.prompt
        if "max_tokens" not in unsupported:
            body["max_tokens"] = p.max_tokens
        values = {"temperature": p.temperature, "top_p": p.top_p, "seed": p.seed, "stop": list(p.stop), "ignore_eos": p.ignore_eos}
        for field, value in values.items():
            # Only what the caller set is sent: the upstream's own defaults stand otherwise.
            if field in req.set_fields and field not in unsupported:
                body[field] = value
        return body

    async def _run(self, run: _Run) -> None:
        cancelled = False
        try:
            await self._attempts(run)
        except asyncio.CancelledError:
            cancelled = True
        except TextError as exc:
            self._finish(run, "error", exc)
            return
        except Exception as exc:  # pragma: no cover - a bug here must still end the request
            log.exception("upstream adapter failed")
            self._finish(run, "error", UpstreamError(f"gateway failure: {type(exc).__name__}"))
            return
        if cancelled:
            self._finish(run, "cancelled", None)
            raise asyncio.CancelledError  # the task itself was cancelled: let it end so
        self._finish(run, run.finish_reason or "stop", None)

    def _finish(self, run: _Run, reason: str, error: TextError | None) -> None:
        prepared = run.prepared
        reported = run.prompt_tokens is not None and run.completion_tokens is not None
        if not reported and error is None and reason != "cancelled":
            run.loss.append(LossItem("usage", "estimated", "the upstream reported no usage; the gateway estimated it"))
        prompt = run.prompt_tokens if run.prompt_tokens is not None else prepared.prompt_tokens
        completion = run.completion_tokens if run.completion_tokens is not None else run.chunks
        run.emit(Finished(
            reason if error is None else "error", prompt, completion, self.clock(), run.started, run.first_token_at,
            consumed=run.sent_any or run.prompt_tokens is not None, error=error, usage_reported=reported, loss=tuple(run.loss),
        ))

    async def _attempts(self, run: _Run) -> None:
        body = json.dumps(self._body(run.prepared), separators=(",", ":")).encode()
        tries = 1 + self.config.upstream_retries
        last: TextError | None = None
        for attempt in range(tries):
            remaining = run.deadline - self.clock()
            if remaining <= 0:
                raise last if last is not None and last.code_str != "upstream_error" else UpstreamTimeout(
                    "no first token from the upstream before the deadline")
            try:
                await self._once(run, body, remaining)
                return
            except _Retryable as exc:
                last = exc.error
                if run.sent_any or attempt + 1 >= tries:
                    raise exc.error from None
                wait = exc.wait_s if exc.wait_s is not None else 0.01 * (2 ** attempt)
                if self.clock() + wait >= run.deadline:
                    raise exc.error from None
                await asyncio.sleep(wait)
        raise last if last is not None else UpstreamError("no attempt made")  # pragma: no cover

    async def _once(self, run: _Run, body: bytes, remaining: float) -> None:
        assert self._transport is not None and self._started
        headers = [*self._headers, (DEADLINE_HEADER.encode(), f"{remaining * 1000.0:.1f}".encode())]
        self.attempts += 1
        # Connect, send and wait for the headers within the deadline; then the first token too.
        # (The timeout extension is for httpx's own transports; the wait is bounded here anyway.)
        request = httpx.Request("POST", self._urls[run.prepared.request.kind], headers=headers, content=body,
                                extensions={"timeout": {"connect": remaining, "read": remaining, "write": remaining, "pool": remaining}})
        try:
            response = await _within(self._transport.handle_async_request(request), remaining)
        except (asyncio.TimeoutError, httpx.TimeoutException):
            raise _Retryable(UpstreamTimeout("the upstream did not answer before the first-token deadline"), None) from None
        except httpx.TransportError as exc:
            raise _Retryable(UpstreamError(f"cannot reach the upstream: {type(exc).__name__}"), None) from None
        try:
            if response.status_code != 200:
                data = b""
                with contextlib.suppress(httpx.HTTPError, asyncio.TimeoutError):
                    data = await _within(self._read_bounded(response), max(0.05, run.deadline - self.clock()))
                err = map_upstream_error(response.status_code, data, response.headers)
                retry = response.status_code in _RETRY_STATUS or (
                    response.status_code == 429 and err.retry_after_ms is not None
                    and err.retry_after_ms / 1000.0 < run.deadline - self.clock()
                )
                if retry:
                    raise _Retryable(err, None if err.retry_after_ms is None else err.retry_after_ms / 1000.0)
                raise err
            await self._read_stream(run, response)
        finally:
            await response.aclose()

    @staticmethod
    async def _drain(lines: AsyncIterator[str]) -> None:
        async for _ in lines:
            pass

    @staticmethod
    async def _read_bounded(response: httpx.Response) -> bytes:
        data = b""
        try:
            async for part in response.aiter_raw():
                data += part
                if len(data) > _MAX_ERROR_BODY:
                    break
        except httpx.StreamConsumed:  # a response built in memory (a mock transport) is already read
            return response.content[:_MAX_ERROR_BODY]
        return data

    async def _read_stream(self, run: _Run, response: httpx.Response) -> None:
        kind = run.prepared.request.kind
        params = run.prepared.params
        unsupported = set(self.config.upstream_unsupported)
        text = OutputText(params.stop)
        lines = _sse_lines(response.aiter_raw())
        saw_done = False
        while True:
            # Before the first token the deadline bounds the wait; after it, the stall timeout.
            budget = (run.deadline - self.clock()) if run.first_token_at is None else self.config.upstream_stall_timeout_s
            if budget <= 0:
                raise _Retryable(UpstreamTimeout("no first token from the upstream before the deadline"), None)
            try:
                line = await _within(lines.__anext__(), budget)
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                err = UpstreamTimeout("no first token from the upstream before the deadline") if run.first_token_at is None \
                    else UpstreamError(f"the upstream stalled for {self.config.upstream_stall_timeout_s:g} s")
                raise _Retryable(err, None) from None
            except httpx.TransportError as exc:
                raise _Retryable(UpstreamError(f"the upstream stream broke: {type(exc).__name__}"), None) from None
            if run.cancelled:
                raise asyncio.CancelledError
            if not line.startswith("data:"):
                continue  # comments, event names, blank separators
            data = line[5:].strip()
            if data == "[DONE]":
                saw_done = True
                # Read to the end of the body (only the chunked terminator is left), so that the
                # connection goes back to the pool instead of being closed.
                with contextlib.suppress(asyncio.TimeoutError, httpx.HTTPError, StopAsyncIteration):
                    await _within(self._drain(lines), 1.0)
                break
            try:
                obj = json.loads(data)
                if not isinstance(obj, dict):
                    raise _Malformed("a stream event is not a JSON object")
                if "error" in obj:
                    err = obj["error"]
                    msg = err.get("message") if isinstance(err, dict) else str(err)
                    code = err.get("code") if isinstance(err, dict) else None
                    raise UpstreamError(f"the upstream failed mid-stream: {msg}",
                                        code if code in ("upstream_timeout",) else "upstream_error")
                piece, finish = self._parse_chunk(obj, kind, run)
            except _Malformed as exc:
                raise UpstreamError(f"malformed upstream response: {exc}") from None
            except ValueError:
                raise UpstreamError("malformed upstream response: an event is not valid JSON") from None
            if piece is not None and run.chunks >= params.max_tokens:
                # Content beyond max_tokens chunks (each holds at least one token): the upstream
                # ignored max_tokens. Cut here, without this piece.
                tail = text.finish()
                if tail:
                    run.emit(Delta(tail, 0, self.clock()))
                run.loss.append(LossItem("max_tokens", "enforced", "the upstream went past max_tokens; the gateway cut the output"))
                run.finish_reason = "length"
                run.completion_tokens = run.chunks
                return
            if piece is not None:
                now = self.clock()
                run.chunks += 1
                if run.first_token_at is None:
                    run.first_token_at = now
                out = text.push(piece.encode("utf-8"))
                run.sent_any = True
                run.emit(Delta(out, 1, now))
                if text.stopped:
                    if "stop" not in run.prepared.request.set_fields or "stop" not in unsupported:
                        run.loss.append(LossItem("stop", "enforced",
                                                 "the upstream did not stop at a stop sequence; the gateway cut the output"))
                    else:
                        run.loss.append(LossItem("stop", "enforced", "stop sequences are applied by the gateway for this upstream"))
                    run.finish_reason = "stop"
                    run.completion_tokens = run.chunks
                    return
            if finish is not None:
                run.finish_reason = "stop" if finish == "stop" else "length" if finish == "length" else finish
        if not saw_done and run.finish_reason is None:
            raise _Retryable(UpstreamError("the upstream stream ended early (no [DONE])"), None)
        tail = text.finish()
        if tail:
            run.emit(Delta(tail, 0, self.clock()))
        if run.finish_reason is None:
            raise UpstreamError("malformed upstream response: the stream ended without a finish_reason")

    @staticmethod
    def _parse_chunk(obj: dict[str, Any], kind: str, run: _Run) -> tuple[str | None, str | None]:
        usage = obj.get("usage")
        if isinstance(usage, dict):
            p, c = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if isinstance(p, int) and isinstance(c, int) and p >= 0 and c >= 0:
                run.prompt_tokens, run.completion_tokens = p, c
        choices = obj.get("choices")
        if not isinstance(choices, list):
            raise _Malformed("no choices list")
        if not choices:
            if not isinstance(usage, dict):
                raise _Malformed("an event with neither choices nor usage")
            return None, None
        choice = choices[0]
        if not isinstance(choice, dict):
            raise _Malformed("a choice is not an object")
        if kind == "chat":
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                raise _Malformed("a chat chunk without delta")
            piece = delta.get("content")
        else:
            piece = choice.get("text")
        if piece is not None and not isinstance(piece, str):
            raise _Malformed("content is not a string")
        finish = choice.get("finish_reason")
        if finish is not None and not isinstance(finish, str):
            raise _Malformed("finish_reason is not a string")
        return (piece if piece else None), finish


class _Retryable(Exception):
    """An attempt failed in a way another attempt may fix (if nothing reached the caller yet)."""

    def __init__(self, error: TextError, wait_s: float | None) -> None:
        super().__init__(str(error))
        self.error = error
        self.wait_s = wait_s
