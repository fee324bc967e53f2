"""Workload files: robots (control rate, execution horizon, weight, network delay, start), the
batch-latency curve, the largest batch, the duration. JSON, validated; the shipped ones by name."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = ["Robot", "Workload", "load_workload", "SHIPPED", "ROWS_FROM", "chunk_rows"]

_DIR = Path(__file__).with_name("workloads")
#: the workloads shipped with the benchmark (``--workload NAME``)
SHIPPED = ("armory-l40s-equal", "armory-l40s", "fleet-100")
#: Where a chunk's ``horizon`` rows start. ``next-tick`` (FleetVLA's): on the tick after its
#: observation's, so all of them can run fresh. ``obs-tick`` (chunkline's time-indexed chunk): the
#: first row is due at the observation's own tick, whose command has already gone out, so a chunk
#: reaches one tick less past the observation that asked for it.
ROWS_FROM = ("next-tick", "obs-tick")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Robot(_Strict):
    """One robot: its control rate, the rows it executes of each chunk, its service weight, its
    one-way network delay (applied to each reply, as FleetVLA does) and when it starts."""

    name: str = Field(min_length=1, max_length=64)
    control_hz: float = Field(gt=0, le=1000)
    horizon: int = Field(ge=1, le=1000)
    weight: float = Field(default=1.0, gt=0)
    network_ms: float = Field(default=0.0, ge=0, le=10_000)
    start_s: float = Field(default=0.0, ge=0)

    @property
    def period(self) -> float:
        return 1.0 / self.control_hz


class Workload(_Strict):
    """A fleet on one accelerator: ``batch_latency_ms[B - 1]`` is a batch of ``B``'s latency."""

    name: str
    description: str = ""
    batch_latency_ms: list[float] = Field(min_length=1)
    max_batch: int = Field(ge=1)
    duration_s: float = Field(gt=0, le=3600)
    robots: list[Robot] = Field(min_length=1)

    def latency_s(self, batch: int) -> float:
        """Seconds a batch of ``batch`` takes (the curve's last entry beyond it)."""
        curve = self.batch_latency_ms
        return curve[min(batch, len(curve)) - 1] / 1000.0

    @property
    def max_horizon(self) -> int:
        return max(r.horizon for r in self.robots)


def chunk_rows(robot: Robot, rows_from: str) -> int:
    """Rows of a chunk counted from its observation's tick (the first is that tick's) under ``rows_from``."""
    if rows_from not in ROWS_FROM:
        raise ValueError(f"rows_from must be one of {ROWS_FROM}, not {rows_from!r}")
    return robot.horizon + (rows_from == "next-tick")


def load_workload(ref: str) -> Workload:
    """A shipped workload by name, or a JSON file.

    Raises:
        ValueError: unreadable or invalid (naming the field).
    """
    path = _DIR / f"{ref}.json" if ref in SHIPPED else Path(ref)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return Workload.model_validate(data)
    except (OSError, ValueError, ValidationError) as exc:
        raise ValueError(f"workload {ref}: {exc}") from None
