"""The frozen prefix of a real-time-chunking request, and its batched form on the chunk's grid.

A robot that asks for a new chunk while it still executes the current one sends the actions it
will run meanwhile (and, beyond them, the rest of its current plan): the *prefix*. Row ``j`` of
the prefix is what the robot executes at ``t0 + j * dt`` on its own clock, where ``t0`` is the
request's ``obs_time`` (the robot takes the prefix from the tick that took the observation).
Its first ``delay_steps`` rows will run before the answer can arrive whatever the policy says
(the estimated inference delay, in steps): a real-time-chunking policy reproduces them exactly
and steers the rest of its chunk towards the remaining rows.

A batch holds rows with different prefix lengths: :func:`stack_prefixes` places every prefix on
the grid of the chunk it asks for (row ``i`` due at ``obs_time + action_offset + i * dt``), pads
with zeros and says which rows are given (``mask``) and how many are frozen (``delay``).
This module imports numpy only: the policy interface (:mod:`.base`) builds on it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

__all__ = ["PrefixError", "ActionPrefix", "PrefixBatch", "stack_prefixes", "MAX_PREFIX_FACTOR"]

#: a prefix longer than this many chunks is refused (a robot never holds more than its plan).
MAX_PREFIX_FACTOR = 4


class PrefixError(ValueError):
    """A prefix does not fit the policy (shape, dtype, non-finite values, delay out of range)."""


@dataclasses.dataclass(frozen=True)
class ActionPrefix:
    """The actions a robot will execute while its request is in flight, and the rest of its plan.

    Args:
        actions: ``[P, A]`` float32.
        t0: robot-clock due time of ``actions[0]`` (the request's ``obs_time``); ``None`` when the
            request carries no time (the prefix is then taken to start with the chunk).
        dt: seconds between rows (the policy's ``dt``).
        delay_steps: the first rows that will run before the answer arrives (frozen), ``0..P``.
    """

    actions: np.ndarray
    t0: float | None
    dt: float
    delay_steps: int

    @classmethod
    def from_wire(cls, actions: object, *, t0: float | None, dt: float, action_dim: int, horizon: int,
                  delay_steps: int | None) -> ActionPrefix:
        """Check an untrusted prefix against the policy's action width and chunk length.

        Args:
            actions: what the request carried.
            t0: the request's ``obs_time``.
            dt: the policy's ``dt``.
            action_dim: the policy's ``A``.
            horizon: the policy's ``H`` (a prefix may hold at most ``MAX_PREFIX_FACTOR * H`` rows).
            delay_steps: the frozen rows; ``None``: every row (a prefix of the in-flight actions only).

        Raises:
            PrefixError: naming what is wrong, never the content.
        """
        if not isinstance(actions, np.ndarray):
            raise PrefixError(f"prefix must be an array, got {type(actions).__name__}")
        if actions.ndim != 2 or actions.shape[1] != action_dim:
            raise PrefixError(f"prefix has shape {list(actions.shape)}, expected [P, {action_dim}]")
        if actions.shape[0] > MAX_PREFIX_FACTOR * horizon:
            raise PrefixError(f"prefix has {actions.shape[0]} rows, at most {MAX_PREFIX_FACTOR * horizon} accepted")
        if actions.dtype.kind not in "iuf":
            raise PrefixError(f"prefix has dtype {actions.dtype.name}, expected a number type")
        values = actions.astype(np.float32)
        if not np.isfinite(values).all():
            raise PrefixError("prefix contains NaN or infinity")
        rows = values.shape[0]
        delay = rows if delay_steps is None else delay_steps
        if not 0 <= delay <= rows:
            raise PrefixError(f"prefix_delay {delay} is outside 0..{rows}")
        if t0 is not None and not math.isfinite(t0):
            raise PrefixError("prefix time is not finite")
        values.setflags(write=False)
        return cls(values, t0, float(dt), int(delay))

    @property
    def rows(self) -> int:
        """``P``."""
        return int(self.actions.shape[0])

    def shift(self, action_offset: float) -> int:
        """Chunk row of prefix row 0: the chunk starts ``action_offset`` after ``obs_time``, so
        prefix row ``j`` lands on chunk row ``j - round(action_offset / dt)``."""
        return -int(round(action_offset / self.dt))


@dataclasses.dataclass(frozen=True)
class PrefixBatch:
    """The prefixes of a batch on the grid of the chunks asked for.

    Args:
        actions: ``[B, H, A]`` float32: row ``i`` of item ``b`` is what that robot will execute
            when the new chunk's row ``i`` is due (zeros where ``mask`` is false).
        mask: ``[B, H]`` bool: whether that row is given.
        delay: ``[B]`` int: the item's given rows below ``delay[b]`` are frozen (they run before
            the answer arrives).
    """

    actions: np.ndarray
    mask: np.ndarray
    delay: np.ndarray

    @property
    def any(self) -> bool:
        """Whether any item carries a prefix row."""
        return bool(self.mask.any())


def stack_prefixes(prefixes: Sequence[ActionPrefix | None], *, horizon: int, action_dim: int,
                   action_offset: float = 0.0) -> PrefixBatch:
    """Place each item's prefix on its chunk's grid (items without a prefix: all-false mask).

    Args:
        prefixes: one per item (``None``: no prefix).
        horizon: ``H``.
        action_dim: ``A``.
        action_offset: the policy's ``action_offset`` (the chunk's ``t0`` is ``obs_time`` plus it).
    """
    batch = len(prefixes)
    actions = np.zeros((batch, horizon, action_dim), np.float32)
    mask = np.zeros((batch, horizon), bool)
    delay = np.zeros(batch, np.int64)
    for b, prefix in enumerate(prefixes):
        if prefix is None or prefix.rows == 0:
            continue
        shift = prefix.shift(action_offset)
        # Prefix row j lands on chunk row j + shift; rows before the chunk's start or past its end
        # have no slot (they run before the chunk's first action, or after its last).
        j0, j1 = max(0, -shift), min(prefix.rows, horizon - shift)
        if j1 > j0:
            actions[b, j0 + shift:j1 + shift] = prefix.actions[j0:j1]
            mask[b, j0 + shift:j1 + shift] = True
        delay[b] = int(np.clip(prefix.delay_steps + shift, 0, horizon))
        # The frozen rows are given rows: a delay reaching past the prefix's last slot is cut there.
        given = np.flatnonzero(mask[b])
        delay[b] = min(int(delay[b]), int(given[-1]) + 1 if given.size else 0)
    actions.setflags(write=False)
    mask.setflags(write=False)
    return PrefixBatch(actions, mask, delay)
