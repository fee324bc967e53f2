"""The upstream planner: an OpenAI-compatible (vision-)language model asked for a plan with
structured output, every answer validated, one repair, then a typed refusal.

One ``POST {upstream_url}/chat/completions`` per request with the plan's strict JSON schema,
temperature 0, numeric fields as JSON and camera images as PNG data URLs encoded in worker
processes in the tenant's turn (:mod:`.image_encoder`), their text streamed into the upload. The
answer is never trusted: the body is read up to ``max_response_bytes``; the content is parsed
strictly, then checked against the scene (:func:`~chunkline.server.planner.scene.check_scene`);
the model's note is dropped or cleaned; an invalid answer is sent back once for repair, then
refused ``plan_invalid``. Transport failures are ``policy_failed``; a 429's ``Retry-After`` is
clamped to ``max_retry_after_s`` (garbage becomes ``default_retry_after_s``); the request's
deadline bounds every call. The HTTP client and every call run on a loop of their own
(:mod:`.upstream_loop`), never on the server's: the upload's copying stays out of robots' turns."""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import numpy as np

from chunkline.client.wire.errors import ErrorCode
from chunkline.server.errors import Refusal
from chunkline.server.planner.config import PlannerConfig
from chunkline.server.planner.errors import PlanInvalid, PlannerFailed
from chunkline.server.planner.image_encoder import ImageEncoder
from chunkline.server.planner.planners import PlanInput, PlanResult, observed_targets
from chunkline.server.planner.request_body import DataUrl, body_length, body_pieces, json_pieces
from chunkline.server.planner.scene import check_scene, clean_text
from chunkline.server.planner.schema import SKILLS, PlanDocument, parse_plan_text, plan_json_schema
from chunkline.server.planner.upstream_loop import UpstreamLoop

__all__ = ["UpstreamPlanner", "data_urls", "retry_after_ms"]

#: Largest numeric observation field sent as text, and largest image side.
MAX_FIELD_ELEMENTS = 4096
MAX_IMAGE_SIDE = 2048
#: How much of an invalid answer is quoted back in the repair request.
REPAIR_QUOTE_CHARS = 2000

SYSTEM_PROMPT = (
    "You are the task planner of a robot. A local policy executes one step at a time. "
    "Answer with one JSON object that matches the given schema and nothing else. "
    "Skills: goto (move the end effector to a target id, with its last known position as goal), "
    "hold (stay), return (go home)."
)


def _is_image(value: Any) -> bool:
    return isinstance(value, np.ndarray) and value.dtype == np.uint8 and value.ndim == 3 and value.shape[2] == 3


