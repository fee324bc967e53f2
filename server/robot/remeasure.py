"""Re-measuring a batch of one while a model is idle and refusing for the deadline.

Admission learns service times only from batches that run: after a slow spell its estimates stay
high, every request is refused and nothing would show the spell is over. So while the runner is
idle and refusing, at most once per :attr:`IdleRemeasure.interval_s`, one example batch of one
runs on an idle lane and its time becomes a service sample.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable

from chunkline.policies.base import Policy
from chunkline.server.core.admission import ServiceTimeModel
from chunkline.server.errors import Refusal
from chunkline.server.robot.lanes import LanePool, probe_pass

__all__ = ["IdleRemeasure"]

log = logging.getLogger("chunkline.server")


class IdleRemeasure:
    """One model's re-measurement: when one may start, the one in flight, and what a refusal
    says while it runs. Lives on the event loop (its lane hands the result back there).

    Args:
        name: the model's name (for the log).
        policy: the loaded policy (one example pass on a lane).
        service: the service-time model the sample feeds.
        lanes: the model's lanes; an idle one runs the pass and stays listed as idle, so a batch
            the scheduler sends there queues behind it.
        clock: the runner's clock.
    """

    __slots__ = ("_clock", "_lanes", "_name", "_policy", "_service", "future", "interval_s", "last_sample")

    def __init__(self, name: str, policy: Policy, service: ServiceTimeModel, lanes: LanePool,
                 clock: Callable[[], float]) -> None:
        self._name = name
        self._policy = policy
        self._service = service
        self._lanes = lanes
        self._clock = clock
        #: at most one re-measurement per this many seconds since the last service sample
        self.interval_s = 1.0
        #: when the last service sample came (a batch's or a re-measurement's); none yet: the first
        #: idle refusal may re-measure
        self.last_sample = -math.inf
        #: the re-measurement in flight (its result: the seconds a batch of one took), if any
        self.future: asyncio.Future[float] | None = None

    def start_if_due(self, now: float) -> None:
        """Start one if none runs, a lane is idle and the last sample is ``interval_s`` old.
        The caller has checked that the model is idle (nothing queued or running, no timing pass)."""
        if self.future is not None or not self._lanes.idle or now - self.last_sample < self.interval_s:
            return
        future: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self.future = future
        self.last_sample = now
        submitted = self._clock()

        def done(seconds: float, exc: BaseException | None) -> None:
            self.future = None
            self.last_sample = self._clock()
            if exc is not None:
                log.warning("policy %s: service re-measurement failed: %s", self._name, exc)
                future.set_exception(exc)
                return
            self._service.observe(1, seconds)
            self._service.observe_handoff(self.last_sample - submitted - seconds)
            log.info("policy %s: idle and refusing; re-measured a batch of one: %.1f ms", self._name, seconds * 1e3)
            future.set_result(seconds)

        self._lanes.submit(self._lanes.idle[0], probe_pass, (self._policy,), done)

    def refusal(self, decision: Refusal) -> Refusal:
        """``decision`` (refused for the deadline, no retry time) as said while one runs: the
        estimate may be stale, so retry after a batch of one's time (at most ``interval_s``)."""
        t = self._service.occupancy(1) * 1000.0  # ms
        return Refusal(decision.code, f"{decision.message}; re-measuring ({t:.0f} ms alone)",
                       max(1.0, min(t, 1e3 * self.interval_s)))
