"""The OpenAI-compatible HTTP API of the text request class, as a Starlette application.

``POST /v1/chat/completions`` and ``/v1/completions`` (SSE or not), ``GET /v1/models[/{id}]``, the
open probes ``/healthz`` and ``/readyz``, and ``/openapi.json``. Every other request passes the
door from its headers alone, before any body is read: one ``Authorization`` header, and ``503
shutting_down`` while draining. Errors have OpenAI's shape and the server's status table; a stream
sends its status line only with its first token or error. A client that leaves cancels its request;
a request whose key is revoked while it runs is cancelled at the reload (a stream ends with a final
``unauthenticated`` event)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from chunkline.client.wire.errors import ErrorCode
from chunkline.server.core.auth import AuthResult
from chunkline.server.core.serving import ServingCore
from chunkline.server.core.tenants import TenantInfo
from chunkline.server.entrypoints.http.errors import error_body, plain_error, refusal_response
from chunkline.server.entrypoints.http.openai_wire import (
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
from chunkline.server.entrypoints.http.openapi import OPENAPI_PATH, openapi_schema
from chunkline.server.errors import Refusal
from chunkline.server.text.backend import Delta, Finished
from chunkline.server.text.errors import UnknownTextModel
from chunkline.server.text.job import TextJob
from chunkline.server.text.service import TextService
from chunkline.server.version import VERSION

__all__ = ["OpenAIApi", "LOSS_HEADER", "DEADLINE_HEADER", "OPEN_PATHS"]

#: Response header naming request fields not honoured exactly (the translation-loss report).
LOSS_HEADER = "X-Chunkline-Translation-Loss"
#: Request header with the time-to-first-token budget in milliseconds.
DEADLINE_HEADER = "x-chunkline-deadline-ms"
#: Paths answered without a key (orchestrators' probes carry none; they and the API's schema
#: reveal nothing about tenants).
OPEN_PATHS = frozenset({"/healthz", "/readyz", OPENAPI_PATH})
_TENANT = "chunkline.tenant"  # the scope key the door leaves the authenticated tenant under
_AUTH = "chunkline.auth"  # ... and the whole authentication (to watch its key)


def _revoked() -> Refusal:
    return Refusal(ErrorCode.UNAUTHENTICATED, "API key revoked")


class _Door:
    """Pure ASGI middleware: authentication and the drain, before routing and before the body."""

    def __init__(self, app: ASGIApp, core: ServingCore) -> None:
        self.app = app
        self.core = core

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        keys = [v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"]
        response: Response
        client = scope.get("client")
        result = self.core.auth.authenticate_headers(keys, str(client[0]) if client else "?")
        if not result.ok:
            self.core.metrics.observe_auth_failure(result.failure.value if result.failure else "invalid")
            code = {400: "invalid_request", 401: "invalid_api_key"}.get(result.http_status, "rate_limited")
            response = plain_error(result.http_status, result.message, code, dict(result.headers()))
        elif self.core.draining:
            response = refusal_response(Refusal(ErrorCode.SHUTTING_DOWN, "the server is shutting down", retry_after_ms=1000.0))
        else:
            scope[_TENANT] = result.tenant
            scope[_AUTH] = result
            await self.app(scope, receive, send)
            return
        await response(scope, receive, send)


class _BodyRefused(Exception):
    """The request body could not be taken (too large, too slow, not JSON); carries the answer."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


class _DisconnectWatch:
    """Calls ``on_disconnect`` as soon as the client goes away, even while nothing is written."""

    def __init__(self, receive: Receive, on_disconnect: Callable[[], None]) -> None:
        self._task = asyncio.get_running_loop().create_task(self._wait(receive, on_disconnect))

    @staticmethod
    async def _wait(receive: Receive, on_disconnect: Callable[[], None]) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        on_disconnect()

    def close(self) -> None:
        self._task.cancel()


class _Revocation:
    """A request's watch on its key: revoked, it cancels the job; the response ends at once."""

    __slots__ = ("tripped", "end")

    def __init__(self, core: ServingCore, auth: AuthResult, cancel: Callable[[], None]) -> None:
        self.tripped = False

        def revoked() -> None:
            self.tripped = True
            cancel()

        self.end = core.auth.watch(auth, revoked)

    def refusal(self, exc: Refusal) -> Refusal:
        return _revoked() if self.tripped else exc


