"""When to start the next batch (sans-I/O): gather robots' requests into one forward pass without
putting the earliest deadline at risk.

A free lane runs a batch at once when the queue is full, when the oldest request has waited
``max_batch_wait``, when waiting longer would miss the earliest deadline, when no other request is
expected within the wait, or when a bigger batch would cost no less per request (predicted times,
plus the per-batch hand-off). Waiting only ever happens on an idle lane with a small queue: while
lanes are busy requests accumulate on their own. :class:`ArrivalTracker` supplies the arrivals
that could still join a batch: a robot waiting for its own reply will not send again.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["ArrivalRate", "ArrivalTracker", "BatchPolicy", "dispatch_time", "stackable", "STOPPED_AFTER_GAPS"]

#: A session quiet for this many of its usual reply-to-next-request times has stopped: a robot in
#: closed loop sends a steady time after each reply, and waiting for one that has moved on costs
#: every request queued meanwhile up to ``max_batch_wait``.
STOPPED_AFTER_GAPS = 2.0


@dataclasses.dataclass(frozen=True)
class BatchPolicy:
    """Batching settings of one model.

    Args:
        max_batch_size: most requests in one forward pass (1 disables batching).
        max_batch_wait: seconds the oldest request may wait for others to join.
        margin: seconds kept free before the earliest deadline (scheduling and reply jitter).
    """

    max_batch_size: int = 16
    max_batch_wait: float = 0.002
    margin: float = 0.001

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.max_batch_wait < 0 or self.margin < 0:
            raise ValueError("need max_batch_size >= 1, max_batch_wait >= 0, margin >= 0")

    @property
    def rate_worth_waiting(self) -> float:
        """Arrivals per second from which waiting for company may pay: one expected within ``max_batch_wait``."""
        return math.inf if self.max_batch_wait == 0 else 1.0 / self.max_batch_wait


class ArrivalRate:
    """Moving estimate of the arrival rate (requests per second) from inter-arrival times.

    Args:
        alpha: weight of the newest inter-arrival time in the moving average.
    """

    def __init__(self, alpha: float = 0.1) -> None:
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = alpha
        self._last: float | None = None
        self._gap: float | None = None

    @property
    def last_arrival(self) -> float:
        """When the latest arrival was (``-inf``: none yet)."""
        return -math.inf if self._last is None else self._last

    def observe(self, now: float) -> None:
        """Record an arrival at ``now``."""
        if self._last is not None:
            gap = now - self._last if now > self._last else 0.0  # (compared, not max(): once per request)
            self._gap = gap if self._gap is None else (1 - self.alpha) * self._gap + self.alpha * gap
        self._last = now

    def rate(self, now: float) -> float:
        """Arrivals per second; a long silence since the last arrival lowers it at once."""
        if self._gap is None or self._last is None:
            return 0.0
        gap = max(self._gap, now - self._last)
        return math.inf if gap == 0 else 1.0 / gap


@dataclasses.dataclass(slots=True)
class _Robot:
    """One session's arrivals: its own rate, how many of its requests are unanswered, and (a
    closed-loop robot's rhythm) how long it usually takes from a reply to its next request."""

    rate: ArrivalRate
    pending: int = 0
    #: when its last request was answered (``-inf``: never)
    idle_since: float = -math.inf
    #: moving average of the time from a reply to its next request (``None``: not seen yet)
    reply_gap: float | None = None


