"""The text backend interface, and the embedded backend (continuous batching on the built-in model).

A backend turns a validated :class:`GenerationRequest` into a stream of events on the event loop:
:class:`Delta` (text, token counts) then one :class:`Finished`. The service owns everything else
(authentication, admission, quotas, metrics, ledger); a backend only says how a request is
counted (:meth:`TextBackend.prepare`), starts it when admission grants it a slot
(:meth:`TextBackend.launch`) and stops it on cancellation (:meth:`TextBackend.cancel`).
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import platform
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any, Literal

from chunkline.client.wire.errors import ErrorCode
from chunkline.server.errors import Refusal
from chunkline.server.text.config import TextModelConfig
from chunkline.server.text.errors import (
    ContextLengthExceeded,
    GenerationFailed,
    InvalidTextRequest,
)
from chunkline.server.text.load import TextLoadModel
from chunkline.server.text.sampling import SamplingParams
from chunkline.server.text.tokenizer import ByteTokenizer, ChatMessage

__all__ = [
    "GenerationRequest",
    "LossItem",
    "PreparedRequest",
    "Delta",
    "Finished",
    "BackendEvent",
    "TextBackend",
    "EmbeddedBackend",
    "text_fingerprint",
]

log = logging.getLogger("chunkline.server.text")


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """A text request after parsing, whichever front-end it came from.

    Args:
        kind: ``chat`` (``messages``) or ``completion`` (``prompt``).
        model: the model asked for.
        messages: the conversation (chat).
        prompt: the prompt (completion).
        params: sampling and stopping (``max_tokens`` resolved by :meth:`TextBackend.prepare`
            when ``max_tokens_set`` is false).
        max_tokens_set: whether the caller gave ``max_tokens``.
        deadline_ms: time-to-first-token budget, or ``None`` for the model's default.
        set_fields: the sampling fields the caller set explicitly (what a backend must honour).
    """

    kind: Literal["chat", "completion"]
    model: str
    messages: tuple[ChatMessage, ...] = ()
    prompt: str = ""
    params: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    max_tokens_set: bool = False
    deadline_ms: float | None = None
    set_fields: frozenset[str] = frozenset()


@dataclasses.dataclass(frozen=True)
class LossItem:
    """One way a backend did not honour the request exactly (the translation-loss report).

    Args:
        field: the request field.
        action: ``dropped`` (not sent upstream), ``enforced`` (the gateway applied it itself) or
            ``estimated`` (a figure the upstream did not report, e.g. usage).
        detail: explanation.
    """

    field: str
    action: Literal["dropped", "enforced", "estimated"]
    detail: str

    def to_json(self) -> dict[str, str]:
        return {"field": self.field, "action": self.action, "detail": self.detail}


@dataclasses.dataclass(frozen=True)
class PreparedRequest:
    """How a backend will run a request, decided before admission.

    Args:
        request: the request.
        params: its sampling parameters with ``max_tokens`` resolved.
        prompt_tokens: prompt length in tokens (exact, or estimated for an upstream).
        prompt_exact: whether ``prompt_tokens`` is exact.
        token_ids: the prompt's token ids (embedded backend).
        loss: fields known in advance not to be honoured exactly (reported in the response).
    """

    request: GenerationRequest
    params: SamplingParams
    prompt_tokens: int
    prompt_exact: bool = True
    token_ids: tuple[int, ...] = ()
    loss: tuple[LossItem, ...] = ()


@dataclasses.dataclass(frozen=True)
class Delta:
    """New output: ``text`` (maybe empty) covering ``tokens`` generated tokens, at ``time``."""

    text: str
    tokens: int
    time: float


@dataclasses.dataclass(frozen=True)
class Finished:
    """The request ended (exactly one per launched request).

    Args:
        reason: ``stop``, ``length``, ``cancelled`` or ``error``.
        prompt_tokens: prompt tokens (as the backend counted them).
        completion_tokens: tokens generated.
        time: when.
        started_at: when it started running (slot granted / request sent upstream), if it did.
        first_token_at: when its first token came, if one did.
        consumed: whether the prompt was processed (compute and tokens were used).
        error: for ``error``, what failed.
        usage_reported: ``False`` when the token counts are estimates (an upstream without usage).
        loss: translation losses found while running (e.g. a stop string the upstream ignored).
    """

    reason: str
    prompt_tokens: int
    completion_tokens: int
    time: float
    started_at: float | None = None
    first_token_at: float | None = None
    consumed: bool = True
    error: Refusal | None = None
    usage_reported: bool = True
    loss: tuple[LossItem, ...] = ()


BackendEvent = Delta | Finished
Emit = Callable[[BackendEvent], None]


def text_fingerprint(doc: dict[str, Any]) -> str:
    """``sha256:<16 hex>`` of everything that changes a text model's behaviour.

    Args:
        doc: weights digest, architecture, library versions, settings.
    """
    doc = {**doc, "python": platform.python_version()}
    return "sha256:" + hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:16]


class TextBackend(abc.ABC):
    """One served text model's execution (see the module docstring).

    Args:
        config: the model's configuration.
        clock: the service's clock (seconds).
    """

    def __init__(self, config: TextModelConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self.clock = clock
        self.load = TextLoadModel(config.max_batch)
        self.fingerprint = ""

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def capacity(self) -> int:
        """Requests that may run at once."""
        return self.config.max_batch

    @property
    def max_model_len(self) -> int | None:
        """Context length in tokens (prompt + output), where this server knows it."""
        return None

    @abc.abstractmethod
    async def start(self) -> None:
        """Load, warm up, start workers."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Stop workers; running requests end ``cancelled``."""

    @abc.abstractmethod
    def prepare(self, request: GenerationRequest) -> PreparedRequest:
        """Validate and count a request.

        Raises:
            InvalidTextRequest, ContextLengthExceeded, UnsupportedParameter: it cannot run here.
        """

    @abc.abstractmethod
    def launch(self, key: Hashable, prepared: PreparedRequest, *, priority: int, deadline: float, emit: Emit) -> None:
        """Start a request (called on the loop when admission grants it a slot).

        Args:
            key: its server-unique id.
            prepared: from :meth:`prepare`.
            priority: its text priority.
            deadline: its first-token deadline (service clock).
            emit: called on the loop with each :class:`Delta` and the final :class:`Finished`.
        """

    @abc.abstractmethod
    def cancel(self, key: Hashable) -> None:
        """Stop a launched request; its :class:`Finished` (``cancelled``) follows."""

    def _resolve_max_tokens(self, request: GenerationRequest, prompt_tokens: int, context: int | None) -> int:
        cfg = self.config
        room = cfg.max_output_tokens if context is None else min(cfg.max_output_tokens, context - prompt_tokens)
        if request.max_tokens_set:
            asked = request.params.max_tokens
            if asked > cfg.max_output_tokens:
                raise InvalidTextRequest(f"max_tokens is {asked}, this model allows at most {cfg.max_output_tokens}", "max_tokens")
            if context is not None and prompt_tokens + asked > context:
                raise ContextLengthExceeded(
                    f"This model's maximum context length is {context} tokens. However, you requested "
                    f"{prompt_tokens + asked} tokens ({prompt_tokens} in the messages, {asked} in the completion). "
                    "Please reduce the length of the messages or completion.",
                    "max_tokens" if prompt_tokens < context else "messages",
                )
            return asked
        if room < 1:
            raise ContextLengthExceeded(f"This model's maximum context length is {context} tokens; the prompt has {prompt_tokens}.")
        return min(cfg.default_max_tokens, room)


