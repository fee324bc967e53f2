"""Iteration-level (continuous) batching for the embedded model.

:class:`BatchEngine` is the core: pure bookkeeping around a model object, driven by calls, with
time from an injected clock and no threads or sleeps. Sequences join and leave the running batch
*between* decode steps: each :meth:`BatchEngine.step` first retires cancelled sequences and frees
their slots, then prefills newly added sequences (each gets its first token at once, so a request
joining mid-batch never waits for the batch to finish), then advances every other running
sequence by one token in a single forward pass. A sequence leaves on a stop token, a stop string,
``max_tokens`` or the end of the context.

:class:`EngineThread` is the thin shell: one worker thread that loops ``step()`` while there is
work, takes additions and cancellations through a lock, and hands each step's events to a
callback (the asyncio side forwards them to the loop). Inference never runs on the event loop.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from chunkline.server.text.sampling import OutputText, SamplingParams, new_generator, sample_next
from chunkline.server.text.tokenizer import STOP_TOKENS, VOCAB_SIZE, ByteTokenizer

__all__ = [
    "LanguageModel",
    "SamplingModel",
    "FinishReason",
    "TextSequence",
    "TokenEvent",
    "FinishEvent",
    "EngineEvent",
    "BatchEngine",
    "EngineThread",
]

log = logging.getLogger("chunkline.server.text")

#: Output bytes per token id (a table: this runs once per generated token).
_TOKEN_BYTES: tuple[bytes, ...] = tuple(ByteTokenizer.token_bytes(t) for t in range(VOCAB_SIZE))


class LanguageModel(Protocol):
    """What the engine needs from a model (:class:`~chunkline.server.text.model.TinyLM` is one).

    A model may also pick the tokens itself (see :class:`SamplingModel`); otherwise the engine
    samples its logits with :func:`~chunkline.server.text.sampling.sample_next`.
    """

    max_slots: int

    @property
    def context(self) -> int: ...

    def prefill(self, slot: int, tokens: Sequence[int]) -> np.ndarray: ...

    def decode(self, slots: Sequence[int], tokens: Sequence[int], positions: Sequence[int]) -> np.ndarray: ...


@runtime_checkable
class SamplingModel(LanguageModel, Protocol):
    """A model that samples inside its forward pass, given each row's uniform draw.

    The engine draws the uniforms from the requests' own generators (one per non-greedy token,
    as :func:`~chunkline.server.text.sampling.sample_next` does), so seeds mean the same thing
    on both paths.
    """

    def prefill_sample(self, slot: int, tokens: Sequence[int], params: SamplingParams, uniform: float) -> int: ...

    def decode_sample(self, slots: Sequence[int], tokens: Sequence[int], positions: Sequence[int],
                      params: Sequence[SamplingParams], uniforms: Sequence[float]) -> list[int]: ...


class FinishReason(str, enum.Enum):
    """Why a sequence left the batch (the first two are OpenAI's ``finish_reason``)."""

    STOP = "stop"  # a stop token or a stop string
    LENGTH = "length"  # max_tokens or the end of the context
    CANCELLED = "cancelled"  # the client went away or cancelled
    DEADLINE = "deadline_exceeded"  # its time-to-first-token deadline passed before it could start
    ERROR = "error"  # the model raised


@dataclasses.dataclass(eq=False)
class TextSequence:
    """One request inside the engine.

    Args:
        key: the caller's id for it (events carry it back).
        prompt: prompt token ids (``1 <= len < context``).
        params: sampling and stopping.
        priority: its tenant's text priority (the engine yields to higher-priority robot work).
        deadline: first-token deadline on the engine's clock; a sequence not started by then is
            finished with ``deadline_exceeded`` instead of run.
    """

    key: Hashable
    prompt: list[int]
    params: SamplingParams
    priority: int = 0
    deadline: float = math.inf
    slot: int = dataclasses.field(default=-1, init=False)
    generated: list[int] = dataclasses.field(default_factory=list, init=False)
    started_at: float | None = dataclasses.field(default=None, init=False)
    first_token_at: float | None = dataclasses.field(default=None, init=False)
    rng: np.random.Generator = dataclasses.field(init=False, repr=False)
    output: OutputText = dataclasses.field(init=False, repr=False)
    cancelled: bool = dataclasses.field(default=False, init=False)

    def __post_init__(self) -> None:
        self.rng = new_generator(self.params.seed)
        self.output = OutputText(self.params.stop)

    @property
    def position(self) -> int:
        """Where the latest token sits (its cache index)."""
        return len(self.prompt) + len(self.generated) - 1


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """Tokens were generated for ``key``.

    Args:
        key: the sequence.
        text: text now safe to emit (may be empty: held back for a stop string or a split character).
        tokens: tokens this event accounts for (0 for a final flush of held-back text).
        time: when (engine clock).
    """

    key: Hashable
    text: str
    tokens: int
    time: float


@dataclasses.dataclass(frozen=True)
class FinishEvent:
    """A sequence left the batch; no more events for ``key``.

    Args:
        key: the sequence.
        reason: why.
        prompt_tokens: its prompt length.
        completion_tokens: tokens generated.
        prefilled: whether its prompt was processed (it used compute and tokens).
        time: when (engine clock).
        started_at: when it joined the batch (prefill began), if it did.
        first_token_at: when its first token was produced, if it was.
        message: detail for ``error``.
    """

    key: Hashable
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    prefilled: bool
    time: float
    started_at: float | None = None
    first_token_at: float | None = None
    message: str = ""


EngineEvent = TokenEvent | FinishEvent


def _uniform(seq: TextSequence) -> float:
    """The sequence's draw for its next token: one uniform unless it decodes greedily."""
    return seq.rng.random() if seq.params.temperature != 0.0 else 0.0


class BatchEngine:
    """Continuous batching over a model with ``max_slots`` KV-cache slots (sans-I/O core).

    Args:
        model: the model (its ``max_slots`` is the most sequences running at once).
        clock: the time in seconds (event stamps and first-token deadlines).
        max_prefill_tokens: prompt tokens to prefill per step before the decode pass (at least
            one prompt is always prefilled when one waits).
    """

    def __init__(self, model: LanguageModel, clock: Callable[[], float] = time.perf_counter, max_prefill_tokens: int = 512) -> None:
        self.model = model
        self.clock = clock
        self.max_prefill_tokens = max_prefill_tokens
        self._fused = isinstance(model, SamplingModel)
        self._context = model.context
        self._free = list(range(model.max_slots - 1, -1, -1))  # pop() gives the lowest slot
        self._waiting: list[TextSequence] = []
        self._running: list[TextSequence] = []
        self._by_key: dict[Hashable, TextSequence] = {}
        self.steps = 0
        self.decode_steps = 0

    # ------------------------------------------------------------------ state

    @property
    def capacity(self) -> int:
        """Most sequences at once."""
        return self.model.max_slots

    @property
    def active(self) -> int:
        """Sequences added and not finished (waiting for prefill or running)."""
        return len(self._by_key)

    @property
    def free_slots(self) -> int:
        """Sequences that can still be added."""
        return self.capacity - len(self._by_key)

    @property
    def has_work(self) -> bool:
        """Whether :meth:`step` would do anything."""
        return bool(self._by_key)

    def top_priority(self) -> int | None:
        """The highest priority among active sequences (``None`` when idle)."""
        return max((s.priority for s in self._by_key.values()), default=None)

    def remaining(self) -> list[int]:
        """Per active sequence, tokens it may still generate (for wait predictions)."""
        return [s.params.max_tokens - len(s.generated) for s in self._by_key.values()]

    def sequence(self, key: Hashable) -> TextSequence | None:
        """The active sequence ``key``, if any."""
        return self._by_key.get(key)

    # ------------------------------------------------------------------ requests

    def add(self, seq: TextSequence) -> None:
        """Queue ``seq`` to join the batch at the next step.

        Raises:
            ValueError: no free slot, a duplicate key, or a prompt/max_tokens that does not fit.
        """
        if self.free_slots <= 0:
            raise ValueError("no free slot")
        if seq.key in self._by_key:
            raise ValueError(f"sequence {seq.key!r} is already active")
        if not seq.prompt or len(seq.prompt) + seq.params.max_tokens > self.model.context:
            raise ValueError("prompt + max_tokens must fit the context")
        self._by_key[seq.key] = seq
        self._waiting.append(seq)

    def cancel(self, key: Hashable) -> bool:
        """Mark ``key`` cancelled; its slot is freed at the next :meth:`step` (or :meth:`reap`).

        Returns:
            whether it was active.
        """
        seq = self._by_key.get(key)
        if seq is None:
            return False
        seq.cancelled = True
        return True

    def cancel_all(self) -> None:
        """Mark every active sequence cancelled (shutdown)."""
        for seq in self._by_key.values():
            seq.cancelled = True

    # ------------------------------------------------------------------ stepping

    def _finish(self, seq: TextSequence, reason: FinishReason, now: float, events: list[EngineEvent], message: str = "") -> None:
        tail = seq.output.finish() if reason in (FinishReason.STOP, FinishReason.LENGTH) else ""
        if tail:
            events.append(TokenEvent(seq.key, tail, 0, now))
        if seq.slot >= 0:
            self._free.append(seq.slot)
            self._free.sort(reverse=True)
            seq.slot = -1
        self._by_key.pop(seq.key, None)
        events.append(
            FinishEvent(
                seq.key, reason, len(seq.prompt), len(seq.generated), seq.started_at is not None, now,
                seq.started_at, seq.first_token_at, message,
            )
        )

    def reap(self) -> list[EngineEvent]:
        """Retire cancelled sequences and waiting ones past their deadline, without computing."""
        now = self.clock()
        events: list[EngineEvent] = []
        for seq in [s for s in self._waiting if s.cancelled or now > s.deadline]:
            self._waiting.remove(seq)
            self._finish(seq, FinishReason.CANCELLED if seq.cancelled else FinishReason.DEADLINE, now, events)
        for seq in [s for s in self._running if s.cancelled]:
            self._running.remove(seq)
            self._finish(seq, FinishReason.CANCELLED, now, events)
        return events

    def _accept(self, seq: TextSequence, token: int, now: float, events: list[EngineEvent]) -> bool:
        """Record one generated token; return whether the sequence goes on."""
        seq.generated.append(token)
        if seq.first_token_at is None:
            seq.first_token_at = now
        if token in STOP_TOKENS and not seq.params.ignore_eos:
            events.append(TokenEvent(seq.key, "", 1, now))
            self._finish(seq, FinishReason.STOP, now, events)
            return False
        text = seq.output.push(_TOKEN_BYTES[token])
        events.append(TokenEvent(seq.key, text, 1, now))
        if seq.output.stopped:
            self._finish(seq, FinishReason.STOP, now, events)
            return False
        if len(seq.generated) >= seq.params.max_tokens or len(seq.prompt) + len(seq.generated) >= self._context:
            self._finish(seq, FinishReason.LENGTH, now, events)
            return False
        return True

    def _admit(self, events: list[EngineEvent]) -> list[TextSequence]:
        """Take waiting sequences into the batch, within the step's prefill budget."""
        joiners: list[TextSequence] = []
        budget = self.max_prefill_tokens
        while self._waiting and budget > 0:
            seq = self._waiting.pop(0)
            now = self.clock()
            if now > seq.deadline:
                self._finish(seq, FinishReason.DEADLINE, now, events)
                continue
            seq.slot = self._free.pop()
            seq.started_at = now
            joiners.append(seq)
            budget -= len(seq.prompt)
        return joiners

    def step(self) -> list[EngineEvent]:
        """One iteration: retire, admit (prefill) joiners, decode the running batch by one token.

        Joiners get their first token from their prefill, in this same step; the sequences that
        were running advance by one token in one decode pass. Each row is sampled from its own
        generator, so batching does not change a row's token: inside the model's graph when it
        is a :class:`SamplingModel` (the logits never leave torch), else all rows at once here.

        Returns:
            the events of this step, in order (joiners' first tokens, then the running batch's).
        """
        events = self.reap()
        self.steps += 1
        # Sequences already running before this step are the ones to decode; joiners get their
        # first token from prefill.
        decoding = self._running
        joiners = self._admit(events)
        if not joiners and not decoding:
            return events
        if self._fused:
            tokens = self._step_fused(joiners, decoding)
        else:
            tokens = self._step_logits(joiners, decoding)
        now = self.clock()
        accept = self._accept
        self._running = [s for s, t in zip(joiners + decoding, tokens, strict=False) if accept(s, t, now, events)]
        return events

    def _step_fused(self, joiners: list[TextSequence], decoding: list[TextSequence]) -> list[int]:
        """The model samples: one call per joiner, one for the running batch (each one GIL release)."""
        model: SamplingModel = self.model  # type: ignore[assignment]
        tokens = [model.prefill_sample(s.slot, s.prompt, s.params, _uniform(s)) for s in joiners]
        if decoding:
            self.decode_steps += 1
            tokens += model.decode_sample(
                [s.slot for s in decoding], [s.generated[-1] for s in decoding],
                [len(s.prompt) + len(s.generated) - 1 for s in decoding],
                [s.params for s in decoding], [_uniform(s) for s in decoding],
            )
        return tokens

    def _step_logits(self, joiners: list[TextSequence], decoding: list[TextSequence]) -> list[int]:
        """The model gives logits; every row is sampled here at once."""
        rows = [self.model.prefill(s.slot, s.prompt) for s in joiners]
        if decoding:
            self.decode_steps += 1
            rows.append(self.model.decode(
                [s.slot for s in decoding], [s.generated[-1] for s in decoding],
                [len(s.prompt) + len(s.generated) - 1 for s in decoding],
            ))
        batch = joiners + decoding
        return sample_next(np.vstack(rows), [s.params for s in batch], [s.rng for s in batch])

    def fail_all(self, message: str) -> list[EngineEvent]:
        """The model raised: finish every active sequence with ``error`` (the engine stays usable)."""
        now = self.clock()
        events: list[EngineEvent] = []
        for seq in list(self._by_key.values()):
            self._finish(seq, FinishReason.ERROR, now, events, message)
        self._waiting.clear()
        self._running.clear()
        return events


class EngineThread:
    """Runs a :class:`BatchEngine` on one worker thread.

    Args:
        engine: the core.
        on_events: called on the worker thread with each step's events (must not block; the
            asyncio side uses ``loop.call_soon_threadsafe``).
        yield_to: ``yield_to(priority)`` says whether higher-priority work elsewhere (robot
            policies) is active; while it is, no step runs (cancellations are still retired).
        poll_s: how often a paused engine re-checks ``yield_to``.
        name: the thread's name.
        on_start: called first on the worker thread (per-thread settings such as torch's
            intra-op thread count).
    """

    def __init__(
        self,
        engine: BatchEngine,
        on_events: Callable[[list[EngineEvent]], None],
        yield_to: Callable[[int], bool] | None = None,
        poll_s: float = 0.0005,
        name: str = "text-engine",
        on_start: Callable[[], None] | None = None,
    ) -> None:
        self._on_start = on_start
        self.engine = engine
        self._on_events = on_events
        self._yield_to = yield_to
        self._poll_s = poll_s
        self._cond = threading.Condition()
        self._adds: list[TextSequence] = []
        self._cancels: list[Hashable] = []
        self._stopping = False
        self.paused_s = 0.0  # time spent yielding to higher-priority work
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        """Start the worker thread."""
        self._thread.start()

    def submit(self, seq: TextSequence) -> None:
        """Add a sequence (thread-safe); it joins at the engine's next step."""
        with self._cond:
            self._adds.append(seq)
            self._cond.notify()

    def cancel(self, key: Hashable) -> None:
        """Cancel a sequence (thread-safe); its slot is freed at the next step."""
        with self._cond:
            self._cancels.append(key)
            self._cond.notify()

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop after the current step; active sequences are finished ``cancelled``."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _drain(self) -> list[EngineEvent]:
        # Called with the lock held.
        events: list[EngineEvent] = []
        for seq in self._adds:
            try:
                self.engine.add(seq)
            except ValueError as exc:  # the service checked these; a slip must not kill the thread
                events.append(FinishEvent(seq.key, FinishReason.ERROR, len(seq.prompt), 0, False, self.engine.clock(), message=str(exc)))
        for key in self._cancels:
            self.engine.cancel(key)
        self._adds.clear()
        self._cancels.clear()
        return events

    def _run(self) -> None:
        if self._on_start is not None:
            self._on_start()
        while True:
            with self._cond:
                while not (self._stopping or self._adds or self._cancels or self.engine.has_work):
                    self._cond.wait()
                if self._stopping:
                    self.engine.cancel_all()
                    events = self._drain() + self.engine.reap()
                    if events:
                        self._on_events(events)
                    return
                events = self._drain()
                top = self.engine.top_priority()
                paused = top is not None and self._yield_to is not None and self._yield_to(top)
                if paused:
                    events += self.engine.reap()
                    t = time.perf_counter()
                    self._cond.wait(self._poll_s)
                    self.paused_s += time.perf_counter() - t
            if paused:
                if events:
                    self._on_events(events)
                continue
            try:
                events += self.engine.step()
            except Exception as exc:  # one failing step fails its sequences, not the engine
                log.exception("text engine step failed")
                events += self.engine.fail_all(f"the model raised {type(exc).__name__}")
            if events:
                self._on_events(events)
