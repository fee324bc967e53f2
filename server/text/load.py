"""Time-to-first-token prediction for text admission (sans-I/O).

The shared admission core plans in batches of a fixed service time, which fits a policy's
forward pass; a text sequence instead holds its slot for as many decode steps as it generates.
So before offering a text request to the core, the service asks :class:`TextLoadModel` when the
request would get its first token: running sequences free their slots after their expected
remaining tokens, each request queued ahead holds the next free slot for its own expected
length, and then this one starts and is prefilled. A request predicted to miss its
time-to-first-token deadline is refused ``deadline_unmeetable`` at the door; the core then
applies the common rules (tenant, quotas, queue bound, fairness, priority) and drops queued work
whose deadline passes.

Expected lengths are ``max_tokens`` scaled by the moving fraction of ``max_tokens`` that requests
actually generate (stop tokens and strings end many early), so the prediction neither assumes the
worst case nor ignores it.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

__all__ = ["TextLoadModel"]


@dataclasses.dataclass
class _Ewma:
    value: float
    alpha: float = 0.2
    seen: int = 0

    def add(self, x: float) -> None:
        self.value = x if self.seen == 0 else (1 - self.alpha) * self.value + self.alpha * x
        self.seen += 1


class TextLoadModel:
    """Moving estimates of one text model's speed, and the TTFT prediction built on them.

    Args:
        capacity: sequences that run at once.
        prefill_s_per_token: initial prefill cost per prompt token (e.g. from warm-up).
        prefill_base_s: initial fixed cost of a prefill (and of waiting for the current step).
        token_s: initial time per output token of a running sequence.
        safety: factor on predicted waits (admission plans for a slow-but-usual case).
    """

    def __init__(
        self,
        capacity: int,
        prefill_s_per_token: float = 0.0,
        prefill_base_s: float = 0.0,
        token_s: float = 0.0,
        safety: float = 1.25,
    ) -> None:
        if capacity < 1 or safety < 1:
            raise ValueError("capacity >= 1 and safety >= 1")
        self.capacity = capacity
        self.safety = safety
        self._per_token = _Ewma(prefill_s_per_token)
        self._base = _Ewma(prefill_base_s)
        self._token = _Ewma(token_s)
        self._used = _Ewma(1.0, alpha=0.1)  # fraction of max_tokens generated

    # ------------------------------------------------------------------ observations

    def observe_first_token(self, prompt_tokens: int, seconds: float) -> None:
        """A request got its first token ``seconds`` after it started (slot granted).

        Args:
            prompt_tokens: its prompt length.
            seconds: start to first token.
        """
        if seconds < 0 or prompt_tokens < 0:
            return
        # Attribute the time to the fixed part first, the rest per token (a crude split that
        # stays right on average for the prompt lengths a deployment sees).
        per_token = self._per_token.value
        base = max(0.0, seconds - per_token * prompt_tokens)
        self._base.add(base)
        if prompt_tokens > 0:
            self._per_token.add(max(0.0, seconds - self._base.value) / prompt_tokens)

    def observe_tokens(self, count: int, seconds: float) -> None:
        """``count`` tokens after the first took ``seconds`` (one finished request's decode phase).

        Args:
            count: tokens after the first.
            seconds: first token to last.
        """
        if count > 0 and seconds >= 0:
            self._token.add(seconds / count)

    def observe_length(self, generated: int, max_tokens: int) -> None:
        """A request generated ``generated`` of its ``max_tokens``.

        Args:
            generated: completion tokens.
            max_tokens: its limit.
        """
        if max_tokens > 0:
            self._used.add(min(1.0, max(0.0, generated / max_tokens)))

    # ------------------------------------------------------------------ estimates

    @property
    def token_s(self) -> float:
        """Current time per output token."""
        return self._token.value

    def prefill_s(self, prompt_tokens: int) -> float:
        """Expected time from slot grant to first token."""
        return self._base.value + self._per_token.value * prompt_tokens

    def expected_tokens(self, max_tokens: int) -> float:
        """Expected tokens generated for a limit of ``max_tokens``."""
        return max(1.0, self._used.value * max_tokens)

    def predict_ttft(self, remaining: Sequence[tuple[int, int]], ahead: Sequence[tuple[int, int]], prompt_tokens: int) -> float:
        """Seconds from now to this request's first token.

        Args:
            remaining: per running (or already started) sequence, ``(generated, max_tokens)``.
            ahead: per request queued before this one, ``(prompt_tokens, max_tokens)``.
            prompt_tokens: this request's prompt length.
        """
        tok = self._token.value
        free: list[float] = []
        for generated, max_tokens in remaining:
            left = max(0.0, self.expected_tokens(max_tokens) - generated)
            # A sequence past its expected length still needs at least one more step.
            free.append(max(left, 1.0) * tok)
        free.sort()
        slots = [0.0] * max(0, self.capacity - len(free)) + free
        slots = slots[: self.capacity] if len(slots) > self.capacity else slots
        heapq.heapify(slots)
        for p, m in ahead:
            t = heapq.heappop(slots)
            heapq.heappush(slots, t + self.prefill_s(p) + self.expected_tokens(m) * tok)
        start = slots[0] if slots else 0.0
        return self.safety * (start + self.prefill_s(prompt_tokens))
