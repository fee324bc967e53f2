"""The OpenAPI 3.1 description of the OpenAI-compatible HTTP API, served at ``/openapi.json``.

Written for the Starlette routes of :mod:`.openai_app` and the request rules of
:mod:`.openai_wire` (which stay the authority: a body this schema allows may still be refused
with a documented 400, e.g. a stop sequence longer than its byte limit). Every status a route
can answer is listed with its body, so a client generator (or ``schemathesis``, which the test
suite runs against a live server) can check every response.
"""

from __future__ import annotations

from typing import Any

from chunkline.client.wire.protocol import MAX_DEADLINE_MS
from chunkline.server.text.sampling import MAX_STOP_SEQUENCES

__all__ = ["openapi_schema", "OPENAPI_PATH"]

#: Where the schema is served (open, like the probes: it describes no tenant).
OPENAPI_PATH = "/openapi.json"

_JSON = "application/json"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {_JSON: {"schema": _ref("Error")}}}


# Statuses any authenticated route may answer before reaching its handler (the door).
_DOOR = {
    "400": _error("more than one Authorization header, or a malformed request"),
    "401": _error("missing or invalid API key (`invalid_api_key`)"),
    "429": _error("too many failed authentications from this address (`rate_limited`), or a tenant quota (`quota_exceeded`)"),
    "503": _error("the server is shutting down (`shutting_down`), overloaded (`overloaded`), cannot meet the deadline "
                  "(`deadline_unmeetable`) or not ready (`not_ready`)"),
}
_COMPLETION_ERRORS = {
    **_DOOR,
    "403": _error("the tenant may not use this model or class (`forbidden`)"),
    "404": _error("no such model for this tenant (`unknown_model`)"),
    "408": _error("the body did not arrive in time (`timeout`)"),
    "413": _error("the body is larger than the limit (`body_too_large`)"),
    "504": _error("the first token did not come within the deadline (`deadline_exceeded`)"),
}

_NUMBER_0_2 = {"type": "number", "minimum": 0, "maximum": 2}
_SAMPLING: dict[str, Any] = {
    "model": {"type": "string", "minLength": 1},
    "max_tokens": {"type": "integer", "minimum": 1},
    "temperature": _NUMBER_0_2,
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "seed": {"type": "integer"},
    "stop": {"oneOf": [{"type": "string"},
                       {"type": "array", "items": {"type": "string"}, "maxItems": MAX_STOP_SEQUENCES}]},
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}, "additionalProperties": False,
                       "description": "only with stream=true"},
    "user": {"type": "string"},
    "ignore_eos": {"type": "boolean", "description": "generate through end-of-sequence tokens (as in vLLM)"},
    "deadline_ms": {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_DEADLINE_MS,
                    "description": "time-to-first-token budget in milliseconds (a number, never a string)"},
    # Accepted only at their neutral value: anything else is refused (400 unsupported_parameter).
    "n": {"type": "integer", "enum": [1]},
    "presence_penalty": {"type": "number", "enum": [0]},
    "frequency_penalty": {"type": "number", "enum": [0]},
    "logprobs": {"type": "boolean", "enum": [False]},
}
_CONTENT_PART = {"type": "object", "required": ["type", "text"],
                 "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}
_MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"oneOf": [{"type": "string"}, {"type": "null"}, {"type": "array", "items": _CONTENT_PART}]},
        "name": {"type": "string"},
    },
    "additionalProperties": False,
}
_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
          "properties": {k: {"type": "integer", "minimum": 0} for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}
_FINISH = {"type": "string", "enum": ["stop", "length", "cancelled"]}


def _completion_object(kind: str) -> dict[str, Any]:
    choice: dict[str, Any] = {"type": "object", "required": ["index", "finish_reason"],
                              "properties": {"index": {"type": "integer"}, "finish_reason": _FINISH}}
    if kind == "chat":
        choice["required"].append("message")
        choice["properties"]["message"] = {"type": "object", "required": ["role", "content"],
                                           "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}}}
    else:
        choice["required"].append("text")
        choice["properties"]["text"] = {"type": "string"}
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "chat.completion" if kind == "chat" else "text_completion"},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "items": choice, "minItems": 1, "maxItems": 1},
            "usage": _USAGE,
            "system_fingerprint": {"type": "string"},
        },
    }