class EmbeddedBackend(TextBackend):
    """The built-in transformer with iteration-level batching on its own thread.

    Args:
        config: the model's configuration (``backend = "embedded"``).
        clock: the service's clock.
        yield_to: ``yield_to(priority)``: whether higher-priority robot work is active (the engine
            pauses between steps while it is); used only if ``config.yield_to_policy``.
    """

    def __init__(self, config: TextModelConfig, clock: Callable[[], float], yield_to: Callable[[int], bool] | None = None) -> None:
        super().__init__(config, clock)
        self.tokenizer = ByteTokenizer()
        self._yield_to = yield_to if config.yield_to_policy else None
        self._emit: dict[Hashable, Emit] = {}
        self._thread: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.engine: Any = None
        # Engine events not yet handed to the loop (see _post); the lock is held for a list swap.
        self._pending: list[Any] = []
        self._pending_lock = threading.Lock()

    # ------------------------------------------------------------------ life cycle

    @property
    def max_model_len(self) -> int | None:
        return self.config.context

    def _build(self) -> tuple[Any, dict[str, float]]:
        """Worker thread: build the model and measure prefill and decode (torch is imported here)."""
        import torch

        from chunkline.server.text.engine import BatchEngine
        from chunkline.server.text.model import TinyLM, TinyLMConfig

        cfg = self.config
        torch.set_num_threads(cfg.threads)  # measure as the engine thread will run
        arch = TinyLMConfig(d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, d_ff=cfg.d_ff, context=cfg.context,
                            seed=cfg.seed)
        model = TinyLM(arch, cfg.max_batch, device=cfg.device, fixed_shape=cfg.batch_invariant)
        engine = BatchEngine(model, clock=self.clock, max_prefill_tokens=cfg.max_prefill_tokens)
        # Warm-up: the first calls allocate; then time a short and a long prefill and a full decode
        # step, as the engine calls them (sampling in the graph).
        short = [1] * 16
        long = [1] * min(cfg.max_prompt_tokens, 256)
        rows = cfg.max_batch
        params = SamplingParams()

        def prefill(tokens: list[int]) -> None:
            model.prefill_sample(0, tokens, params, 0.5)

        def step() -> None:
            model.decode_sample(list(range(rows)), [1] * rows, [16] * rows, [params] * rows, [0.5] * rows)

        for _ in range(2):
            prefill(short)
            step()

        def timed(fn: Callable[[], Any], n: int = 3) -> float:
            ts = []
            for _ in range(n):
                t = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t)
            return sorted(ts)[n // 2]

        t_short = timed(lambda: prefill(short))
        t_long = timed(lambda: prefill(long))
        t_step = timed(step)
        per_token = max(0.0, (t_long - t_short) / max(1, len(long) - len(short)))
        self.fingerprint = text_fingerprint({
            "weights": model.weights_digest, "arch": dataclasses.asdict(arch), "torch": torch.__version__,
            "precision": "float32", "numerics": TinyLM.NUMERICS, "device": cfg.device, "batch_invariant": cfg.batch_invariant,
            "max_batch": cfg.max_batch,
        })
        return engine, {"prefill_base": max(0.0, t_short - per_token * len(short)) + t_step, "per_token": per_token, "step": t_step}

    async def start(self) -> None:
        from chunkline.server.text.engine import EngineThread

        self._loop = asyncio.get_running_loop()
        # A thread of its own: torch's thread count is a per-thread setting, and the loop's
        # default executor is shared with other work (policy loading).
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"text-build-{self.name}") as pool:
            engine, timing = await self._loop.run_in_executor(pool, self._build)
        self.engine = engine
        self.load = TextLoadModel(self.config.max_batch, timing["per_token"], timing["prefill_base"], timing["step"])
        log.info("text model %s loaded: prefill %.2f ms + %.3f ms/token, decode step %.2f ms at batch %d, fingerprint %s",
                 self.name, timing["prefill_base"] * 1e3, timing["per_token"] * 1e3, timing["step"] * 1e3, self.config.max_batch,
                 self.fingerprint)
        self._thread = EngineThread(engine, self._post, yield_to=self._yield_to, name=f"text-{self.name}", on_start=self._thread_setup)
        self._thread.start()

    def _thread_setup(self) -> None:
        """Engine thread: its own intra-op thread count (OpenMP settings are per calling thread,
        so this leaves the robot lanes' threads alone)."""
        import torch

        torch.set_num_threads(self.config.threads)

    async def stop(self) -> None:
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.stop)
            self._thread = None

    @property
    def paused_s(self) -> float:
        """Seconds the engine spent yielding to higher-priority robot work."""
        return self._thread.paused_s if self._thread is not None else 0.0

    # ------------------------------------------------------------------ requests

    def prepare(self, request: GenerationRequest) -> PreparedRequest:
        cfg = self.config
        if request.kind == "chat":
            ids = self.tokenizer.chat_prompt(request.messages)
            param = "messages"
        else:
            ids = self.tokenizer.completion_prompt(request.prompt)
            param = "prompt"
        if len(ids) > cfg.max_prompt_tokens:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {cfg.context} tokens, of which at most {cfg.max_prompt_tokens} "
                f"for the prompt; the {param} come to {len(ids)} tokens.", param
            )
        max_tokens = self._resolve_max_tokens(request, len(ids), cfg.context)
        params = dataclasses.replace(request.params, max_tokens=max_tokens)
        return PreparedRequest(request, params, len(ids), True, tuple(ids))

    def launch(self, key: Hashable, prepared: PreparedRequest, *, priority: int, deadline: float, emit: Emit) -> None:
        from chunkline.server.text.engine import TextSequence

        if self._thread is None:
            emit(Finished("error", prepared.prompt_tokens, 0, self.clock(), consumed=False,
                          error=Refusal(ErrorCode.SHUTTING_DOWN, "the text engine is stopped")))
            return
        self._emit[key] = emit
        self._thread.submit(TextSequence(key, list(prepared.token_ids), prepared.params, priority, deadline))

    def cancel(self, key: Hashable) -> None:
        if self._thread is not None and key in self._emit:
            self._thread.cancel(key)

    def _post(self, events: list[Any]) -> None:
        """Engine thread: queue a step's events for the loop, waking it only if it has nothing queued.

        A wake-up is a write to the loop's self-pipe (a system call, and a point where the engine
        thread gives up the GIL and may wait to get it back). While the loop is still busy with
        earlier steps, later steps only append: one wake-up serves them all.
        """
        with self._pending_lock:
            wake = not self._pending
            self._pending.extend(events)
        if wake and self._loop is not None:
            self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        """On the loop: take everything the engine queued and dispatch it."""
        with self._pending_lock:
            events, self._pending = self._pending, []
        self._dispatch(events)

    def _dispatch(self, events: list[Any]) -> None:
        """On the loop: engine events to each request's ``emit``, in order.

        Several steps' tokens for one request (queued while the loop was busy) are not merged
        here: the request's job merges whatever its reader has not taken yet (``TextJob.stream``).
        """
        from chunkline.server.text.engine import FinishEvent

        for ev in events:
            emit = self._emit.get(ev.key)
            if emit is None:
                continue
            if isinstance(ev, FinishEvent):
                self._finish(emit, ev)
            else:
                emit(Delta(ev.text, ev.tokens, ev.time))

    def _finish(self, emit: Emit, ev: Any) -> None:
        """On the loop: a request's engine ``FinishEvent`` to its :class:`Finished`."""
        from chunkline.server.text.engine import FinishReason

        del self._emit[ev.key]
        error: Refusal | None = None
        reason = ev.reason.value
        if ev.reason is FinishReason.DEADLINE:
            error, reason = Refusal(ErrorCode.DEADLINE_EXCEEDED, "the time-to-first-token deadline passed before a slot was free"), "error"
        elif ev.reason is FinishReason.ERROR:
            error = GenerationFailed(ev.message or "the text model failed")
        emit(Finished(reason, ev.prompt_tokens, ev.completion_tokens, ev.time, ev.started_at, ev.first_token_at,
                      consumed=ev.prefilled, error=error))
