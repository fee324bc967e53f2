"""Choosing a replica for a new session (sans-I/O).

The directory keeps one :class:`Placement`. Replicas report a :class:`ReplicaState` every second
or so (the shell calls :meth:`Placement.update`); at each handshake the directory calls
:meth:`Placement.place` and redirects the robot to the chosen replica, or refuses.

A replica's capacity comes from its own measured service curve (:func:`capacity_rps`), so a
replica on a faster GPU, or with more lanes, is planned for more. Its spare capacity is that
capacity minus the load it reports minus the sessions placed on it that its reports do not show
yet (a robot takes a moment to follow the redirect; without this, a burst of handshakes between
two reports would all land on the same "emptiest" replica).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import enum
import math
from collections.abc import Mapping

__all__ = [
    "ReplicaState",
    "SessionRequest",
    "PlacementDecision",
    "RefusalReason",
    "PlacementRefusal",
    "Placement",
    "service_time",
    "capacity_rps",
]


@dataclasses.dataclass
class ReplicaState:
    """What a replica reports about itself.

    Args:
        name: unique replica name.
        uri: where robots connect (``ws://host:port``).
        fingerprint: the served policy build (weights + code) fingerprint.
        models: the model names it serves.
        aliases: a served policy's own name -> the model name it is served under (known once loaded).
        service_s: measured seconds per forward pass by batch size (``ServiceTimeModel``'s
            planning estimates).
        max_batch_size: most requests per forward pass.
        lanes: forward passes that can run at the same time.
        sessions: sessions open on it now.
        load_rps: requests per second it receives now.
        queue_wait_p99_s: recent p99 of queue wait.
        deadline_miss_rate: recent fraction of requests that missed their deadline.
        ready: warmed up and accepting sessions.
        draining: finishing its sessions; takes no new ones.
        updated: when the state was reported (the directory's clock).
        canary: runs a version under evaluation (:mod:`~chunkline.server.cluster.rollout`).
    """

    name: str
    uri: str
    fingerprint: str
    models: frozenset[str]
    service_s: Mapping[int, float]
    max_batch_size: int = 1
    lanes: int = 1
    sessions: int = 0
    load_rps: float = 0.0
    queue_wait_p99_s: float = 0.0
    deadline_miss_rate: float = 0.0
    ready: bool = True
    draining: bool = False
    updated: float = 0.0
    canary: bool = False
    aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class SessionRequest:
    """A robot asking for a session.

    Args:
        tenant: the authenticated tenant.
        model: the model it wants; ``None`` accepts any replica (the fleet's default model).
        rate_hz: how often it will send requests.
        deadline_s: the deadline budget of its requests.
    """

    tenant: str
    model: str | None = None
    rate_hz: float = 10.0
    deadline_s: float = 0.1

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rate_hz) and self.rate_hz >= 0):
            raise ValueError("rate_hz must be finite and non-negative")
        if not (math.isfinite(self.deadline_s) and self.deadline_s > 0):
            raise ValueError("deadline_s must be finite and positive")


@dataclasses.dataclass(frozen=True)
class PlacementDecision:
    """Where the session goes.

    Args:
        replica: the chosen replica's name.
        uri: its URI.
        canary: whether it is a canary.
        sticky: kept on the replica the robot was on.
        spare_rps: spare capacity left there after this session.
        rate_hz: the session's request rate, as counted against the replica.
    """

    replica: str
    uri: str
    canary: bool
    sticky: bool
    spare_rps: float
    rate_hz: float = 0.0


class RefusalReason(str, enum.Enum):
    """Why no replica was chosen (stable strings)."""

    NO_REPLICA = "no_replica"
    NO_CAPACITY = "no_capacity"

    def __str__(self) -> str:
        # The bare value in f-strings and logs, on every Python version.
        return self.value


@dataclasses.dataclass(frozen=True)
class PlacementRefusal:
    """No replica can take the session now.

    Args:
        reason: :class:`RefusalReason`.
        message: for the client.
        retry_after_ms: when to try again.
    """

    reason: RefusalReason
    message: str
    retry_after_ms: int


def service_time(service_s: Mapping[int, float], batch_size: int) -> float:
    """Seconds a forward pass of ``batch_size`` takes, from a measured curve.

    Between measured sizes: linear interpolation. Below the smallest: the smallest's time (a
    smaller batch is not slower). Above the largest: the larger of proportional extrapolation
    (no more gain from batching) and extrapolation along the last segment (the curve steepening),
    so an unmeasured size is never planned as cheaper than either would predict.

    Args:
        service_s: batch size to seconds (at least one entry).
        batch_size: the size asked about (>= 1).
    """
    sizes = sorted(b for b in service_s if b >= 1)
    if not sizes:
        raise ValueError("empty service curve")
    return _service_time(service_s, sizes, batch_size)


def _service_time(service_s: Mapping[int, float], sizes: list[int], batch_size: int) -> float:
    i = bisect.bisect_left(sizes, batch_size)
    if i < len(sizes) and sizes[i] == batch_size:
        return float(service_s[batch_size])
    if i == 0:
        return float(service_s[sizes[0]])
    hi = sizes[-1]
    if i == len(sizes):
        proportional = service_s[hi] * batch_size / hi
        if len(sizes) == 1:
            return float(proportional)
        lo = sizes[-2]
        slope = (service_s[hi] - service_s[lo]) / (hi - lo)
        return float(max(proportional, service_s[hi] + slope * (batch_size - hi)))
    lo, hi = sizes[i - 1], sizes[i]
    f = (batch_size - lo) / (hi - lo)
    return float(service_s[lo] + f * (service_s[hi] - service_s[lo]))


def capacity_rps(state: ReplicaState, deadline_s: float, utilisation: float = 0.8) -> float:
    """The request rate ``state``'s replica sustains when each request must finish in ``deadline_s``.

    Model: under load a request arrives while a batch runs, waits for it, then runs in the next
    batch, so it finishes within about two service times. The replica can therefore use the
    largest batch size ``b <= max_batch_size`` with ``2 * service(b) <= deadline_s``
    (:func:`service_time` fills in unmeasured sizes cautiously) and then completes
    ``lanes * b / service(b)`` requests per second. Only ``utilisation`` of that is planned, since
    queues (and deadline misses) grow without bound as a server nears 100% busy.

    Args:
        state: the replica.
        deadline_s: the requests' deadline budget.
        utilisation: the fraction of the raw rate to plan for, in (0, 1].

    Returns:
        Requests per second; 0 when even a batch of one does not fit the deadline or the replica
        has reported no service curve yet.
    """
    if not (0 < utilisation <= 1):
        raise ValueError("utilisation must be in (0, 1]")
    curve = {int(b): float(s) for b, s in state.service_s.items() if b >= 1 and math.isfinite(s) and s > 0}
    if not curve or state.lanes < 1 or not deadline_s > 0:
        return 0.0
    sizes = sorted(curve)
    # Measured curves are noisy and need not be monotone, so scan down rather than bisect.
    for b in range(max(1, state.max_batch_size), 0, -1):
        s = _service_time(curve, sizes, b)
        if 2.0 * s <= deadline_s:
            return utilisation * state.lanes * b / s
    return 0.0


@dataclasses.dataclass
class _Pending:
    replica: str
    rate: float
    placed: float


class Placement:
    """Picks replicas for new sessions.

    Eligible replicas are ready, not draining, reported within ``stale_after_s`` and serving the
    requested model. Among those with room for the session's rate, the one with the lowest
    utilisation afterwards wins (ties: by name). Canary replicas get new sessions only on the turns
    that :meth:`set_canary_share` gives them (a deterministic counter, not a coin); otherwise they
    are a last resort when no stable replica has room.

    Args:
        stale_after_s: a replica not heard from for longer is not used.
        headroom: fraction of each replica's raw capacity that is planned (``utilisation`` of
            :func:`capacity_rps`).
        pending_timeout_s: how long a placed session counts against its replica before the
            replica's reports show it (a robot that never connects stops counting then).
        retry_after_ms: what a ``no_capacity`` refusal tells the robot.
        session_rate_hz: the rate an open session is assumed to ask at, at least (its load may
            not show yet); 0 trusts the measured load alone.
    """

    def __init__(
        self,
        stale_after_s: float = 5.0,
        headroom: float = 0.8,
        *,
        pending_timeout_s: float = 10.0,
        retry_after_ms: int = 1000,
        session_rate_hz: float = 0.0,
    ) -> None:
        if not (0 < headroom <= 1) or stale_after_s <= 0 or pending_timeout_s <= 0 or retry_after_ms < 0:
            raise ValueError("headroom in (0, 1], positive stale_after_s and pending_timeout_s, retry_after_ms >= 0")
        self.stale_after_s = stale_after_s
        self.headroom = headroom
        self.pending_timeout_s = pending_timeout_s
        self.retry_after_ms = retry_after_ms
        self.session_rate_hz = session_rate_hz
        self._states: dict[str, ReplicaState] = {}
        # Capacity depends only on a report and a deadline, and robots share a few deadlines:
        # cache it per report so that a placement costs a dict lookup per replica, not a scan.
        self._capacity: dict[tuple[str, float], float] = {}
        # Per replica, placements not yet in its reports, oldest first, with their rates' sum.
        self._pending: dict[str, collections.deque[_Pending]] = {}
        self._pending_sum: dict[str, float] = {}
        self._share = 0.0
        self._new = 0  # new sessions since the share was set

    @property
    def replicas(self) -> Mapping[str, ReplicaState]:
        """The latest state of each known replica (a copy)."""
        return dict(self._states)

    def update(self, state: ReplicaState) -> None:
        """Take a replica's report. An older report than the one held is ignored (reordering)."""
        old = self._states.get(state.name)
        if old is not None and state.updated < old.updated:
            return
        pending = self._pending.get(state.name)
        if old is not None and pending:
            # Sessions that appeared since the last report are (most likely) the oldest
            # placements arriving; departures can hide arrivals, which only over-counts until
            # the timeout, the cautious direction.
            for _ in range(min(len(pending), max(0, state.sessions - old.sessions))):
                self._pending_sum[state.name] -= pending.popleft().rate
        self._states[state.name] = state
        self._forget_capacity(state.name)

    def _forget_capacity(self, name: str) -> None:
        for key in [k for k in self._capacity if k[0] == name]:
            del self._capacity[key]

    def remove(self, name: str) -> None:
        """Forget a replica (gone or shut down)."""
        self._states.pop(name, None)
        self._pending.pop(name, None)
        self._pending_sum.pop(name, None)
        self._forget_capacity(name)

    def set_canary_share(self, fraction: float) -> None:
        """Route ``fraction`` of new sessions to canary replicas from now on (0 stops it)."""
        if not (0.0 <= fraction <= 1.0):
            raise ValueError("canary share must be in [0, 1]")
        self._share = float(fraction)
        self._new = 0

    @property
    def canary_share(self) -> float:
        """The share in force."""
        return self._share

    def pending_rps(self, name: str, now: float) -> float:
        """Request rate of sessions placed on ``name`` that its reports do not show yet."""
        entries = self._pending.get(name)
        if not entries:
            return 0.0
        while entries and now - entries[0].placed >= self.pending_timeout_s:
            self._pending_sum[name] -= entries.popleft().rate
        if not entries:
            self._pending_sum[name] = 0.0  # no drift of the running sum survives an empty queue
        return max(0.0, self._pending_sum[name])

    def spare_rps(self, name: str, deadline_s: float, now: float) -> float:
        """Planned capacity of ``name`` minus its load and pending sessions (may be negative)."""
        st = self._states[name]
        # A connected robot that has not started asking yet still has its rate coming: count
        # each open session at least at the nominal rate, the measured load when it is higher.
        load = max(st.load_rps, st.sessions * self.session_rate_hz)
        return self._planned(name, deadline_s) - load - self.pending_rps(name, now)

    def _planned(self, name: str, deadline_s: float) -> float:
        cap = self._capacity.get((name, deadline_s))
        if cap is None:
            cap = self._capacity[(name, deadline_s)] = capacity_rps(self._states[name], deadline_s, self.headroom)
        return cap

    def _eligible(self, st: ReplicaState, model: str | None, now: float) -> bool:
        return (
            st.ready
            and not st.draining
            and 0.0 <= now - st.updated <= self.stale_after_s
            and (model is None or model in st.models)
        )

    def _canary_turn(self) -> bool:
        # Turn n goes to the canaries when floor(share * n) steps up: over any prefix of new
        # sessions the canary turns are floor(share * n), within one of the exact share.
        n = self._new + 1
        return math.floor(self._share * n) > math.floor(self._share * (n - 1))

    def place(self, req: SessionRequest, now: float, prefer: str | None = None) -> PlacementDecision | PlacementRefusal:
        """Choose a replica for ``req`` and count the session against it.

        Args:
            req: the session asked for.
            now: the directory's clock (same as the reports' ``updated``).
            prefer: the replica the robot was on; kept when still eligible and with room (a
                reconnect, not a new session: it does not take a canary turn).

        Returns:
            A :class:`PlacementDecision`, or a :class:`PlacementRefusal` (``no_replica``: none
            eligible; ``no_capacity``: none with room).
        """
        eligible = sorted((s for s in self._states.values() if self._eligible(s, req.model, now)), key=lambda s: s.name)
        if not eligible:
            what = f"model {req.model!r}" if req.model is not None else "sessions"
            return PlacementRefusal(RefusalReason.NO_REPLICA, f"no replica is ready for {what}", self.retry_after_ms)
        after = {s.name: self.spare_rps(s.name, req.deadline_s, now) - req.rate_hz for s in eligible}
        roomy = [s for s in eligible if after[s.name] >= 0.0]
        if not roomy:
            return PlacementRefusal(
                RefusalReason.NO_CAPACITY,
                f"no replica has room for {req.rate_hz:g} more requests/s within {req.deadline_s * 1e3:g} ms",
                self.retry_after_ms,
            )
        if prefer is not None:
            for s in roomy:
                if s.name == prefer:
                    return self._commit(s, req, now, after[s.name], sticky=True)
        canaries = [s for s in roomy if s.canary]
        stable = [s for s in roomy if not s.canary]
        pool = canaries if (self._canary_turn() and canaries) or not stable else stable
        self._new += 1
        # The least utilised afterwards wins: sessions spread in proportion to capacity (a replica
        # twice as fast takes twice the robots), where "most spare requests/s" would pile every
        # session onto the faster one until their absolute spare rates met.
        def utilisation(st: ReplicaState) -> float:
            cap = self._planned(st.name, req.deadline_s)
            return (cap - after[st.name]) / cap if cap > 0 else math.inf

        best = pool[0]
        for s in pool[1:]:  # pool is in name order, so ties go to the smallest name
            if utilisation(s) < utilisation(best):
                best = s
        return self._commit(best, req, now, after[best.name], sticky=False)

    def _commit(self, st: ReplicaState, req: SessionRequest, now: float, spare: float, sticky: bool) -> PlacementDecision:
        self._pending.setdefault(st.name, collections.deque()).append(_Pending(st.name, req.rate_hz, now))
        self._pending_sum[st.name] = self._pending_sum.get(st.name, 0.0) + req.rate_hz
        return PlacementDecision(st.name, st.uri, st.canary, sticky, spare, req.rate_hz)

    def cancel(self, decision: PlacementDecision) -> None:
        """Take back a placement that was never handed to the robot (e.g. a quota refused it
        after :meth:`place`), so its rate stops counting against the replica."""
        entries = self._pending.get(decision.replica)
        if not entries:
            return
        for i in range(len(entries) - 1, -1, -1):
            if entries[i].rate == decision.rate_hz:
                del entries[i]
                self._pending_sum[decision.replica] -= decision.rate_hz
                return