class ArrivalTracker:
    """The arrivals one model's batching rule reads: who could still send (each session at its
    own rate), and the window of requests queued since the queue was last empty.

    Arrivals that could join a batch come only from sessions with nothing pending (a robot
    waiting for its own reply will not send again), each at its own rate, lowered by its
    silence: a session that went quiet adds little however busy the others are. A session quiet
    for ``stopped_after`` times its usual reply-to-next-request time has stopped and adds nothing
    (a closed-loop robot sends its next request a steady time after each reply).

    Args:
        clock: the time answers are stamped with (the runner's clock).
        forget_after_s: a session silent this long with nothing pending is forgotten.
        stopped_after: how many of its usual reply-to-next-request times a session may be
            quiet and still be expected to send.
    """

    def __init__(self, clock: Callable[[], float], forget_after_s: float = 2.0,
                 stopped_after: float = STOPPED_AFTER_GAPS) -> None:
        self.forget_after_s = forget_after_s
        self.stopped_after = stopped_after
        self._clock = clock
        #: when the latest request was admitted (``-inf``: none yet)
        self.last_arrival = -math.inf
        #: when the oldest request queued since the queue was empty arrived (a conservative bound)
        self.window_start = math.inf
        #: the earliest deadline offered since the queue was empty
        self.window_deadline = math.inf
        self._robots: dict[str, _Robot] = {}
        #: the sessions with nothing pending, the latest to become so last
        self._idle: dict[str, _Robot] = {}
        self._pruned_at = 0.0

    @property
    def waiting(self) -> int:
        """Sessions waiting for a reply (with a request admitted and not answered yet)."""
        return len(self._robots) - len(self._idle)

    @property
    def idle(self) -> int:
        """Sessions known to the tracker with nothing pending (they could send)."""
        return len(self._idle)

    def admitted(self, session: str, deadline: float, now: float) -> None:
        """A request of ``session`` was admitted at ``now``: it is pending until :meth:`answered`."""
        robot = self._robots.get(session)
        if robot is None:
            robot = self._robots[session] = _Robot(ArrivalRate(alpha=0.25))
        elif robot.pending == 0:
            del self._idle[session]
            gap = now - robot.idle_since if now > robot.idle_since else 0.0
            robot.reply_gap = gap if robot.reply_gap is None else 0.75 * robot.reply_gap + 0.25 * gap
        robot.pending += 1
        robot.rate.observe(now)
        self.last_arrival = now
        if now - self._pruned_at > 1.0:
            self._prune(now)
        if now < self.window_start:
            self.window_start = now
        if deadline < self.window_deadline:
            self.window_deadline = deadline

    def answered(self, session: str) -> None:
        """A request :meth:`admitted` was answered (any outcome). A session :meth:`forget` has dropped is ignored."""
        robot = self._robots.get(session)
        if robot is None or robot.pending == 0:
            return
        robot.pending -= 1
        if robot.pending == 0:
            robot.idle_since = self._clock()
            self._idle[session] = robot

    def forget(self, session: str) -> None:
        """The session ended: it sends nothing more."""
        self._robots.pop(session, None)
        self._idle.pop(session, None)

    def queue_emptied(self) -> None:
        """Nothing is queued any more: the next request opens a new window."""
        self.window_start = self.window_deadline = math.inf

    def expected_rate(self, now: float, enough: float = math.inf) -> float:
        """Arrivals per second that could still join a batch: the sum of the idle sessions'
        own rates (the latest to become idle first), leaving out those that have stopped. The sum
        stops once it reaches ``enough``."""
        total = 0.0
        stopped_after = self.stopped_after
        for robot in reversed(self._idle.values()):
            gap = robot.reply_gap
            if gap is not None and now - robot.idle_since > stopped_after * gap:
                continue
            total += robot.rate.rate(now)
            if total >= enough:
                break
        return total

    def stops_at(self, now: float) -> float:
        """When the next idle session still expected now will be judged stopped (``inf``: none
        will): a wait for company is worth judging again then."""
        at = math.inf
        stopped_after = self.stopped_after
        for robot in self._idle.values():
            gap = robot.reply_gap
            if gap is not None and now < (stops := robot.idle_since + stopped_after * gap) < at:
                at = stops
        return at

    def _prune(self, now: float) -> None:
        # An O(sessions) walk once a second rather than at every dispatch decision.
        self._pruned_at = now
        gone = [s for s, r in self._idle.items() if now - r.rate.last_arrival >= self.forget_after_s]
        for session in gone:
            self.forget(session)


def dispatch_time(
    now: float,
    *,
    queued: int,
    oldest_arrival: float,
    earliest_deadline: float,
    policy: BatchPolicy,
    predict: Callable[[int], float],
    arrival_rate: float = math.inf,
    per_batch: float = 0.0,
) -> float:
    """The time at which a free lane should take the next batch (``now`` or later; ``inf`` when
    nothing is queued).

    Args:
        now: current time.
        queued: requests waiting.
        oldest_arrival: when the oldest of them was queued.
        earliest_deadline: the earliest deadline among them.
        policy: the model's batching settings.
        predict: predicted service time (seconds) of a batch of the given size.
        arrival_rate: requests per second expected; below one per ``max_batch_wait`` there is
            nothing to wait for.
        per_batch: seconds every batch costs besides its run (a lane's hand-off), which a
            bigger batch shares among more requests.
    """
    if queued <= 0:
        return math.inf
    if queued >= policy.max_batch_size or policy.max_batch_wait == 0:
        return now
    if arrival_rate < policy.rate_worth_waiting:
        return now
    bigger = min(policy.max_batch_size, queued + 1)
    current = predict(queued)
    if current > 0 and (predict(bigger) + per_batch) * queued >= (current + per_batch) * bigger:
        return now  # a batch time that grows as fast as its size gains nothing from waiting
    by_wait = oldest_arrival + policy.max_batch_wait
    by_deadline = earliest_deadline - predict(min(policy.max_batch_size, queued + 1)) - policy.margin
    return max(now, min(by_wait, by_deadline))


def stackable(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two observations stack into one batch: every field either has (optional ones
    included) has the same shape in both, or is absent from both (a loop, not ``all()`` over a
    generator: it runs once per request joining a batch)."""
    for k in a.keys() | b.keys():
        if getattr(a.get(k), "shape", None) != getattr(b.get(k), "shape", None):
            return False
    return True
