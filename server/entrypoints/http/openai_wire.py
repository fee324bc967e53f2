"""The OpenAI-compatible wire format: request validation and response bodies (pure functions).

Requests are validated field by field so that errors name the ``param`` at fault. A field this
server cannot honour is refused (400) unless it carries its neutral value (``n=1``,
``presence_penalty=0``, ``logprobs=false``, ...); an unknown field is refused too. Nothing a
client asks for is silently dropped. Extensions: ``ignore_eos`` (as in vLLM) and ``deadline_ms``
(time-to-first-token budget; also accepted as the ``X-Chunkline-Deadline-Ms`` header).
"""

from __future__ import annotations

import dataclasses
import json
import math
import secrets
import time
from collections.abc import Mapping, Sequence
from typing import Any

from chunkline.server.text.backend import GenerationRequest, LossItem
from chunkline.server.text.errors import InvalidTextRequest, UnsupportedParameter
from chunkline.server.text.sampling import MAX_STOP_BYTES, MAX_STOP_SEQUENCES, SamplingParams
from chunkline.server.text.tokenizer import ROLE_TOKENS, ChatMessage

__all__ = [
    "ParsedRequest",
    "parse_chat_request",
    "parse_completion_request",
    "Usage",
    "new_response_id",
    "chat_response",
    "completion_response",
    "chat_chunk",
    "completion_chunk",
    "usage_chunk",
    "models_list",
    "model_entry",
    "sse",
    "SSE_DONE",
]

SSE_DONE = b"data: [DONE]\n\n"

_MAX_MESSAGES = 256

# Fields accepted only at their neutral value: anything else would change the answer in a way
# this server does not implement, so it is refused rather than ignored.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "logprobs": (False, 0),
    "top_logprobs": (0,),
    "logit_bias": ({},),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "parallel_tool_calls": (False, True),
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
    "response_format": ({"type": "text"},),
    "store": (False,),
    "modalities": (["text"],),
    "reasoning_effort": (),
    "service_tier": ("auto", "default"),
}
_SHARED = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "user", "ignore_eos", "deadline_ms"}
_CHAT_FIELDS = _SHARED | {"messages", "max_completion_tokens", "metadata"}
_COMPLETION_FIELDS = _SHARED | {"prompt"}


@dataclasses.dataclass(frozen=True)
class ParsedRequest:
    """A validated request and how to present its answer.

    Args:
        request: the backend-neutral request.
        stream: answer as server-sent events.
        include_usage: when streaming, send a final chunk with ``usage``.
    """

    request: GenerationRequest
    stream: bool
    include_usage: bool


def _number(body: Mapping[str, Any], name: str, lo: float, hi: float, *, lo_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise InvalidTextRequest(f"{name} must be a number", name)
    if v < lo or v > hi or (lo_open and v == lo):
        raise InvalidTextRequest(f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}]; got {v}", name)
    return float(v)


def _integer(body: Mapping[str, Any], name: str, lo: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise InvalidTextRequest(f"{name} must be an integer", name)
    if lo is not None and v < lo:
        raise InvalidTextRequest(f"{name} must be >= {lo}; got {v}", name)
    return v


def _boolean(body: Mapping[str, Any], name: str) -> bool | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise InvalidTextRequest(f"{name} must be a boolean", name)
    return v


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise InvalidTextRequest("stop must be a string or a list of strings", "stop")
    if len(items) > MAX_STOP_SEQUENCES:
        raise InvalidTextRequest(f"at most {MAX_STOP_SEQUENCES} stop sequences", "stop")
    if any(len(s.encode("utf-8", errors="replace")) > MAX_STOP_BYTES for s in items):
        raise InvalidTextRequest(f"a stop sequence is longer than {MAX_STOP_BYTES} bytes", "stop")
    return tuple(s for s in items if s)


def _check_fields(body: Mapping[str, Any], allowed: set[str]) -> None:
    for name, value in body.items():
        if name in allowed or value is None:
            continue
        if name in _NEUTRAL:
            if value in _NEUTRAL[name]:
                continue
            raise UnsupportedParameter(name, f"{name}={json.dumps(value)[:64]} is not supported by this server")
        raise InvalidTextRequest(f"Unrecognized request argument supplied: {name}", name)


def _common(body: Mapping[str, Any], allowed: set[str], default_model: str | None) -> dict[str, Any]:
    if not isinstance(body, Mapping):
        raise InvalidTextRequest("the request body must be a JSON object")
    _check_fields(body, allowed)
    model = body.get("model", default_model)
    if not isinstance(model, str) or not model:
        raise InvalidTextRequest("model is required", "model")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidTextRequest("user must be a string", "user")
    stream = bool(_boolean(body, "stream"))
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, Mapping) or set(opts) - {"include_usage", "continuous_usage_stats"}:
            raise InvalidTextRequest("stream_options may hold include_usage only", "stream_options")
        if opts.get("continuous_usage_stats"):
            raise UnsupportedParameter("stream_options", "continuous_usage_stats is not supported")
        if not stream:
            raise InvalidTextRequest("stream_options is only allowed with stream=true", "stream_options")
        include_usage = bool(opts.get("include_usage", False))
    set_fields = {name for name in ("temperature", "top_p", "seed", "stop", "ignore_eos") if body.get(name) not in (None, [], "")}
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0, lo_open=True)
    seed = _integer(body, "seed")
    ignore_eos = _boolean(body, "ignore_eos")
    deadline_ms = _number(body, "deadline_ms", 0.0, 3_600_000.0, lo_open=True)
    return {
        "model": model,
        "stream": stream,
        "include_usage": include_usage,
        "temperature": 1.0 if temperature is None else temperature,
        "top_p": 1.0 if top_p is None else top_p,
        "seed": seed,
        "stop": _stop(body),
        "ignore_eos": bool(ignore_eos),
        "deadline_ms": deadline_ms,
        "set_fields": set_fields,
    }


