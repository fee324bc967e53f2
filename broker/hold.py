"""Hold-and-resume: a chunk answering an observation the robot has held still since starts now.

While the robot holds (the fallback runs: no plan), nothing it plans from changes on its side, so
a late chunk planned from an observation taken during the hold loses nothing by the wait: it is
re-anchored to the next tick, from its first row. Only while the measured state stays within
``tolerance`` (per joint, action units) of the state when the hold began; a robot that moved (or
was pushed) never runs a row planned from a state it has left: the time-based staleness applies.
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
    """

    tolerance: float | None
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

    def resumes(self, obs_time: float | None) -> bool:
        """Whether the robot has held still since ``obs_time`` (its state within the tolerance)."""
        return obs_time is not None and self.since <= obs_time

    @staticmethod
    def reanchored(chunk: ActionChunk, t_next: float) -> ActionChunk:
        """``chunk`` shifted so its first row is due at ``t_next`` (its expiry moved with it)."""
        shift = t_next - chunk.t0
        expires = None if chunk.expires is None else chunk.expires + shift
        return dataclasses.replace(chunk, t0=t_next, expires=expires)
