"""The OpenAI-compatible HTTP API: a Starlette application over the text request class
(:mod:`.openai_app`), its wire format (:mod:`.openai_wire`) and errors (:mod:`.errors`), served by
uvicorn inside the server's event loop (:mod:`.server`)."""

from __future__ import annotations

from chunkline.server.entrypoints.http.openai_app import OpenAIApi
from chunkline.server.entrypoints.http.server import HttpLimits, HttpServer

__all__ = ["OpenAIApi", "HttpLimits", "HttpServer"]
