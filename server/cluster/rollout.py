"""Rolling update with a canary and automatic rollback (sans-I/O state machine).

The shell feeds a :class:`Rollout` replica events and carries out what ``next_actions(now, stats)``
returns (start, drain, canary share, promote, done or rolled back); autoscaling pauses meanwhile.
Phases: **canary** (``canary_replicas`` of the new fingerprint get ``canary_share`` of new sessions),
**judge** (with ``min_requests`` on both versions, roll back as soon as the new one's miss or error
rate exceeds the old one's by more than the allowed delta; pass after ``observe_s``), **replace**
(``batch`` at a time, draining old replicas only while the ready count stays at the original; the
judge keeps watching) and **rollback** (the same start-before-drain rule). A replica not ready within
``start_timeout_s`` counts as failed."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "RolloutConfig",
    "VersionStats",
    "StartReplica",
    "DrainReplica",
    "SetCanaryShare",
    "Promote",
    "Done",
    "RolledBack",
    "Action",
    "RolloutPhase",
    "Rollout",
]


class RolloutConfig(BaseModel):
    """Rolling-update settings.

    Args:
        canary_replicas: new-version replicas started first and watched.
        canary_share: share of new sessions sent to them.
        observe_s: least time to watch them before passing.
        min_requests: requests each version needs before a verdict.
        max_miss_rate_delta: how much higher the new deadline-miss rate may be.
        max_error_rate_delta: how much higher the new error rate may be.
        batch: old replicas replaced per step after the canary.
        start_timeout_s: a replica not ready this long after being asked for has failed.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    canary_replicas: Annotated[int, Field(ge=1)] = 1
    canary_share: Annotated[float, Field(gt=0, le=1)] = 0.1
    observe_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 300.0
    min_requests: Annotated[int, Field(ge=1)] = 1000
    max_miss_rate_delta: Annotated[float, Field(ge=0, le=1)] = 0.01
    max_error_rate_delta: Annotated[float, Field(ge=0, le=1)] = 0.005
    batch: Annotated[int, Field(ge=1)] = 1
    start_timeout_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 600.0


@dataclasses.dataclass(frozen=True)
class VersionStats:
    """Requests served by one fingerprint since the canary started.

    Args:
        requests: requests answered.
        errors: of them, failed (``policy_failed`` and the like).
        deadline_misses: of them, late or dropped for their deadline.
    """

    requests: int = 0
    errors: int = 0
    deadline_misses: int = 0

    @property
    def miss_rate(self) -> float:
        """Deadline misses per request (0 without requests)."""
        return self.deadline_misses / self.requests if self.requests else 0.0

    @property
    def error_rate(self) -> float:
        """Errors per request (0 without requests)."""
        return self.errors / self.requests if self.requests else 0.0


@dataclasses.dataclass(frozen=True)
class StartReplica:
    """Start one replica serving ``fingerprint``; report it with ``replica_started``."""

    fingerprint: str


@dataclasses.dataclass(frozen=True)
class DrainReplica:
    """Drain ``name``: no new sessions, stop once its sessions end; report ``replica_removed``."""

    name: str


@dataclasses.dataclass(frozen=True)
class SetCanaryShare:
    """Route ``share`` of new sessions to canary replicas."""

    share: float


@dataclasses.dataclass(frozen=True)
class Promote:
    """Treat ``fingerprint`` as the stable version (its replicas are no longer canaries)."""

    fingerprint: str


@dataclasses.dataclass(frozen=True)
class Done:
    """The update finished: every replica serves the new version."""


@dataclasses.dataclass(frozen=True)
class RolledBack:
    """The update was undone: every replica serves the old version again."""

    reason: str


Action = StartReplica | DrainReplica | SetCanaryShare | Promote | Done | RolledBack


class RolloutPhase(str, enum.Enum):
    """Where the rollout is."""

    CANARY = "canary"
    REPLACING = "replacing"
    ROLLING_BACK = "rolling_back"
    DONE = "done"
    ROLLED_BACK = "rolled_back"

    def __str__(self) -> str:
        # The bare value in f-strings and logs, on every Python version.
        return self.value


