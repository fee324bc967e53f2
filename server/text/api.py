"""The OpenAI-compatible HTTP application: routes, authentication, streaming (server-sent events).

``POST /v1/chat/completions`` and ``POST /v1/completions`` (streaming and not), ``GET /v1/models``
and ``GET /v1/models/{id}``, plus an open ``GET /healthz``. Every other request is authenticated
first, from the headers alone, with the server's authenticator (``Authorization: Bearer <key>``):
the same keys and tenants as the robot path.

Errors have OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``) and status:
401 bad or missing key, 403 class not allowed, 404 unknown model or path, 400 invalid request or
context length, 429 quota (with ``Retry-After``), 503 overloaded or deadline unmeetable (with
``Retry-After``), 504 first-token deadline exceeded, 502 upstream failure. A streamed request
sends its headers only once the first token (or an error) is there, so that refusals and queue
drops keep their status; an error after that is sent as a final ``data: {"error": ...}`` event.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING, Any

from chunkline.server.text.backend import Delta, Finished
from chunkline.server.text.errors import ClientGone, TextError, UnknownTextModel
from chunkline.server.text.http import HttpRequest, HttpResponse, Responder, json_response
from chunkline.server.text.openai_api import (
    SSE_DONE,
    ParsedRequest,
    Usage,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    model_entry,
    models_list,
    new_response_id,
    parse_chat_request,
    parse_completion_request,
    sse,
    usage_chunk,
)

if TYPE_CHECKING:
    from chunkline.server.text.service import TextJob, TextService

__all__ = ["OpenAIApp", "LOSS_HEADER", "DEADLINE_HEADER"]

#: Response header naming request fields not honoured exactly (the translation-loss report).
LOSS_HEADER = "X-Chunkline-Translation-Loss"
#: Request header with the time-to-first-token budget in milliseconds.
DEADLINE_HEADER = "x-chunkline-deadline-ms"

_ROUTES = {
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("GET", "/v1/models"),
}


def _error(exc: TextError) -> HttpResponse:
    return json_response(exc.http_status, exc.openai_body(), exc.http_headers())


def _plain_error(status: int, message: str, code: str | None = None, headers: list[tuple[str, str]] | None = None) -> HttpResponse:
    kind = {401: "authentication_error", 404: "invalid_request_error", 405: "invalid_request_error"}.get(status, "invalid_request_error" if status < 500 else "server_error")
    return json_response(status, {"error": {"message": message, "type": kind, "param": None, "code": code}}, headers)


class OpenAIApp:
    """The HTTP application over a :class:`~chunkline.server.text.service.TextService`.

    Args:
        service: the text service.
    """

    def __init__(self, service: TextService) -> None:
        self.service = service

    # ------------------------------------------------------------------ before the body

    def check(self, request: HttpRequest) -> HttpResponse | None:
        """Route and authenticate from the headers alone (no body has been read)."""
        if request.path == "/healthz":
            return json_response(200, {"status": "ok" if self.service.ready else "loading"})
        result = self.service.auth.authenticate(request.headers.get("authorization"), request.peer)
        if not result.ok:
            reason = result.failure.value if result.failure else "invalid"
            self.service.metrics.observe_auth_failure(reason)
            code = "invalid_api_key" if result.http_status == 401 else "rate_limited"
            return _plain_error(result.http_status, result.message, code, result.headers())
        request.context["tenant"] = result.tenant
        known = (request.method, request.path) in _ROUTES or (request.method == "GET" and request.path.startswith("/v1/models/"))
        if not known:
            if any(p == request.path for _, p in _ROUTES):
                return _plain_error(405, f"method {request.method} not allowed on {request.path}", "method_not_allowed")
            return _plain_error(404, f"no route {request.method} {request.path}", "not_found")
        return None

    # ------------------------------------------------------------------ requests

    async def handle(self, request: HttpRequest, responder: Responder) -> None:
        """Answer one authenticated request."""
        tenant = request.context["tenant"]
        try:
            if request.method == "GET":
                names = self.service.models_for(tenant)
                if request.path == "/v1/models":
                    await responder.send(json_response(200, models_list(names, self.service.created)))
                    return
                name = request.path[len("/v1/models/"):]
                if name not in names:
                    await responder.send(_error(UnknownTextModel(name)))
                    return
                await responder.send(json_response(200, model_entry(name, self.service.created)))
                return
            try:
                body = json.loads(request.body)
            except (ValueError, UnicodeDecodeError):
                await responder.send(_plain_error(400, "the body is not valid JSON", "invalid_json"))
                return
            deadline = request.headers.get(DEADLINE_HEADER)
            try:
                if request.path == "/v1/chat/completions":
                    parsed = parse_chat_request(body, deadline)
                else:
                    parsed = parse_completion_request(body, deadline)
                job = self.service.submit(parsed.request, tenant, f"http:{request.peer}")
            except TextError as exc:
                await responder.send(_error(exc))
                return
            await self._answer(parsed, job, responder)
        except ClientGone:
            return

    async def _answer(self, parsed: ParsedRequest, job: TextJob, responder: Responder) -> None:
        svc = self.service
        def responder_cancel():
            return svc.cancel(job)
        if responder.disconnected.is_set():
            svc.cancel(job)
            return
        watch = _DisconnectWatch(responder, responder_cancel)
        try:
            if parsed.stream:
                await self._stream(parsed, job, responder)
            else:
                await self._whole(parsed, job, responder)
        except ClientGone:
            svc.cancel(job)
        finally:
            watch.close()
            if not job.done:
                svc.cancel(job)

    async def _whole(self, parsed: ParsedRequest, job: TextJob, responder: Responder) -> None:
        kind = parsed.request.kind
        parts: list[str] = []
        try:
            async for ev in job.stream():
                if isinstance(ev, Delta):
                    parts.append(ev.text)
                    continue
                usage = Usage(ev.prompt_tokens, ev.completion_tokens)
                rid = new_response_id(kind)
                build = chat_response if kind == "chat" else completion_response
                body = build(rid, job.model, "".join(parts), ev.reason, usage, job.loss, self.service.fingerprint(job.model))
                headers = [(LOSS_HEADER, ",".join(sorted({x.field for x in job.loss})))] if job.loss else []
                await responder.send(json_response(200, body, headers))
                return
        except TextError as exc:
            await responder.send(_error(exc))

    async def _stream(self, parsed: ParsedRequest, job: TextJob, responder: Responder) -> None:
        kind = parsed.request.kind
        rid = new_response_id(kind)
        created = int(time.time())
        model = job.model
        fp = self.service.fingerprint(model) or None
        # The status line waits for the first event: a refusal or a queue drop keeps its status.
        first = await job.events.get()
        if isinstance(first, Finished) and first.error is not None:
            first = first.error
        if isinstance(first, TextError):
            await responder.send(_error(first))
            return
        headers = [("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache")]
        if job.loss:
            headers.append((LOSS_HEADER, ",".join(sorted({x.field for x in job.loss}))))
        await responder.start_stream(200, headers)
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[None] = loop.create_future()
        prefix, suffix = _chunk_template(kind, rid, model, created, fp)
        head = sse(chat_chunk(rid, model, created, role=True, content="", fingerprint=fp)) if kind == "chat" else b""

        def on_event(ev: Delta | Finished | TextError) -> None:
            # Runs on the loop, straight from the engine's callback: one frame per event, no task
            # switch per token.
            nonlocal head
            if ended.done():
                return
            try:
                if isinstance(ev, Delta):
                    if ev.text or ev.tokens:
                        responder.write_nowait(head + prefix + json.dumps(ev.text, ensure_ascii=False).encode() + suffix)
                        head = b""
                    return
                out = bytearray(head)
                if isinstance(ev, TextError):
                    out += sse(ev.openai_body())
                elif ev.error is not None:
                    out += sse(ev.error.openai_body())
                else:
                    chunk = chat_chunk(rid, model, created, finish_reason=ev.reason, fingerprint=fp) if kind == "chat" \
                        else completion_chunk(rid, model, created, finish_reason=ev.reason, fingerprint=fp)
                    out += sse(chunk)
                    if parsed.include_usage or job.loss:
                        # The loss report rides on the usage chunk; a client that did not ask for
                        # usage still finds it there (choices is empty, as OpenAI's usage chunk).
                        out += sse(usage_chunk(kind, rid, model, created, Usage(ev.prompt_tokens, ev.completion_tokens), job.loss))
                out += SSE_DONE
                responder.end_nowait(bytes(out))
                ended.set_result(None)
            except ClientGone as exc:
                if not ended.done():
                    ended.set_exception(exc)

        on_event(first)
        job.listen(on_event)
        await ended
        await responder.drain()


def _chunk_template(kind: str, rid: str, model: str, created: int, fp: str | None) -> tuple[bytes, bytes]:
    """The bytes of a streamed content chunk before and after its JSON-encoded text."""
    marker = "\x00chunkline-text\x00"
    chunk = chat_chunk(rid, model, created, content=marker, fingerprint=fp) if kind == "chat" \
        else completion_chunk(rid, model, created, text=marker, fingerprint=fp)
    encoded = sse(chunk)
    pre, _, post = encoded.partition(json.dumps(marker, ensure_ascii=False).encode())
    return pre, post


class _DisconnectWatch:
    """Cancels the request as soon as the client's connection closes, even while nothing is written."""

    def __init__(self, responder: Responder, on_disconnect: Any) -> None:
        import asyncio

        self._task = asyncio.get_running_loop().create_task(self._wait(responder, on_disconnect))

    @staticmethod
    async def _wait(responder: Responder, on_disconnect: Any) -> None:
        await responder.disconnected.wait()
        on_disconnect()

    def close(self) -> None:
        self._task.cancel()
