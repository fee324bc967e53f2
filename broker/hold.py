"""Hold-and-resume: a chunk answering an observation the robot has held still since starts now.

While the robot holds (the fallback runs: no plan), nothing it plans from changes on its side, so
a late chunk planned from an observation taken during the hold loses nothing by the wait: it is
re-anchored to the next tick, from its first row. A chunk asked for at the plan's last rows, with
those rows as its frozen prefix, resumes from its first row after them when the hold began as they
ended (they all ran, nothing else did) and it reproduces them: the robot stands where its own rows
start. Only while the measured state stays within ``tolerance`` (per joint, action units) of the
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
            (``BrokerConfig.paced_lead_rows`` periods); 0: once it is dry.
    """

    tolerance: float | None
    ahead_s: float = 0.0
    since: float = math.inf  # held still since then (inf: not holding)
    anchor: np.ndarray | None = None

    def update(self, now: float, position: np.ndarray, holding: bool) -> None:
        """The state at tick ``now``; ``holding``: no plan runs (the fallback holds)."""
        tol = self.tolerance
        if not holding or tol is None:
            self.since = math.inf
            return
        anchor = self.anchor
        # NaN compares false: a non-finite measurement counts as having moved.
        if self.since == math.inf or anchor is None or not float(np.max(np.abs(position - anchor))) <= tol:
            self.anchor = np.array(position, dtype=np.float64)
            self.since = now

    def resumes(self, obs_time: float | None, frozen: int = 0, dt: float = 0.0) -> bool:
        """Whether the robot has held still since ``obs_time`` (its state within the tolerance);
        with ``frozen`` prefix rows ``dt`` apart, since the tick its prefix ended at (they all ran,
        then nothing else: within half a row of ``obs_time + frozen * dt``, ticks jitter)."""
        if obs_time is None:
            return False
        if frozen <= 0:
            return self.since <= obs_time
        return abs(self.since - (obs_time + frozen * dt)) < 0.5 * dt

    def agrees(self, row: np.ndarray, frozen_row: np.ndarray | None) -> bool:
        """Whether a chunk's ``row`` reproduces the ``frozen_row`` it was sent (within the tolerance)."""
        tol = self.tolerance
        return (tol is not None and frozen_row is not None and row.shape == frozen_row.shape
                and float(np.max(np.abs(row - frozen_row))) <= tol)

    def resume(self, chunk: ActionChunk, obs_time: float | None, frozen: int, prefix: np.ndarray | None,
               t_next: float) -> ActionChunk | None:
        """``chunk`` re-anchored so its first own row (after the ``frozen`` rows of the ``prefix``
        it was sent, the last of which it must reproduce) runs at ``t_next``; ``None`` when the
        robot has not held still since then, or that row is not late."""
        first = frozen if 0 < frozen < chunk.horizon and prefix is not None and frozen <= len(prefix) else 0
        if chunk.t0 + first * chunk.dt >= t_next or not self.resumes(obs_time, first, chunk.dt):
            return None
        if first and not self.agrees(chunk.actions[first - 1], None if prefix is None else prefix[first - 1]):
            return None
        return self.reanchored(chunk, t_next, first)

    @staticmethod
    def reanchored(chunk: ActionChunk, t_next: float, first: int = 0) -> ActionChunk:
        """``chunk`` shifted so its row ``first`` is due at ``t_next`` (its expiry moved with it)."""
        shift = t_next - first * chunk.dt - chunk.t0
        expires = None if chunk.expires is None else chunk.expires + shift
        return dataclasses.replace(chunk, t0=chunk.t0 + shift, expires=expires)