class Rollout:
    """Replaces ``replicas`` (serving ``old_fingerprint``) by ones serving ``new_fingerprint``.

    Args:
        old_fingerprint: what the fleet serves now.
        new_fingerprint: what it should serve.
        replicas: the fleet's ready replicas now (all on the old version).
        config: :class:`RolloutConfig`.
    """

    def __init__(self, old_fingerprint: str, new_fingerprint: str, replicas: list[str], config: RolloutConfig) -> None:
        if old_fingerprint == new_fingerprint:
            raise ValueError("old and new fingerprints are the same")
        if not replicas or len(set(replicas)) != len(replicas):
            raise ValueError("replicas must be a non-empty list of distinct names")
        self.old = old_fingerprint
        self.new = new_fingerprint
        self.config = config
        self.original = len(replicas)
        self.phase = RolloutPhase.CANARY
        self.reason: str | None = None
        self._ready: dict[str, str] = {name: old_fingerprint for name in replicas}  # live, not draining
        self._draining: set[str] = set()
        self._starting: list[float] = []  # when each outstanding start was asked for
        self._starting_fp = new_fingerprint
        self._failed_new = False
        self._abort: str | None = None
        self._canary_since: float | None = None
        self._began = False
        self._retire: set[str] = set()  # fingerprints whose replicas must go

    # ------------------------------------------------------------------ events

    def replica_started(self, name: str, fingerprint: str, now: float) -> None:
        """A replica is up and ready, serving ``fingerprint``."""
        if fingerprint == self._starting_fp and self._starting:
            self._starting.pop(0)
        self._ready[name] = fingerprint

    def replica_failed(self, name: str, now: float) -> None:
        """A replica failed: it did not start (any name the shell gave it) or it died."""
        fp = self._ready.pop(name, None)
        self._draining.discard(name)
        if fp is None and self._starting:
            self._starting.pop(0)
            fp = self._starting_fp
        if fp == self.new:
            self._failed_new = True

    def abort(self, reason: str) -> None:
        """Roll back at the next :meth:`next_actions`, whatever the traffic shows (e.g. the shell
        sees that the new version's measured service time cannot meet the fleet's deadlines, so
        placement will never send it the traffic a verdict needs)."""
        if self._abort is None:
            self._abort = reason

    def replica_removed(self, name: str, now: float) -> None:
        """A drained replica is gone."""
        self._draining.discard(name)
        self._ready.pop(name, None)

    # ------------------------------------------------------------------ helpers

    def count(self, fingerprint: str) -> int:
        """Ready, non-draining replicas serving ``fingerprint``."""
        return sum(1 for fp in self._ready.values() if fp == fingerprint)

    @property
    def ready(self) -> int:
        """Ready, non-draining replicas of any version."""
        return len(self._ready)

    def _start(self, fingerprint: str, n: int, now: float) -> list[Action]:
        self._starting_fp = fingerprint
        self._starting.extend([now] * n)
        return [StartReplica(fingerprint) for _ in range(n)]

    def _drain(self, names: list[str]) -> list[Action]:
        for n in names:
            self._ready.pop(n, None)
            self._draining.add(n)
        return [DrainReplica(n) for n in names]

    def _timeouts(self, now: float) -> None:
        late = sum(1 for t in self._starting if now - t >= self.config.start_timeout_s)
        if late:
            del self._starting[:late]
            if self._starting_fp == self.new:
                self._failed_new = True

    def _verdict(self, stats: Mapping[str, VersionStats], now: float) -> str | bool | None:
        # str: roll back for this reason; True: passed; None: keep watching.
        cfg = self.config
        new, old = stats.get(self.new, VersionStats()), stats.get(self.old, VersionStats())
        if new.requests < cfg.min_requests or old.requests < cfg.min_requests:
            return None
        if new.miss_rate - old.miss_rate > cfg.max_miss_rate_delta:
            return f"deadline-miss rate {new.miss_rate:.4f} vs {old.miss_rate:.4f} (allowed +{cfg.max_miss_rate_delta:g})"
        if new.error_rate - old.error_rate > cfg.max_error_rate_delta:
            return f"error rate {new.error_rate:.4f} vs {old.error_rate:.4f} (allowed +{cfg.max_error_rate_delta:g})"
        assert self._canary_since is not None
        return True if now - self._canary_since >= cfg.observe_s else None

    def _replace(self, keep: str, retire: str, now: float) -> list[Action]:
        # Start-before-drain: drain only the surplus over the original count (at most what the
        # last batch of starts added), start a batch only when nothing is starting.
        acts: list[Action] = []
        old_names = sorted(n for n, fp in self._ready.items() if fp == retire)
        surplus = self.ready - self.original
        if surplus > 0 and old_names:
            acts += self._drain(old_names[:surplus])
        elif not self._starting:
            missing = self.original - self.count(keep)
            if missing > 0:
                acts += self._start(keep, min(missing, self.config.batch), now)
        return acts

    def _rollback(self, reason: str, now: float) -> list[Action]:
        self.phase = RolloutPhase.ROLLING_BACK
        self.reason = reason
        self._retire.add(self.new)
        self._starting.clear()  # starts of the new version in flight are abandoned; drained on arrival
        return [SetCanaryShare(0.0), Promote(self.old)]

    # ------------------------------------------------------------------ driver

    def next_actions(self, now: float, stats: Mapping[str, VersionStats]) -> list[Action]:
        """What the shell should do now.

        Args:
            now: the shell's clock.
            stats: per fingerprint, requests since the canary started.

        Returns:
            Actions to carry out in order (empty: nothing to do yet).
        """
        acts: list[Action] = []
        self._timeouts(now)
        if self.phase in (RolloutPhase.DONE, RolloutPhase.ROLLED_BACK):
            # A late start of a retired version is drained as soon as it shows up.
            return self._drain(sorted(n for n, fp in self._ready.items() if fp in self._retire))
        if self.phase in (RolloutPhase.CANARY, RolloutPhase.REPLACING) and self._abort is not None:
            acts += self._rollback(self._abort, now)
        elif self.phase in (RolloutPhase.CANARY, RolloutPhase.REPLACING) and self._failed_new:
            acts += self._rollback("a replica of the new version failed to start or died", now)
        if self.phase == RolloutPhase.CANARY:
            if not self._began:
                self._began = True
                acts += self._start(self.new, self.config.canary_replicas, now)
            elif self._canary_since is None and not self._starting and self.count(self.new) >= self.config.canary_replicas:
                self._canary_since = now
                acts.append(SetCanaryShare(self.config.canary_share))
            elif self._canary_since is not None:
                verdict = self._verdict(stats, now)
                if isinstance(verdict, str):
                    acts += self._rollback(verdict, now)
                elif verdict is True:
                    self.phase = RolloutPhase.REPLACING
                    self._retire.add(self.old)
                    acts += [SetCanaryShare(0.0), Promote(self.new)]
        if self.phase == RolloutPhase.REPLACING:
            verdict = self._verdict(stats, now)
            if isinstance(verdict, str):
                acts += self._rollback(verdict, now)
            else:
                acts += self._replace(self.new, self.old, now)
                if self.count(self.old) == 0 and not self._starting and self.count(self.new) >= self.original:
                    self.phase = RolloutPhase.DONE
                    acts.append(Done())
        if self.phase == RolloutPhase.ROLLING_BACK:
            self._retire.discard(self.old)
            acts += self._replace(self.old, self.new, now)
            if self.count(self.new) == 0 and not self._starting and self.count(self.old) >= self.original:
                self.phase = RolloutPhase.ROLLED_BACK
                acts.append(RolledBack(self.reason or "rolled back"))
        return acts