def _max_tokens(body: Mapping[str, Any], *names: str) -> int | None:
    found = [(n, _integer(body, n, 1)) for n in names]
    given = [(n, v) for n, v in found if v is not None]
    if len({v for _, v in given}) > 1:
        raise InvalidTextRequest(f"{' and '.join(n for n, _ in given)} disagree", given[-1][0])
    return given[0][1] if given else None


def _content(value: Any, where: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for part in value:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise UnsupportedParameter(where, "only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidTextRequest("message content must be a string or a list of text parts", where)


def parse_chat_request(body: Any, deadline_header: str | None = None, default_model: str | None = None) -> ParsedRequest:
    """Validate a ``/v1/chat/completions`` body.

    Args:
        body: the decoded JSON.
        deadline_header: the ``X-Chunkline-Deadline-Ms`` header, if sent.
        default_model: model used when the body names none (the native protocol allows that).

    Raises:
        InvalidTextRequest, UnsupportedParameter: with the field at fault.
    """
    c = _common(body, _CHAT_FIELDS, default_model)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise InvalidTextRequest("messages must be a non-empty list", "messages")
    if len(msgs) > _MAX_MESSAGES:
        raise InvalidTextRequest(f"at most {_MAX_MESSAGES} messages", "messages")
    messages = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise InvalidTextRequest("each message must be an object", where)
        extra = set(m) - {"role", "content", "name"}
        if extra:
            field = min(extra)
            raise UnsupportedParameter(f"{where}.{field}", f"message field {field!r} is not supported")
        role = m.get("role")
        if role not in ROLE_TOKENS:
            raise InvalidTextRequest(f"role must be one of {sorted(ROLE_TOKENS)}", f"{where}.role")
        messages.append(ChatMessage(str(role), _content(m.get("content"), f"{where}.content")))
    max_tokens = _max_tokens(body, "max_tokens", "max_completion_tokens")
    return _finish("chat", c, max_tokens, deadline_header, messages=tuple(messages))


def parse_completion_request(body: Any, deadline_header: str | None = None, default_model: str | None = None) -> ParsedRequest:
    """Validate a ``/v1/completions`` body (one prompt string; token-id prompts are refused).

    Args:
        body: the decoded JSON.
        deadline_header: the ``X-Chunkline-Deadline-Ms`` header, if sent.
        default_model: model used when the body names none.

    Raises:
        InvalidTextRequest, UnsupportedParameter: with the field at fault.
    """
    c = _common(body, _COMPLETION_FIELDS, default_model)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        raise UnsupportedParameter("prompt", "only a single string prompt is supported (no batches, no token ids)")
    if not isinstance(prompt, str):
        raise InvalidTextRequest("prompt must be a string", "prompt")
    return _finish("completion", c, _max_tokens(body, "max_tokens"), deadline_header, prompt=prompt)


def _finish(kind: str, c: dict[str, Any], max_tokens: int | None, deadline_header: str | None, **content: Any) -> ParsedRequest:
    deadline_ms = c["deadline_ms"]
    if deadline_header is not None and deadline_ms is None:
        try:
            deadline_ms = float(deadline_header)
        except ValueError:
            raise InvalidTextRequest("X-Chunkline-Deadline-Ms must be a number", "deadline_ms") from None
        if not (math.isfinite(deadline_ms) and 0 < deadline_ms <= 3_600_000):
            raise InvalidTextRequest("X-Chunkline-Deadline-Ms must be in (0, 3600000]", "deadline_ms")
    set_fields = set(c["set_fields"])
    if max_tokens is not None:
        set_fields.add("max_tokens")
    params = SamplingParams(
        max_tokens=max_tokens or 1, temperature=c["temperature"], top_p=c["top_p"], seed=c["seed"], stop=c["stop"],
        ignore_eos=c["ignore_eos"],
    )
    req = GenerationRequest(
        kind=kind,  # type: ignore[arg-type]
        model=c["model"],
        params=params,
        max_tokens_set=max_tokens is not None,
        deadline_ms=deadline_ms,
        set_fields=frozenset(set_fields),
        **content,
    )
    return ParsedRequest(req, c["stream"], c["include_usage"])


# ----------------------------------------------------------------------------- responses


@dataclasses.dataclass(frozen=True)
class Usage:
    """Token usage of one request."""

    prompt_tokens: int
    completion_tokens: int

    def to_json(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


def new_response_id(kind: str) -> str:
    """A fresh response id (``chatcmpl-...`` or ``cmpl-...``)."""
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)


def _extension(loss: Sequence[LossItem], fingerprint: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if fingerprint:
        out["system_fingerprint"] = fingerprint
    if loss:
        out["chunkline"] = {"translation_loss": [x.to_json() for x in loss]}
    return out


def chat_response(rid: str, model: str, text: str, finish_reason: str, usage: Usage, loss: Sequence[LossItem] = (),
                  fingerprint: str | None = None, created: int | None = None) -> dict[str, Any]:
    """A non-streaming ``chat.completion`` body."""
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created or int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage.to_json(),
        **_extension(loss, fingerprint),
    }


def completion_response(rid: str, model: str, text: str, finish_reason: str, usage: Usage, loss: Sequence[LossItem] = (),
                        fingerprint: str | None = None, created: int | None = None) -> dict[str, Any]:
    """A non-streaming ``text_completion`` body."""
    return {
        "id": rid,
        "object": "text_completion",
        "created": created or int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage.to_json(),
        **_extension(loss, fingerprint),
    }


def chat_chunk(rid: str, model: str, created: int, *, content: str | None = None, role: bool = False,
               finish_reason: str | None = None, fingerprint: str | None = None) -> dict[str, Any]:
    """One ``chat.completion.chunk``: the role (first chunk), a content delta, or the finish reason."""
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = "assistant"
    if content is not None:
        delta["content"] = content
    return _stream_chunk("chat.completion.chunk", rid, model, created, {"delta": delta}, finish_reason, fingerprint)


def completion_chunk(rid: str, model: str, created: int, *, text: str = "", finish_reason: str | None = None,
                     fingerprint: str | None = None) -> dict[str, Any]:
    """One streamed ``text_completion`` chunk."""
    return _stream_chunk("text_completion", rid, model, created, {"text": text}, finish_reason, fingerprint)


def _stream_chunk(obj: str, rid: str, model: str, created: int, content: dict[str, Any], finish_reason: str | None,
                  fingerprint: str | None) -> dict[str, Any]:
    """A streamed chunk of either kind: one choice holding ``content`` (a chat delta or a text piece)."""
    chunk: dict[str, Any] = {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [{"index": 0, **content, "logprobs": None, "finish_reason": finish_reason}],
    }
    if fingerprint:
        chunk["system_fingerprint"] = fingerprint
    return chunk


def usage_chunk(kind: str, rid: str, model: str, created: int, usage: Usage, loss: Sequence[LossItem] = ()) -> dict[str, Any]:
    """The last streamed chunk when ``include_usage`` was asked: no choices, the usage (and any loss report)."""
    return {
        "id": rid,
        "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage.to_json(),
        **_extension(loss, None),
    }


def model_entry(name: str, created: int, max_model_len: int | None = None, owner: str = "chunkline") -> dict[str, Any]:
    """One entry of ``/v1/models`` (``max_model_len``, as vLLM reports it, where known)."""
    entry: dict[str, Any] = {"id": name, "object": "model", "created": created, "owned_by": owner}
    if max_model_len is not None:
        entry["max_model_len"] = max_model_len
    return entry


def models_list(entries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The ``/v1/models`` body from :func:`model_entry` items."""
    return {"object": "list", "data": list(entries)}


def sse(obj: Mapping[str, Any]) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8") + b"\n\n"
