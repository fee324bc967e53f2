"""The broker's validated plan on the robot clock.

The robot side holds a chunk in two shapes, for two jobs. The client returns the wire message
(:class:`chunkline.client.wire.protocol.Chunk`): actions as sent, ``t0`` possibly ``None``, the
client's request id. The broker plays an :class:`ActionChunk`: checked once (shape, finite
``t0``, ``dt > 0``), actions as a read-only float32 copy, tagged with the *broker's* request id
and its own clock's arrival time, so the timeline's hot path never re-checks anything. It is
built from a reply (:meth:`ActionChunk.from_reply`) or directly (tests, simulations,
openpi-style policies that return a bare dict).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from ..client.wire.protocol import Chunk
from .exceptions import ChunkError

__all__ = ["ActionChunk"]

_NO_T0 = "a chunk needs a finite t0 (send obs_time with the request)"


@dataclasses.dataclass(frozen=True, eq=False)
class ActionChunk:
    """A timestamped action chunk on the robot's clock.

    Action ``k`` is due at ``t0 + k * dt``; no action may run after ``expires``.

    Args:
        actions: ``[H, A]`` float32 (converted and made read-only at construction).
        t0: due time of ``actions[0]``, robot monotonic clock, seconds.
        dt: seconds between consecutive actions (> 0).
        expires: no action of this chunk may run after this time; ``None`` for no limit
            beyond the timeline's staleness tolerance.
        request_id: the broker's id of the request this chunk answers.
        received_at: when it arrived, robot clock.
        model: the policy that produced it (informational).
        fingerprint: that policy's fingerprint (informational).
        timing: server-side durations in milliseconds (informational).

    Raises:
        ChunkError: the chunk is malformed (shape, non-finite times, ``dt <= 0``).
    """

    actions: np.ndarray
    t0: float
    dt: float
    expires: float | None
    request_id: int | str | None = None
    received_at: float = math.nan
    model: str | None = None
    fingerprint: str | None = None
    timing: dict[str, float] | None = None

    def __post_init__(self) -> None:
        a = np.asarray(self.actions)
        if a.ndim != 2 or a.shape[0] == 0 or a.shape[1] == 0:
            raise ChunkError(f"actions must be [H, A] with H, A >= 1, got shape {a.shape}")
        if a.dtype.kind not in "fiu":
            raise ChunkError(f"actions must be numeric, got dtype {a.dtype}")
        a = np.array(a, dtype=np.float32, copy=True)
        a.setflags(write=False)
        object.__setattr__(self, "actions", a)
        if self.t0 is None or not math.isfinite(self.t0):
            raise ChunkError(_NO_T0)
        if not (math.isfinite(self.dt) and self.dt > 0):
            raise ChunkError(f"dt must be finite and > 0, got {self.dt}")
        exp = self.expires
        if exp is not None and math.isnan(exp):
            raise ChunkError("expires is NaN")
        object.__setattr__(self, "t0", float(self.t0))
        object.__setattr__(self, "dt", float(self.dt))
        object.__setattr__(self, "expires", None if exp is None else float(exp))

    @property
    def horizon(self) -> int:
        """``H``, the number of actions."""
        return int(self.actions.shape[0])

    @property
    def action_dim(self) -> int:
        """``A``, the width of one action."""
        return int(self.actions.shape[1])

    @property
    def expiry(self) -> float:
        """``expires``, or ``+inf`` when the chunk has none."""
        return math.inf if self.expires is None else self.expires

    def due_time(self, k: int) -> float:
        """When action ``k`` is due."""
        return self.t0 + k * self.dt

    def __repr__(self) -> str:
        return (f"ActionChunk(request_id={self.request_id!r}, actions=[{self.horizon}x{self.action_dim}], t0={self.t0:.6f}, "
                f"dt={self.dt}, expires={self.expires})")

    @classmethod
    def from_reply(cls, reply: Chunk | Any, *, received_at: float, request_id: int | str | None = None) -> ActionChunk:
        """Validate a client's reply (a protocol :class:`~chunkline.client.wire.protocol.Chunk`) into a plan.

        Args:
            reply: the chunk (or any object with ``actions``, ``t0``, ``dt``, ``expires`` and
                optionally ``id``, ``model``, ``fingerprint``, ``timing``).
            received_at: when it arrived, robot clock.
            request_id: the broker's request id; defaults to ``reply.id``.

        Raises:
            ChunkError: the reply cannot be placed on a timeline.
        """
        t0 = reply.t0
        if t0 is None:
            raise ChunkError(_NO_T0)
        return cls(
            actions=reply.actions,
            t0=t0,
            dt=reply.dt,
            expires=reply.expires,
            request_id=request_id if request_id is not None else getattr(reply, "id", None),
            received_at=received_at,
            model=getattr(reply, "model", None),
            fingerprint=getattr(reply, "fingerprint", None),
            timing=dict(getattr(reply, "timing", None) or {}),
        )
