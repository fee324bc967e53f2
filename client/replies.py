"""What the clients return: an action chunk with the server's and the client's timing."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .protocol import Chunk

__all__ = ["ChunkReply"]


@dataclasses.dataclass(frozen=True)
class ChunkReply:
    """An action chunk as the robot receives it.

    Args:
        id: the request id.
        actions: ``[H, action_dim]`` float32 (read-only).
        t0: robot-clock due time of ``actions[0]`` (``None`` if no ``obs_time`` was sent).
        dt: seconds between actions.
        expires: robot-clock time after which no action of this chunk may run.
        model, fingerprint: which policy, exactly, produced it.
        late: the server finished after the request's deadline.
        timing: the server's durations (ms): ``decode_ms``, ``queue_ms``, ``infer_ms``,
            ``encode_ms``, ``server_ms``, and ``batch_size``.
        client_timing: the client's durations (ms): ``encode_ms``, ``send_ms``,
            ``round_trip_ms`` (send start to reply received), ``decode_ms``.
        received_at: the client's ``time.monotonic()`` when the reply arrived.
    """

    id: int | str
    actions: np.ndarray
    t0: float | None
    dt: float
    expires: float | None
    model: str
    fingerprint: str
    late: bool
    timing: dict[str, float]
    client_timing: dict[str, float]
    received_at: float

    @classmethod
    def from_chunk(cls, chunk: Chunk, client_timing: dict[str, float], received_at: float) -> ChunkReply:
        return cls(
            id=chunk.id,
            actions=chunk.actions,
            t0=chunk.t0,
            dt=chunk.dt,
            expires=chunk.expires,
            model=chunk.model,
            fingerprint=chunk.fingerprint,
            late=chunk.late,
            timing=dict(chunk.timing),
            client_timing=client_timing,
            received_at=received_at,
        )

    def as_openpi(self) -> dict[str, Any]:
        """The openpi-style result map (``actions`` first axis is the chunk step)."""
        return {
            "actions": self.actions,
            "server_timing": dict(self.timing),
            "t0": self.t0,
            "dt": self.dt,
            "expires": self.expires,
            "fingerprint": self.fingerprint,
        }
