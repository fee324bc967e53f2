"""What the broker core hands its shell: the request to send, the command of a tick, its counters."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..client.wire.protocol import Urgency
from ..safety.filter import Verdict
from ..safety.watchdog import FallbackReason, Mode

__all__ = ["RequestIntent", "Command", "BrokerStats"]


@dataclasses.dataclass(frozen=True, slots=True)
class RequestIntent:
    """"Send this observation with this deadline and prefix": what the shell should send.

    Args:
        request_id: the broker's id for it (pass it back in :meth:`Broker.on_sent` and in the chunk).
        observation: the observation to send (as handed to :meth:`Broker.tick`).
        obs_time: when it was taken, robot clock (the chunk's ``t0`` derives from it).
        deadline_ms: the budget: how long the robot can wait for the answer.
        prefix: ``[P, A]`` float32 actions (read-only) that will run while the request is in
            flight, or ``None``.
        created_at: the tick time that produced it.
        supersedes: the id of an unsent request this one replaces, if any.
        prefix_delay: how many of the prefix's first rows run before the answer is expected
            (frozen for a real-time-chunking policy); ``None`` without a prefix.
        urgency: when the plan runs dry, the rows the robot will run of the answer, its control
            period (the server's scheduling key); ``None`` before the first chunk.
        replaces: the id of the request in flight this one refreshes (send it as the ``infer``'s
            ``replaces``: :mod:`.refresh`), if any.
    """

    request_id: int
    observation: Mapping[str, Any]
    obs_time: float
    deadline_ms: float
    prefix: np.ndarray | None
    created_at: float
    supersedes: int | None = None
    prefix_delay: int | None = None
    urgency: Urgency | None = None
    replaces: int | None = None

    def __repr__(self) -> str:
        prefix = None if self.prefix is None else list(self.prefix.shape)
        return (f"RequestIntent(request_id={self.request_id}, obs_time={self.obs_time:.6f}, deadline_ms={self.deadline_ms:.1f}, "
                f"observation=[{', '.join(self.observation)}], prefix={prefix}, supersedes={self.supersedes}, replaces={self.replaces})")


@dataclasses.dataclass(slots=True)
class Command:
    """What one tick produced.

    Args:
        time: the tick time.
        action: the command to send to the actuators ``[A]`` (float64, read-only).
        mode: ``policy``, ``resuming`` (blending back in) or ``fallback``.
        reason: why the fallback runs (``None`` in policy mode).
        chunk_id: request id of the chunk whose action was used (``None`` in fallback).
        action_age_s: how late that action is (``now - due``).
        latency_s: measured round trip of that chunk.
        verdict: what the safety filter did with the policy action (``None`` in fallback).
        request: a request the shell should send now, if any.
        wants_observation: a request is due but no observation was given to this tick.
    """

    time: float
    action: np.ndarray
    mode: Mode
    reason: FallbackReason | None
    chunk_id: int | str | None
    action_age_s: float | None
    latency_s: float | None
    verdict: Verdict | None
    request: RequestIntent | None
    wants_observation: bool = False

    def __repr__(self) -> str:
        # Short on purpose: the request holds the whole observation, which a log line must not dump.
        action = np.array2string(np.asarray(self.action), precision=3, threshold=8, max_line_width=10_000)
        request = "None" if self.request is None else f"#{self.request.request_id}"
        reason = None if self.reason is None else getattr(self.reason, "value", self.reason)
        mode = getattr(self.mode, "value", self.mode)
        return (f"Command(time={self.time:.6f}, mode={mode}, reason={reason}, chunk_id={self.chunk_id!r}, "
                f"action={action}, request={request})")


@dataclasses.dataclass
class BrokerStats:
    """Counters of the broker core (mutable, updated in place).

    One counter per key of the broker's stats report; counters only, no behaviour, so they stay
    flat.
    """

    ticks: int = 0
    chunks_received: int = 0
    chunks_merged: int = 0
    chunks_late: int = 0
    chunks_expired: int = 0
    chunks_out_of_order: int = 0
    requests_issued: int = 0
    requests_superseded: int = 0
    requests_sent: int = 0
    requests_timed_out: int = 0
    errors: int = 0
    disconnects: int = 0
    #: chunks whose action was too far from the held command to hand back to the policy, and the
    #: fallback ticks that caused (the command's reason reads ``unreachable`` then)
    chunks_unreachable: int = 0
    unreachable_ticks: int = 0
    #: chunks refused because their switch needed a cross-fade longer than ``max_switch_steps``,
    #: and chunks cross-faded in (their switch was beyond a jump within the limits)
    chunks_far: int = 0
    chunks_faded: int = 0
    #: chunks joined along a catch-up path instead (their cross-fade would have been too long, or
    #: they were too far while the plan would run dry before a fresh answer)
    chunks_joined: int = 0
    #: ``rtc``: chunks that arrived after the rows frozen for them had run (their switch is
    #: cross-faded, since the policy did not plan that part to agree with the plan)
    rtc_late: int = 0
    #: ``rtc``: chunks on time that took over at the end of their frozen rows, not at once (another
    #: chunk had changed the plan since their request took its prefix)
    rtc_deferred: int = 0
    #: chunks re-anchored to start at once from their first row (the robot held still since the
    #: observation they answer)
    chunks_resumed: int = 0
    #: requests sent as a fresher observation in place of the one in flight (:mod:`.refresh`),
    #: and those the server answered ``replace_missed`` (the one in flight already ran)
    requests_refreshed: int = 0
    refreshes_missed: int = 0
    last_error_code: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The counters as a plain dict."""
        return dataclasses.asdict(self)
