"""The native protocol's text exchange on the robot port: ``generate`` -> ``token``... -> ``done``
(or one ``error``).

A session (:mod:`chunkline.server.entrypoints.sessions`) runs :func:`handle_generate` as a task per
``generate`` message; this module turns the message into a request for the text class
(:func:`generate_to_request`, the same validation as the HTTP API) and the class's job events into
wire messages (:func:`done_message`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from chunkline.client.timing import ms
from chunkline.client.wire.protocol import Generate, error_message
from chunkline.server.core.tenants import TenantInfo
from chunkline.server.entrypoints.cancellation import answer_cancelled
from chunkline.server.entrypoints.handler import Send
from chunkline.server.entrypoints.http.openai_wire import parse_chat_request, parse_completion_request
from chunkline.server.errors import Refusal
from chunkline.server.text.service import Delta, Finished, GenerationRequest, TextJob, TextService

__all__ = ["handle_generate", "generate_to_request", "done_message"]


def generate_to_request(msg: Generate, default_model: str | None) -> GenerationRequest:
    """A native ``generate`` message as a :class:`GenerationRequest` (same rules as the HTTP API).

    Args:
        msg: the validated message.
        default_model: the model used when ``msg.model`` is ``None``.

    Raises:
        TextError: a field is invalid or unsupported.
    """
    body: dict[str, Any] = {
        "model": msg.model or default_model,
        "max_tokens": msg.max_tokens,
        "temperature": msg.temperature,
        "top_p": msg.top_p,
        "seed": msg.seed,
        "stop": list(msg.stop) if msg.stop is not None else None,
        "ignore_eos": msg.ignore_eos,
        "deadline_ms": msg.deadline_ms,
    }
    if msg.messages is not None:
        body["messages"] = [m.model_dump() for m in msg.messages]
        return parse_chat_request(body).request
    body["prompt"] = msg.prompt
    return parse_completion_request(body).request


def _error(exc: Refusal, request_id: Any) -> dict[str, Any]:
    return error_message(exc.code, exc.message, request_id, exc.retry_after_ms)


async def handle_generate(service: TextService, msg: Generate, tenant: TenantInfo, session: str, send: Send) -> None:
    """Answer one native ``generate``: ``token`` messages, then ``done`` (or one ``error``).

    To cancel it (a ``cancel`` message or a disconnect), cancel the task running this coroutine:
    the request is withdrawn (its slot is freed at the engine's next step), an ``error``
    ``cancelled`` is sent if the connection still stands, and ``CancelledError`` propagates. A
    failing ``send`` (connection closed) cancels the request too.

    Args:
        service: the text request class.
        msg: the validated message.
        tenant: the session's tenant.
        session: the session id.
        send: sends one message map (the session encodes it).
    """
    received = service.clock()
    try:
        job = service.submit(generate_to_request(msg, service.default_model), tenant, session, received)
    except Refusal as exc:
        await send(_error(exc, msg.id))
        return
    index = 0
    try:
        async for ev in job.stream():
            if isinstance(ev, Delta):
                if ev.text or ev.tokens:
                    await send({"type": "token", "id": msg.id, "text": ev.text, "index": index, "tokens": ev.tokens})
                    index += ev.tokens
                continue
            await send(done_message(msg.id, job, ev, service.fingerprint(job.model)))
    except Refusal as exc:
        await send(_error(exc, msg.id))
    except asyncio.CancelledError:
        service.cancel(job)
        await answer_cancelled(send, msg.id)
        raise
    except Exception:
        service.cancel(job)  # the connection went away mid-stream
        raise


def done_message(request_id: Any, job: TextJob, ev: Finished, fingerprint: str) -> dict[str, Any]:
    """The ``done`` message of a finished job: finish reason, usage, timing, translation loss."""
    timing: dict[str, float] = {"server_ms": ms(ev.time - job.received)}
    if job.started is not None:
        timing["queue_ms"] = ms(job.started - job.received)
    if job.first_token is not None:
        timing["ttft_ms"] = ms(job.first_token - job.received)
    if job.first_token is not None and job.last_token is not None and ev.completion_tokens > 1:
        timing["tpot_ms"] = ms((job.last_token - job.first_token) / (ev.completion_tokens - 1))
    out: dict[str, Any] = {
        "type": "done",
        "id": request_id,
        "model": job.model,
        "finish_reason": ev.reason,
        "usage": {"prompt_tokens": ev.prompt_tokens, "completion_tokens": ev.completion_tokens,
                  "total_tokens": ev.prompt_tokens + ev.completion_tokens},
        "fingerprint": fingerprint,
        "late": job.first_token is not None and job.first_token > job.deadline,
        "timing": timing,
    }
    if job.loss:
        out["translation_loss"] = [x.to_json() for x in job.loss]
    return out
