"""Capped exponential backoff with jitter, as a pure object (the caller sleeps)."""

from __future__ import annotations

import dataclasses
import random

__all__ = ["Backoff"]


@dataclasses.dataclass
class Backoff:
    """Delays between reconnection attempts: ``initial * factor**n``, capped at ``maximum``,
    each scaled by a random factor in ``[1 - jitter, 1]`` so a fleet that lost its server does
    not reconnect in lockstep.

    Args:
        initial: first delay, seconds.
        maximum: cap, seconds.
        factor: growth per failed attempt.
        jitter: fraction of each delay that is randomised (0 disables).
        rng: the random source (inject a seeded one in tests).
    """

    initial: float = 0.05
    maximum: float = 5.0
    factor: float = 2.0
    jitter: float = 0.5
    rng: random.Random = dataclasses.field(default_factory=random.Random)
    attempts: int = 0

    def __post_init__(self) -> None:
        if not (0 < self.initial <= self.maximum) or self.factor < 1 or not (0 <= self.jitter <= 1):
            raise ValueError("need 0 < initial <= maximum, factor >= 1, 0 <= jitter <= 1")

    def next_delay(self) -> float:
        """The delay before the next attempt; counts the attempt."""
        base = min(self.maximum, self.initial * self.factor ** min(self.attempts, 64))
        self.attempts += 1
        return base * (1.0 - self.jitter * self.rng.random())

    def reset(self) -> None:
        """Call after a successful connection."""
        self.attempts = 0
