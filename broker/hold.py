"""Hold-and-resume: a chunk answering an observation the robot has held still since starts now.

While the robot holds (the fallback runs: no plan), nothing it plans from changes on its side, so
a late chunk planned from an observation taken during the hold loses nothing by the wait: it is
re-anchored to the next tick, from the row after its observation's tick (whose command, the
hold, went out then, as a frozen prefix's first row did). A chunk asked for at the plan's last
rows, with those rows as its frozen prefix, resumes from its first row after them when the hold
began as they ended (they all ran, nothing else did) and it reproduces them: the robot stands
where its own rows start. Only while the measured state stays within ``tolerance`` (per joint, action units) of the
state when the hold began; a robot that moved (or was pushed) never runs a row planned from a
state it has left: the time-based staleness applies.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .chunk import ActionChunk

__all__ = ["HoldTracker"]


@dataclasses.dataclass(slots=True)
class HoldTracker:
    """Since when the robot has held still (pure; fed once per tick).

    Args:
        tolerance: largest per-joint distance from the hold's first state that still counts as
            holding still; ``None`` turns hold-and-resume off.
        ahead_s: while paced, how long before the plan runs dry the next request goes out
            (:func:`.pacing.paced_ahead_s`); 0: once it is dry.
    """

    tolerance: float | None
    ahead_s: float = 0.0
    since: float = math.inf  # held still since then (inf: not holding)
    anchor: np.ndarray | None = None
    last_due: float = math.nan  # due time of the last plan row that ran
    held_after: float = math.nan  # that row's when the hold began (NaN: it moved since, or none ran)

    def update(self, now: float, position: np.ndarray, holding: bool, due: float = math.nan) -> None:
        """The state at tick ``now``; ``holding``: no plan runs (the fallback holds); ``due``: the
        due time of the plan row that ran this tick."""
        tol = self.tolerance
        if not holding or tol is None:
            self.since = math.inf
            self.last_due = due
            return
        anchor = self.anchor
        # NaN compares false: a non-finite measurement counts as having moved.
        if self.since == math.inf or anchor is None or not float(np.max(np.abs(position - anchor))) <= tol:
            self.held_after = self.last_due if self.since == math.inf else math.nan
            self.last_due = math.nan
            self.anchor = np.array(position, dtype=np.float64)
            self.since = now

    def resumes(self, obs_time: float | None) -> bool:
        """Whether the robot has held still since ``obs_time`` (its state within the tolerance)."""
        return obs_time is not None and self.since <= obs_time

    def ran_of(self, prefix_due: float, frozen: int, dt: float) -> int:
        """How many rows of a frozen prefix (``frozen`` rows ``dt`` apart from ``prefix_due``) ran
        before the robot began to hold still, nothing else after them; 0 when none did, or the
        hold did not follow one of them (matched by due time: ticks jitter, rows do not)."""
        j = round((self.held_after - prefix_due) / dt) + 1 if self.held_after == self.held_after and dt > 0 else 0
        return j if 1 <= j <= frozen and abs(self.held_after - prefix_due - (j - 1) * dt) < 0.5 * dt else 0

    def agrees(self, row: np.ndarray, frozen_row: np.ndarray) -> bool:
        """Whether a chunk's ``row`` reproduces the ``frozen_row`` it was sent (within the tolerance)."""
        tol = self.tolerance
        return tol is not None and row.shape == frozen_row.shape and float(np.max(np.abs(row - frozen_row))) <= tol

    def resume(self, chunk: ActionChunk, obs_time: float | None, frozen: int, prefix: np.ndarray | None,
               prefix_due: float, t_next: float) -> ActionChunk | None:
        """``chunk`` re-anchored so its first row the robot has not run runs at ``t_next``: after
        the rows of its frozen ``prefix`` (``frozen`` rows from ``prefix_due``) that ran before
        the hold, the last of which it must reproduce; from the row after its observation's tick
        when the robot has held still since ``obs_time``. ``None`` when neither holds, or that row
        is not late."""
        first = min(1, chunk.horizon - 1)
        if prefix is not None and frozen > 0 and not self.resumes(obs_time):
            first = self.ran_of(prefix_due, min(frozen, len(prefix), chunk.horizon - 1), chunk.dt)
            if not first or self.since == math.inf or not self.agrees(chunk.actions[first - 1], prefix[first - 1]):
                return None
        elif not self.resumes(obs_time):
            return None
        if chunk.t0 + first * chunk.dt >= t_next:
            return None
        return self.reanchored(chunk, t_next, first)

    @staticmethod
    def reanchored(chunk: ActionChunk, t_next: float, first: int = 0) -> ActionChunk:
        """``chunk`` shifted so its row ``first`` is due at ``t_next`` (its expiry moved with it)."""
        shift = t_next - first * chunk.dt - chunk.t0
        expires = None if chunk.expires is None else chunk.expires + shift
        return dataclasses.replace(chunk, t0=chunk.t0 + shift, expires=expires)
