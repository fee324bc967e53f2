"""What one closed-loop episode measured, the same way in both modes.

Per tick, :class:`EpisodeMeter` takes the strategy's :class:`~.strategies.Step` and the task's
error and counts:

* **stale actions executed**: policy actions run more than ``tolerance_s`` (one control
  period, the broker's default tolerance) after their due time ``t0 + k dt``;
* **limit violations**: ticks whose command stream (the command sent, or the last one held
  when none was sent) breaks a position, velocity or acceleration limit of the robot, checked
  with :meth:`~chunkline.safety.Limits.step_violations` against the commands before it;
* time per source: policy, resuming, fallback (chunkline's verified fallback) and hold (no
  command: the servo keeps the last target);

and optionally keeps a per-tick timeline for plots.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from chunkline.safety.limits import Limits, MotionState

from .strategies import Step
from .tasks import TaskOutcome

__all__ = ["EpisodeResult", "EpisodeMeter", "SOURCES"]

#: tick sources, in the order timelines colour them.
SOURCES = ("policy", "resuming", "fallback", "hold")
#: the sources whose commands follow chunks
_FOLLOWING = ("policy", "resuming")


@dataclasses.dataclass
class EpisodeResult:
    """One episode: the task's outcome and the execution counters.

    One field per column of the episode table the suites write.

    Args:
        task: the task's name.
        strategy: the strategy's name.
        mode: ``des`` (discrete-event) or ``realtime``.
        label: the network conditions' label.
        seed: the episode's seed.
        success: the task's success criterion.
        score: the task's continuous score (m; lower is better).
        ticks: control ticks.
        period_s: the control period.
        policy_ticks / resuming_ticks / fallback_ticks / hold_ticks: ticks per source.
        stale_actions: policy actions executed later than the tolerance.
        max_action_age_s: the oldest action executed (NaN if none).
        violation_ticks: ticks whose command broke a limit; ``violations`` by kind.
        interventions: commands the chunkline safety filter changed (0 for the others).
        requests / chunks / errors: requests sent, chunks received, failed requests.
        details: task-specific figures and strategy counters.
        timeline: per-tick arrays when kept (``t``, ``error``, ``source``, ``age``, ``stale``,
            ``violation``, ``valid_until``).
    """

    task: str
    strategy: str
    mode: str
    label: str
    seed: int
    success: bool
    score: float
    ticks: int
    period_s: float
    policy_ticks: int
    resuming_ticks: int
    fallback_ticks: int
    hold_ticks: int
    stale_actions: int
    max_action_age_s: float
    violation_ticks: int
    violations: dict[str, int]
    interventions: int
    requests: int
    chunks: int
    errors: int
    details: dict[str, Any]
    timeline: dict[str, np.ndarray] | None = None
    #: at chunk switches (a policy tick whose action comes from another chunk than the previous
    #: policy tick's): the largest step of the command (max over joints) and the largest jump in
    #: acceleration it made (its acceleration less the tick before's: a smooth hand-over changes
    #: the acceleration no more than the plan itself does from one tick to the next)
    switch_jump_max: float = 0.0
    switch_accel_jump_max: float = 0.0
    #: from a change in the scene (``Task.scene_changes``) to the first executed action of a
    #: chunk asked with an observation taken after it (NaN: no change, or none followed)
    reaction_s: float = math.nan

    @property
    def fallback_s(self) -> float:
        """Seconds on chunkline's fallback."""
        return self.fallback_ticks * self.period_s

    @property
    def hold_s(self) -> float:
        """Seconds without a command (sync blocked, index queue empty)."""
        return self.hold_ticks * self.period_s

    def as_dict(self) -> dict[str, Any]:
        """A flat record (no timeline) for ``results.jsonl``."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if k != "timeline"}
        out["fallback_s"] = self.fallback_s
        out["hold_s"] = self.hold_s
        return out


class EpisodeMeter:
    """Counts one episode, tick by tick.

    One counter per field of the episode's result, updated each tick.

    Args:
        limits: the robot's limits (commands are checked against them).
        initial_position: the robot's first command state.
        tolerance_s: an action later than this after its due time is stale.
        keep_timeline: keep per-tick arrays.
        scene_changes: episode times at which the scene changed (for the reaction time).
        switches_from_s: chunk switches are measured from this time on (after the start-up,
            where the first chunks take over from a standstill).
        hand_back_ticks: the ticks of the broker's resume ramp (``resume_steps``): chunk switches
            within them after a fallback are the hand-back's business, not a boundary between
            two chunks. A switch after them counts while the command follows chunks, the resume's
            chase of a plan that moved on included (the watchdog reads ``resuming`` until the
            command is on the plan).
    """

    def __init__(self, limits: Limits, initial_position: np.ndarray, *, tolerance_s: float | None = None,
                 keep_timeline: bool = False, scene_changes: tuple[float, ...] = (), switches_from_s: float = 0.0,
                 hand_back_ticks: int = 0) -> None:
        self.limits = limits
        self.state = MotionState.at_rest(initial_position)
        self.tolerance_s = limits.dt if tolerance_s is None else tolerance_s
        self.keep = keep_timeline
        self.counts = {s: 0 for s in SOURCES}
        self.stale = 0
        self.max_age = -math.inf
        self.violation_ticks = 0
        self.violations: dict[str, int] = {}
        self.ticks = 0
        self.switch_jump = 0.0
        self.switch_accel_jump = 0.0
        self._accel = np.zeros_like(self.state.position)  # the last command's acceleration
        self._prev_chunk: int | str | None = None
        self._prev_source = ""
        self._hand_back = hand_back_ticks
        self._following = hand_back_ticks  # ticks since the last fallback tick (none yet: no ramp to skip)
        self._switches_from = switches_from_s
        self._obs_time: dict[int | str, float] = {}
        self._changes = sorted(scene_changes)
        self.reactions: list[float] = []
        self._cols: dict[str, list[Any]] = {k: [] for k in ("t", "error", "source", "age", "stale", "violation", "valid_until")}

    def record(self, now: float, step: Step, error: float, valid_until: float = math.nan) -> None:
        """Account for one tick.

        Args:
            now: the tick time.
            step: what the strategy produced.
            error: the task's error at this tick (for timelines).
            valid_until: chunkline's timeline end at this tick (NaN for the others).
        """
        self.ticks += 1
        self.counts[step.source] = self.counts.get(step.source, 0) + 1
        age = math.nan
        stale = False
        if step.due is not None and step.source in ("policy", "resuming"):
            age = now - step.due
            self.max_age = max(self.max_age, age)
            # 1e-9: float round-off of tick times; an action due exactly one period ago is on time.
            stale = age > self.tolerance_s + 1e-9
            self.stale += stale
        cmd = self.state.position if step.action is None else np.asarray(step.action, dtype=np.float64)
        if step.request is not None:
            self._obs_time[step.request.request_id] = step.request.obs_time
        following = step.source in _FOLLOWING
        self._following = 0 if step.source == "fallback" else self._following + 1
        if step.chunk_id is not None and following:
            self._at_policy_action(now, step.chunk_id, cmd,
                                   self._prev_source in _FOLLOWING and self._following > self._hand_back)
        self._prev_source = step.source
        bad = self.limits.step_violations(self.state, cmd)
        if bad:
            self.violation_ticks += 1
            for v in bad:
                self.violations[v.kind.value] = self.violations.get(v.kind.value, 0) + 1
        if np.isfinite(cmd).all():
            self._accel = self._acceleration(cmd)
            self.state = self.state.advanced(cmd, self.limits.dt)
        if self.keep:
            c = self._cols
            c["t"].append(now)
            c["error"].append(error)
            c["source"].append(step.source)
            c["age"].append(age)
            c["stale"].append(stale)
            c["violation"].append(bool(bad))
            c["valid_until"].append(valid_until)

    def _acceleration(self, cmd: np.ndarray) -> np.ndarray:
        """The acceleration the command ``cmd`` makes from the current command state."""
        dt = self.limits.dt
        return np.asarray(((cmd - self.state.position) / dt - self.state.velocity) / dt)

    def _at_policy_action(self, now: float, chunk_id: int | str, cmd: np.ndarray, running: bool) -> None:
        # A chunk boundary while the command follows chunks (the ramp of a hand-back from the
        # fallback is the resume's business, not a boundary between two chunks).
        switched = self._prev_chunk is not None and chunk_id != self._prev_chunk
        if running and switched and now >= self._switches_from and np.isfinite(cmd).all():
            step = cmd - self.state.position
            self.switch_jump = max(self.switch_jump, float(np.max(np.abs(step))))
            jump = self._acceleration(cmd) - self._accel
            self.switch_accel_jump = max(self.switch_accel_jump, float(np.max(np.abs(jump))))
        self._prev_chunk = chunk_id
        pending = len(self.reactions)
        if pending < len(self._changes):
            change = self._changes[pending]
            asked = self._obs_time.get(chunk_id)
            if now >= change and asked is not None and asked >= change:
                self.reactions.append(now - change)

    def timeline(self, offset: float = 0.0) -> dict[str, np.ndarray] | None:
        """The per-tick arrays (``None`` unless kept), times shifted by ``-offset``."""
        if not self.keep:
            return None
        out = {k: np.asarray(v) for k, v in self._cols.items()}
        out["source"] = np.asarray(self._cols["source"], dtype=str)
        out["t"] = np.asarray(out["t"], dtype=np.float64) - offset
        out["valid_until"] = np.asarray(out["valid_until"], dtype=np.float64) - offset
        return out

    def result(self, *, task: str, strategy: str, mode: str, label: str, seed: int, outcome: TaskOutcome,
               interventions: int, stats: Mapping[str, Any], time_offset: float = 0.0) -> EpisodeResult:
        """The episode's :class:`EpisodeResult` (timeline times relative to ``time_offset``)."""
        return EpisodeResult(
            task=task, strategy=strategy, mode=mode, label=label, seed=seed, success=bool(outcome.success),
            score=float(outcome.score), ticks=self.ticks, period_s=self.limits.dt,
            policy_ticks=self.counts.get("policy", 0), resuming_ticks=self.counts.get("resuming", 0),
            fallback_ticks=self.counts.get("fallback", 0), hold_ticks=self.counts.get("hold", 0),
            stale_actions=self.stale, max_action_age_s=self.max_age if self.max_age > -math.inf else math.nan,
            violation_ticks=self.violation_ticks, violations=dict(self.violations), interventions=int(interventions),
            requests=int(stats.get("requests", 0)), chunks=int(stats.get("chunks", 0)), errors=int(stats.get("errors", 0)),
            details={**outcome.details, "strategy": dict(stats)}, timeline=self.timeline(time_offset),
            switch_jump_max=self.switch_jump, switch_accel_jump_max=self.switch_accel_jump,
            reaction_s=self.reactions[0] if self.reactions else math.nan,
        )