def _completion_operation(kind: str, summary: str) -> dict[str, Any]:
    body = "ChatCompletionRequest" if kind == "chat" else "CompletionRequest"
    return {
        "summary": summary,
        "security": [{"bearer": []}, {"apiKey": []}],
        "parameters": [{"name": "X-Chunkline-Deadline-Ms", "in": "header", "required": False,
                        "description": f"time-to-first-token budget in milliseconds, in (0, {MAX_DEADLINE_MS:.0f}] "
                                       "(the body's deadline_ms wins)",
                        "schema": {"type": "string", "pattern": r"^[0-9]{1,7}(\.[0-9]{1,3})?$"}}],
        "requestBody": {"required": True, "content": {_JSON: {"schema": _ref(body)}}},
        "responses": {
            "200": {"description": "the completion (a JSON object), or with stream=true server-sent events of chunks "
                                   "ending with `data: [DONE]`",
                    "content": {_JSON: {"schema": _ref("ChatCompletion" if kind == "chat" else "Completion")},
                                "text/event-stream": {"schema": _ref("StreamEvent")}}},
            **_COMPLETION_ERRORS,
        },
    }


def openapi_schema(version: str) -> dict[str, Any]:
    """The API's OpenAPI 3.1 document.

    Args:
        version: the server's version (``info.version``).
    """
    plain = {"text/plain": {"schema": {"type": "string"}}}
    authed: dict[str, Any] = {"security": [{"bearer": []}, {"apiKey": []}]}
    return {
        "openapi": "3.1.0",
        "info": {"title": "chunkline OpenAI-compatible API", "version": version,
                 "description": "Text completions on the chunkline server's text models, with the robots' keys, quotas and ledger."},
        "paths": {
            "/healthz": {"get": {"summary": "the process answers (no key)", "responses": {"200": {"description": "ok", "content": plain}}}},
            "/readyz": {"get": {"summary": "ready for requests (no key)", "responses": {
                "200": {"description": "ready", "content": plain}, "503": {"description": "not ready", "content": plain}}}},
            "/v1/models": {"get": {"summary": "the text models this key may use", **authed,
                                   "responses": {"200": {"description": "the models", "content": {_JSON: {"schema": _ref("ModelList")}}},
                                                 **_DOOR}}},
            "/v1/models/{model}": {"get": {
                "summary": "one model", **authed,
                "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}],
                "responses": {"200": {"description": "the model", "content": {_JSON: {"schema": _ref("Model")}}},
                              "404": _error("no such model for this tenant (`unknown_model`)"), **_DOOR}}},
            "/v1/chat/completions": {"post": _completion_operation("chat", "a chat completion")},
            "/v1/completions": {"post": _completion_operation("completion", "a completion of one prompt string")},
        },
        "components": {
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer", "description": "Authorization: Bearer <key>"},
                "apiKey": {"type": "apiKey", "in": "header", "name": "Authorization", "description": "Authorization: Api-Key <key>"},
            },
            "schemas": {
                "ChatCompletionRequest": {
                    "type": "object", "required": ["model", "messages"], "additionalProperties": False,
                    "properties": {**_SAMPLING, "messages": {"type": "array", "items": _MESSAGE, "minItems": 1, "maxItems": 256},
                                   "max_completion_tokens": {"type": "integer", "minimum": 1, "description": "as max_tokens"},
                                   "metadata": {"type": "object"}},
                },
                "CompletionRequest": {
                    "type": "object", "required": ["model", "prompt"], "additionalProperties": False,
                    "properties": {**_SAMPLING, "prompt": {"oneOf": [{"type": "string"},
                                                                     {"type": "array", "items": {"type": "string"}, "minItems": 1,
                                                                      "maxItems": 1}]}},
                },
                "ChatCompletion": _completion_object("chat"),
                "Completion": _completion_object("completion"),
                # One server-sent event: `data` is a chunk as JSON (a chat.completion.chunk or a
                # text_completion chunk, then a usage chunk if asked), an error object, or [DONE].
                "StreamEvent": {"type": "object", "required": ["data"],
                                "properties": {"data": {"type": "string"}, "event": {"type": "string"}}},
                "Model": {"type": "object", "required": ["id", "object", "created", "owned_by"],
                          "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                                         "owned_by": {"type": "string"}, "max_model_len": {"type": "integer"}}},
                "ModelList": {"type": "object", "required": ["object", "data"],
                              "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _ref("Model")}}},
                "Error": {"type": "object", "required": ["error"], "properties": {"error": {
                    "type": "object", "required": ["message", "type", "param", "code"],
                    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}},
            },
        },
    }
