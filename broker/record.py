"""Per-tick event records, saved as JSON lines or ``.npz`` for analysis.

One record per control tick: when it ran (and its jitter), where the command came from
(policy, resuming, fallback) and why, which chunk the action came from, how old the action
was, the chunk's measured round trip, what the safety filter did, whether a request went out,
and optionally the command itself. Appending costs a few list appends (no I/O on the tick);
saving happens when the researcher asks.

JSON lines: one object per tick with the keys of :data:`FIELDS` (``action`` as a list when
kept). ``.npz``: one array per key (strings as unicode arrays, missing numbers as NaN,
missing chunk ids as ``""``), plus ``action`` ``[N, A]`` when kept.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from typing import Any

import numpy as np

from .core import Command
from .fixed_rate import TickInfo

__all__ = ["FIELDS", "TickRecorder", "load_jsonl", "load_npz"]

#: keys of every record, in order.
FIELDS = (
    "t",
    "scheduled",
    "jitter_s",
    "mode",
    "reason",
    "chunk_id",
    "action_age_s",
    "latency_s",
    "verdict",
    "request_id",
)


def _num(x: float | None) -> float:
    return math.nan if x is None else float(x)


class TickRecorder:
    """Collects one record per tick.

    Args:
        keep_actions: also keep each command (``[A]`` per tick).
        max_ticks: keep at most this many records (the oldest are dropped first); ``None``: all.
    """

    def __init__(self, keep_actions: bool = True, max_ticks: int | None = None) -> None:
        self.keep_actions = keep_actions
        self.max_ticks = max_ticks
        self._cols: dict[str, list[Any]] = {k: [] for k in FIELDS}
        self._actions: list[np.ndarray] = []

    def __len__(self) -> int:
        return len(self._cols["t"])

    def append(self, command: Command, tick: TickInfo | None = None) -> None:
        """Record one tick's command (and its timing from the runner, when known)."""
        c = self._cols
        c["t"].append(command.time)
        c["scheduled"].append(None if tick is None else tick.scheduled)
        c["jitter_s"].append(None if tick is None else tick.jitter)
        c["mode"].append(command.mode.value)
        c["reason"].append(None if command.reason is None else command.reason.value)
        c["chunk_id"].append(command.chunk_id)
        c["action_age_s"].append(command.action_age_s)
        c["latency_s"].append(command.latency_s)
        c["verdict"].append(None if command.verdict is None else command.verdict.value)
        c["request_id"].append(None if command.request is None else command.request.request_id)
        if self.keep_actions:
            self._actions.append(command.action)
        if self.max_ticks is not None and len(c["t"]) > self.max_ticks:
            drop = len(c["t"]) - self.max_ticks
            for col in c.values():
                del col[:drop]
            if self.keep_actions:
                del self._actions[:drop]

    def rows(self) -> Iterable[dict[str, Any]]:
        """The records as dicts (``action`` as a list when kept)."""
        c = self._cols
        for i in range(len(self)):
            row = {k: c[k][i] for k in FIELDS}
            if self.keep_actions:
                row["action"] = [float(x) for x in self._actions[i]]
            yield row

    def save_jsonl(self, path: str | os.PathLike[str]) -> None:
        """Write one JSON object per line (NaN-free: missing values are ``null``)."""
        with open(path, "w", encoding="utf-8") as fh:
            for row in self.rows():
                clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
                fh.write(json.dumps(clean, separators=(",", ":")) + "\n")

    def arrays(self) -> dict[str, np.ndarray]:
        """The records as columns (what :meth:`save_npz` writes)."""
        c = self._cols
        out: dict[str, np.ndarray] = {}
        for key in ("t", "scheduled", "jitter_s", "action_age_s", "latency_s"):
            out[key] = np.array([_num(x) for x in c[key]], dtype=np.float64)
        for key in ("mode", "reason", "verdict"):
            out[key] = np.array(["" if x is None else x for x in c[key]], dtype=str)
        out["chunk_id"] = np.array(["" if x is None else str(x) for x in c["chunk_id"]], dtype=str)
        out["request_id"] = np.array([-1 if x is None else int(x) for x in c["request_id"]], dtype=np.int64)
        if self.keep_actions:
            out["action"] = np.stack(self._actions) if self._actions else np.zeros((0, 0))
        return out

    def save_npz(self, path: str | os.PathLike[str]) -> None:
        """Write the columns to a compressed ``.npz``."""
        # numpy's stubs read **kwds as possibly setting allow_pickle (a bool); the keys are column names.
        np.savez_compressed(path, **self.arrays())  # type: ignore[arg-type]

    def save(self, path: str | os.PathLike[str]) -> None:
        """Save by extension: ``.npz`` or JSON lines (anything else)."""
        if str(path).endswith(".npz"):
            self.save_npz(path)
        else:
            self.save_jsonl(path)


def load_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read a file written by :meth:`TickRecorder.save_jsonl`."""
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def load_npz(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Read a file written by :meth:`TickRecorder.save_npz`."""
    with np.load(path, allow_pickle=False) as data:
        return {k: data[k] for k in data.files}