class OpenAIApi:
    """The ASGI application over a :class:`~chunkline.server.text.service.TextService`.

    Args:
        service: the text request class (its ``core`` authenticates and drains).
        ready: what ``/readyz`` reports (the whole server's readiness); by default the text
            class's health and not draining.
        max_body: largest request body in bytes (413 beyond, refused from ``Content-Length``
            before reading when it announces more).
        body_timeout_s: most seconds to receive a request's body (408 after).
    """

    def __init__(self, service: TextService, *, ready: Callable[[], bool] | None = None, max_body: int = 8 * 1024 * 1024,
                 body_timeout_s: float = 10.0) -> None:
        self.service = service
        self.ready = ready if ready is not None else (lambda: service.healthy and not service.core.draining)
        self.max_body = max_body
        self.body_timeout_s = body_timeout_s
        self._schema = openapi_schema(VERSION)
        self.app = Starlette(
            routes=[
                Route("/healthz", self.healthz, methods=["GET"]),
                Route("/readyz", self.readyz, methods=["GET"]),
                Route(OPENAPI_PATH, self.openapi, methods=["GET"]),
                Route("/v1/models", self.list_models, methods=["GET"]),
                Route("/v1/models/{model:path}", self.get_model, methods=["GET"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
            ],
            middleware=[Middleware(_Door, core=service.core)],
            exception_handlers={HTTPException: self._http_exception},
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)

    # ------------------------------------------------------------------ probes and models

    async def healthz(self, request: Request) -> Response:
        return PlainTextResponse("ok")

    async def readyz(self, request: Request) -> Response:
        return PlainTextResponse("ready") if self.ready() else PlainTextResponse("not ready", 503)

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(self._schema)

    async def list_models(self, request: Request) -> Response:
        names = self.service.models_for(request.scope[_TENANT])
        return JSONResponse(models_list([self._entry(n) for n in names]))

    async def get_model(self, request: Request) -> Response:
        name = request.path_params["model"]
        if name not in self.service.models_for(request.scope[_TENANT]):
            return refusal_response(UnknownTextModel(name))
        return JSONResponse(self._entry(name))

    def _entry(self, name: str) -> dict[str, Any]:
        return model_entry(name, self.service.created, self.service.max_model_len(name))

    @staticmethod
    async def _http_exception(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 405:
            return plain_error(405, f"method {request.method} not allowed on {request.url.path}", "method_not_allowed", exc.headers)
        if exc.status_code == 404:
            return plain_error(404, f"no route {request.method} {request.url.path}", "not_found")
        return plain_error(exc.status_code, str(exc.detail), None, exc.headers)

    # ------------------------------------------------------------------ completions

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, parse_chat_request)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, parse_completion_request)

    async def _json_body(self, request: Request) -> Any:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            raise _BodyRefused(plain_error(413, f"body larger than {self.max_body} bytes", "body_too_large"))

        async def read() -> bytes:
            body = bytearray()
            async for chunk in request.stream():
                body += chunk
                if len(body) > self.max_body:
                    raise _BodyRefused(plain_error(413, f"body larger than {self.max_body} bytes", "body_too_large"))
            return bytes(body)

        try:
            raw = await asyncio.wait_for(read(), self.body_timeout_s)
        except asyncio.TimeoutError:
            raise _BodyRefused(plain_error(408, f"the body did not arrive within {self.body_timeout_s:g} s", "timeout")) from None
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: nesting deeper than the parser's stack
            raise _BodyRefused(plain_error(400, "the body is not valid JSON", "invalid_json")) from None

    async def _complete(self, request: Request, parse: Callable[[Any, str | None], ParsedRequest]) -> Response:
        tenant: TenantInfo = request.scope[_TENANT]
        try:
            body = await self._json_body(request)
        except _BodyRefused as refused:
            return refused.response
        except ClientDisconnect:
            return Response(status_code=400)  # nobody is left to read it
        client = request.client
        try:
            parsed = parse(body, request.headers.get(DEADLINE_HEADER))
            job = self.service.submit(parsed.request, tenant, f"http:{client.host if client else '?'}")
        except Refusal as exc:
            return refusal_response(exc)
        watch = _DisconnectWatch(request.receive, lambda: self.service.cancel(job))
        revocation = _Revocation(self.service.core, request.scope[_AUTH], lambda: self.service.cancel(job))
        streaming = False
        try:
            if not parsed.stream:
                return await self._whole(parsed, job, revocation)
            events = job.stream()
            try:
                # The status line waits for the first event: a refusal or a queue drop keeps its status.
                first = await events.__anext__()
            except Refusal as exc:
                return refusal_response(revocation.refusal(exc))
            streaming = True
        finally:
            watch.close()  # a stream's own disconnect watch takes over from here
            if not streaming:
                revocation.end()  # a stream ends its watch when it ends
            if not parsed.stream and not job.done:
                self.service.cancel(job)
        headers = {"Cache-Control": "no-cache"}
        if job.loss:
            headers[LOSS_HEADER] = ",".join(sorted({x.field for x in job.loss}))
        return StreamingResponse(self._events(parsed, job, first, events, revocation), media_type="text/event-stream", headers=headers)

    async def _whole(self, parsed: ParsedRequest, job: TextJob, revocation: _Revocation) -> Response:
        kind = parsed.request.kind
        parts: list[str] = []
        try:
            async for ev in job.stream():
                if isinstance(ev, Delta):
                    parts.append(ev.text)
                    continue
                build = chat_response if kind == "chat" else completion_response
                body = build(new_response_id(kind), job.model, "".join(parts), ev.reason, Usage(ev.prompt_tokens, ev.completion_tokens),
                             job.loss, self.service.fingerprint(job.model))
                headers = {LOSS_HEADER: ",".join(sorted({x.field for x in job.loss}))} if job.loss else None
                return JSONResponse(body, headers=headers)
        except Refusal as exc:
            return refusal_response(revocation.refusal(exc))
        raise AssertionError("a job's stream ends with Finished or raises")  # pragma: no cover

    async def _events(self, parsed: ParsedRequest, job: TextJob, first: Delta | Finished,
                      rest: AsyncIterator[Delta | Finished], revocation: _Revocation) -> AsyncIterator[bytes]:
        """The event stream's bytes: one write per merged delta, the finish (and usage) chunks, ``[DONE]``."""
        kind = parsed.request.kind
        rid, created, model = new_response_id(kind), int(time.time()), job.model
        fp = self.service.fingerprint(model) or None
        prefix, suffix = _chunk_template(kind, rid, model, created, fp)
        head = sse(chat_chunk(rid, model, created, role=True, content="", fingerprint=fp)) if kind == "chat" else b""

        def render(ev: Delta | Finished) -> bytes:
            if isinstance(ev, Delta):
                return prefix + json.dumps(ev.text, ensure_ascii=False).encode() + suffix if ev.text or ev.tokens else b""
            chunk = chat_chunk(rid, model, created, finish_reason=ev.reason, fingerprint=fp) if kind == "chat" \
                else completion_chunk(rid, model, created, finish_reason=ev.reason, fingerprint=fp)
            out = sse(chunk)
            if parsed.include_usage or job.loss:
                # The loss report rides on the usage chunk; a client that did not ask for usage
                # still finds it there (choices is empty, as in OpenAI's usage chunk).
                out += sse(usage_chunk(kind, rid, model, created, Usage(ev.prompt_tokens, ev.completion_tokens), job.loss))
            return out + SSE_DONE

        try:
            if revocation.tripped:
                raise _revoked()
            yield head + render(first)
            async for ev in rest:
                if revocation.tripped:
                    raise _revoked()  # events already made are not sent
                data = render(ev)
                if data:
                    yield data
        except Refusal as exc:
            yield sse(error_body(revocation.refusal(exc))) + SSE_DONE
        finally:
            revocation.end()
            if not job.done:
                self.service.cancel(job)  # the client went away mid-stream


def _chunk_template(kind: str, rid: str, model: str, created: int, fp: str | None) -> tuple[bytes, bytes]:
    """The bytes of a streamed content chunk before and after its JSON-encoded text (encoded once per stream)."""
    marker = "\x00chunkline-text\x00"
    chunk = chat_chunk(rid, model, created, content=marker, fingerprint=fp) if kind == "chat" \
        else completion_chunk(rid, model, created, text=marker, fingerprint=fp)
    pre, _, post = sse(chunk).partition(json.dumps(marker, ensure_ascii=False).encode())
    return pre, post

