"""A soak run's settings."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

__all__ = ["SoakConfig"]


@dataclasses.dataclass(frozen=True)
class SoakConfig:
    """A soak run.

    One field per flag of ``chunkline bench soak``.

    Args:
        duration_s: how long the robots run.
        robots: robot sessions at once.
        rate_hz: requests per robot per second (jittered).
        seed: everything random derives from it.
        faults: inject faults (else only normal requests, for a baseline).
        proxy: route half of the robots through the fault proxy, steered by a :class:`FaultPlan`.
        session_s: each session lasts a random time in this range, then a new one opens.
        fault_weights: relative weight of each action per tick (``normal`` included).
        sample_period_s: how often the server's memory and descriptors are read.
        drain_s: longest wait for a session's answers before it closes.
        max_message_bytes: the server's message cap (oversize frames are just above it).
        server_args: extra ``chunkline serve`` arguments.
        image: send a 64x64x3 camera frame with every normal request (a leak of observations
            would then show in memory).
        fault_gap_s: mean time between network faults.
        first_actions: actions done first (robot ``i`` takes every ``robots``-th one, starting at
            ``i``), so that even a short run injects every fault; then the weights decide.
        max_rss_slope_kib_per_min: a memory slope over the second half of the run above this is
            a problem, in runs of at least ``min_duration_for_slopes_s`` (shorter runs are
            dominated by start-up allocation; their slope is reported, not judged). The
            allocator's arenas fill up over the first minutes (replaced lane threads get new
            ones): a leak keeps its slope, a filling allocator flattens.
        server_env: extra environment for the server process (e.g. ``MALLOC_ARENA_MAX``).
        text_streams: sessions of text users beside the robots (``generate`` streams with
            cancels mid-stream, duplicate ids, unknown models, invalid requests, disconnects),
            on the embedded text model served as ``text_model``; 0 for robots only.
        text_rate_hz: ``generate`` requests per text session per second.
        text_weights, text_first_actions: as ``fault_weights`` and ``first_actions``, for them.
        heap_snapshots: a folder for the server's tracemalloc snapshots (:mod:`.heap`), or None.
        snapshot_period_s: seconds between two snapshots.
    """

    duration_s: float = 600.0
    robots: int = 16
    rate_hz: float = 10.0
    seed: int = 0
    faults: bool = True
    proxy: bool = True
    session_s: tuple[float, float] = (3.0, 15.0)
    fault_weights: Mapping[str, float] = dataclasses.field(default_factory=lambda: {
        "normal": 0.76, "burst": 0.03, "bad_obs": 0.02, "bad_msg": 0.02, "garbage": 0.015, "unknown_model": 0.01,
        "unmeetable": 0.02, "raise": 0.02, "hang": 0.002, "cancel": 0.03, "duplicate": 0.02, "disconnect": 0.01,
        "oversize": 0.003, "text": 0.003,
    })
    sample_period_s: float = 1.0
    drain_s: float = 15.0
    max_message_bytes: int = 1 << 20
    server_args: tuple[str, ...] = ()
    image: bool = True
    max_rss_slope_kib_per_min: float = 1024.0
    min_duration_for_slopes_s: float = 300.0
    fault_gap_s: float = 4.0
    server_env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    text_streams: int = 4
    text_rate_hz: float = 3.0
    text_model: str = "chat"
    text_weights: Mapping[str, float] = dataclasses.field(default_factory=lambda: {
        "generate": 0.75, "text_cancel": 0.08, "text_dup": 0.05, "text_unknown": 0.03, "text_bad": 0.03, "disconnect": 0.06,
    })
    text_first_actions: tuple[str, ...] = ("text_cancel", "text_dup", "text_unknown", "text_bad", "disconnect")
    heap_snapshots: Path | None = None
    snapshot_period_s: float = 60.0
    first_actions: tuple[str, ...] = ("raise", "cancel", "duplicate", "bad_obs", "bad_msg", "garbage", "unknown_model",
                                      "unmeetable", "burst", "hang", "disconnect", "oversize", "text")