class UpstreamPlanner:
    """A planner that asks an OpenAI-compatible model (see the module docstring).

    Args:
        cfg: the planner's settings (``upstream_url``, ``upstream_model``, limits).
        clock: the service's monotonic clock (deadlines are on it).
        transport: an httpx transport (tests pass a mock).
        encoder: where camera images are encoded (by default one of its own, started at the first image).
    """

    def __init__(self, cfg: PlannerConfig, clock: Callable[[], float] = time.perf_counter,
                 transport: httpx.AsyncBaseTransport | None = None, encoder: ImageEncoder | None = None) -> None:
        assert cfg.upstream_url is not None
        self.url = cfg.upstream_url
        self.cfg = cfg
        self.name = cfg.name
        self.max_steps = cfg.max_steps
        self.model = cfg.upstream_model or cfg.name
        self.clock = clock
        self.fingerprint = "sha256:" + hashlib.sha256(f"upstream:{cfg.upstream_url}:{self.model}".encode()).hexdigest()
        self._transport = transport
        self._client: httpx.AsyncClient | None = None  # used on self._io's loop only
        self._io = UpstreamLoop()
        self.schema = plan_json_schema(cfg.max_steps)
        self.workspace = cfg.workspace_area()
        self._encoder = encoder

    async def start(self) -> None:
        self._io.start()
        await self._io.call(self._open())

    async def _open(self) -> None:
        headers = {"Authorization": f"Bearer {self.cfg.upstream_api_key}"} if self.cfg.upstream_api_key else {}
        self._client = httpx.AsyncClient(base_url=self.url.rstrip("/") + "/", headers=headers,
                                         transport=self._transport)

    async def stop(self) -> None:
        if self._client is not None:
            try:
                await self._io.call(self._client.aclose())
            except PlannerFailed:  # the loop is gone already, and its connections with it
                pass
        await self._io.stop()
        if self._encoder is not None:
            self._encoder.close()

    def metadata(self) -> dict[str, Any]:
        return {"backend": "upstream", "fingerprint": self.fingerprint, "skills": list(SKILLS), "schema": self.schema,
                "observation": {"images": "uint8 [H, W, 3], sent as PNG", "other": f"numeric, at most {MAX_FIELD_ELEMENTS} values each"}}

    def check(self, request: PlanInput) -> None:
        for name, value in request.obs.items():
            if isinstance(value, str):
                continue
            if _is_image(value):
                if max(value.shape[:2]) > MAX_IMAGE_SIDE:
                    raise Refusal(ErrorCode.INVALID_OBSERVATION, f"image {name!r} is larger than {MAX_IMAGE_SIDE} px")
                continue
            if not isinstance(value, np.ndarray) or value.dtype.kind not in "fiub" or value.size > MAX_FIELD_ELEMENTS:
                raise Refusal(ErrorCode.INVALID_OBSERVATION, f"field {name!r}: images (uint8 [H, W, 3]), strings, "
                                                             f"or numeric arrays of at most {MAX_FIELD_ELEMENTS} values")
            if value.dtype.kind == "f" and not np.isfinite(value).all():
                raise Refusal(ErrorCode.INVALID_OBSERVATION, f"field {name!r} holds non-finite values")
        observed_targets(request.obs, self.workspace)  # listed targets are well formed and in the workspace

    async def messages(self, request: PlanInput) -> list[dict[str, Any]]:
        """The chat messages of the first attempt; the encoder discards their images' texts once sent.

        Raises:
            Refusal: ``overloaded`` when the tenant's images in the encoder are at their bound.
        """
        fields = {k: (v if isinstance(v, str) else np.round(v.astype(np.float64), 4).tolist())
                  for k, v in request.obs.items() if not _is_image(v)}
        context = {"plan_id": request.plan_id, "subtask": request.subtask, "progress": request.progress}
        text = json.dumps({"instruction": request.instruction, "context": context, "observation": fields})
        content: list[dict[str, Any]] = [{"type": "text", "text": text}]
        images = {name: value for name, value in request.obs.items() if _is_image(value)}
        encoder = request.encoder or self._own_encoder()
        urls = await asyncio.gather(*(encoder.data_url(request.tenant, value) for value in images.values()))
        for name, url in zip(images, urls, strict=True):
            content.append({"type": "text", "text": f"camera {name}:"})
            content.append({"type": "image_url", "image_url": {"url": url}})
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": content}]

    def _own_encoder(self) -> ImageEncoder:
        if self._encoder is None:
            self._encoder = ImageEncoder()
        return self._encoder

    async def plan(self, request: PlanInput, deadline: float) -> PlanResult:
        targets = observed_targets(request.obs, self.workspace)  # the upstream loop never reads the observation
        messages = await self.messages(request)
        encoder = request.encoder or self._own_encoder()
        urls = data_urls(messages)
        # The image texts go once the upstream loop is done with them, not when this task is.
        return await self._io.run(self._plan(messages, targets, deadline), lambda: encoder.discard(urls))

    async def _plan(self, messages: list[dict[str, Any]], targets: dict[str, tuple[float, float]] | None, deadline: float) -> PlanResult:
        """On the upstream loop: one completion, and one repair if its answer is invalid."""
        content = await self._complete(messages, deadline)
        try:
            return PlanResult(self._accept(content, targets), attempts=1)
        except PlanInvalid as first:
            messages += [
                {"role": "assistant", "content": content[:REPAIR_QUOTE_CHARS]},
                {"role": "user", "content": f"That answer is invalid ({first.message}). Answer again with only a JSON object "
                                            "that matches the schema."},
            ]
        content = await self._complete(messages, deadline)
        try:
            return PlanResult(self._accept(content, targets), attempts=2)
        except PlanInvalid as second:
            raise PlanInvalid(f"invalid after one repair: {second.message}") from None

    def _accept(self, content: str, targets: dict[str, tuple[float, float]] | None) -> PlanDocument:
        """The model's answer as a plan for the observation whose ``targets`` are given (see the
        module docstring)."""
        plan = check_scene(parse_plan_text(content, self.max_steps, self.cfg.max_response_bytes), targets, self.workspace)
        note = clean_text(plan.note, self.cfg.max_note_chars) if self.cfg.pass_note else ""
        return PlanDocument(steps=plan.steps, note=note)

    async def _complete(self, messages: list[dict[str, Any]], deadline: float) -> str:
        """One completion's ``message.content``; raises a typed refusal for everything else. The
        body's images (megabytes) are streamed a piece at a time, never joined."""
        assert self._client is not None, "start() first"
        remaining = deadline - self.clock()
        if remaining <= 0:
            raise Refusal(ErrorCode.DEADLINE_EXCEEDED, "the plan's deadline passed before the upstream answered")
        body = {"model": self.model, "messages": messages, "temperature": 0, "max_tokens": self.cfg.max_output_tokens,
                "response_format": {"type": "json_schema", "json_schema": {"name": "plan", "strict": True, "schema": self.schema}}}
        parts = json_pieces(body)
        headers = {**_JSON_HEADERS, "content-length": str(body_length(parts))}
        remaining = max(1e-3, deadline - self.clock())
        try:
            async with self._client.stream("POST", "chat/completions", content=_each(parts), headers=headers,
                                           timeout=remaining) as response:
                if response.status_code == 429:
                    raise Refusal(ErrorCode.OVERLOADED, "the upstream planner is rate limited", retry_after_ms=self._retry_after(response))
                if response.status_code != 200:
                    raise PlannerFailed(f"the upstream planner answered HTTP {response.status_code}",
                                        self._retry_after(response) if "retry-after" in response.headers else None)
                raw = bytearray()
                async for part in response.aiter_bytes():
                    raw += part
                    if len(raw) > self.cfg.max_response_bytes:
                        raise PlanInvalid(f"the upstream's answer exceeds {self.cfg.max_response_bytes} bytes")
        except httpx.TimeoutException:
            raise Refusal(ErrorCode.DEADLINE_EXCEEDED, "the upstream planner did not answer before the deadline") from None
        except httpx.HTTPError as exc:
            raise PlannerFailed(f"the upstream planner is unreachable: {type(exc).__name__}") from None
        try:
            message = json.loads(bytes(raw))["choices"][0]["message"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise PlannerFailed("the upstream planner's response is not a chat completion") from None
        if not isinstance(message, dict):
            raise PlannerFailed("the upstream planner's response is not a chat completion")
        if message.get("refusal"):
            raise PlanInvalid("the model refused to plan")
        content = message.get("content")
        if not isinstance(content, str):
            raise PlanInvalid("the model's answer has no text content")
        return content


    def _retry_after(self, response: httpx.Response) -> float:
        """The upstream's ``Retry-After`` in ms, clamped (see the module docstring)."""
        return retry_after_ms(response.headers.get("retry-after"), self.cfg.default_retry_after_s, self.cfg.max_retry_after_s)


_JSON_HEADERS = {"content-type": "application/json"}


async def _each(parts: list[bytes | DataUrl]) -> AsyncIterator[bytes]:
    """The body's pieces as httpx streams them: written one at a time, with the loop's other work
    between (the length is declared, so nothing is chunk-encoded)."""
    for piece in body_pieces(parts):
        yield piece


def data_urls(messages: list[dict[str, Any]]) -> list[DataUrl]:
    """The data URLs of the images in ``messages``."""
    urls = []
    for message in messages:
        content = message.get("content")
        for part in content if isinstance(content, list) else ():
            url = part.get("image_url", {}).get("url")
            if isinstance(url, DataUrl):
                urls.append(url)
    return urls


def retry_after_ms(header: str | None, default_s: float, max_s: float) -> float:
    """A ``Retry-After`` header (seconds) as the milliseconds a robot is told: at most ``max_s``;
    ``default_s`` when absent or not a finite non-negative number (an HTTP date is not followed:
    the upstream's clock is not ours)."""
    try:
        seconds = float(header) if header is not None and len(header) <= 32 else math.nan
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds >= 0):
        seconds = default_s
    return min(seconds, max_s) * 1000.0
