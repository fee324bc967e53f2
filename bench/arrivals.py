"""Arrival processes for the open-loop load generator, and recorded trace files.

Pure functions of a seed: a schedule is a list of :class:`Arrival` (time from the step's start,
the robot session, what it asks for) that :mod:`chunkline.bench.loadgen` only follows. Processes:
``constant`` (a fixed control rate), ``poisson``, ``gamma`` with coefficient of variation ``cv``
(> 1: bursts) and ``trace`` (a recorded file, as recorded or time-scaled to a rate). Trace files are
JSON lines or CSV with ``t`` (seconds) and optional ``robot``, ``tenant``, ``class``, ``shape``,
``prompt_len``, ``output_len``, ``deadline_ms``."""

from __future__ import annotations

import abc
import csv
import dataclasses
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "ARRIVAL_KINDS",
    "Arrival",
    "ArrivalError",
    "ArrivalProcess",
    "ConstantArrivals",
    "PoissonArrivals",
    "GammaArrivals",
    "make_process",
    "schedule",
    "load_trace",
    "save_trace",
    "trace_rate",
    "trace_schedule",
    "interarrival_cv",
    "index_of_dispersion",
]

#: the ``--arrival`` choices.
ARRIVAL_KINDS: tuple[str, ...] = ("constant", "poisson", "gamma", "trace")


class ArrivalError(ValueError):
    """A bad arrival process parameter or an unreadable trace file."""


@dataclasses.dataclass(frozen=True)
class Arrival:
    """One request in a schedule.

    Args:
        t: seconds from the start of the load step when it is due to be sent.
        robot: index of the robot session that sends it.
        tenant: the tenant it is sent for (selects the API key), ``None`` for the default.
        cls: request class (``policy``; ``text`` once the server serves text).
        shape: image shape to send instead of the policy's (traces of other cameras).
        prompt_len: text requests: prompt length in tokens.
        output_len: text requests: answer length in tokens.
        deadline_ms: this request's deadline; ``None`` uses the step's.
    """

    t: float
    robot: int = 0
    tenant: str | None = None
    cls: str = "policy"
    shape: tuple[int, ...] | None = None
    prompt_len: int | None = None
    output_len: int | None = None
    deadline_ms: float | None = None


class ArrivalProcess(abc.ABC):
    """A renewal process: independent, identically distributed inter-arrival times.

    Args:
        rate: mean arrivals per second (> 0).
    """

    name: str = "process"

    def __init__(self, rate: float) -> None:
        if not (math.isfinite(rate) and rate > 0):
            raise ArrivalError(f"rate must be a finite number > 0, got {rate!r}")
        self.rate = float(rate)

    @abc.abstractmethod
    def interarrivals(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` inter-arrival times in seconds."""

    def first_offset(self, rng: np.random.Generator) -> float:
        """Time of the first arrival (a stationary process does not start with one at 0)."""
        return float(self.interarrivals(1, rng)[0])

    def times(self, duration: float, seed: int = 0) -> np.ndarray:
        """Arrival times in ``[0, duration)``, sorted, the same for the same seed.

        Args:
            duration: seconds to cover.
            seed: seed of the random generator.
        """
        if not (math.isfinite(duration) and duration >= 0):
            raise ArrivalError(f"duration must be a finite number >= 0, got {duration!r}")
        rng = np.random.default_rng(seed)
        start = self.first_offset(rng)
        chunks = [np.array([start])]
        last, expected = start, self.rate * duration
        # Draw in blocks sized to the expected count, so the loop runs once or twice.
        block = max(16, int(expected * 1.2) + 16)
        while last < duration:
            gaps = self.interarrivals(block, rng)
            chunk = last + np.cumsum(gaps)
            chunks.append(chunk)
            last = float(chunk[-1])
        t = np.concatenate(chunks)
        return t[t < duration]


class ConstantArrivals(ArrivalProcess):
    """Exactly one arrival every ``1/rate`` seconds, the first at ``phase/rate``.

    Args:
        rate: arrivals per second.
        phase: fraction of a period before the first arrival, in ``[0, 1)``.
    """

    name = "constant"

    def __init__(self, rate: float, phase: float = 0.0) -> None:
        super().__init__(rate)
        if not 0.0 <= phase < 1.0:
            raise ArrivalError(f"phase must be in [0, 1), got {phase!r}")
        self.phase = float(phase)

    def interarrivals(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.full(n, 1.0 / self.rate)

    def first_offset(self, rng: np.random.Generator) -> float:
        return self.phase / self.rate

    def times(self, duration: float, seed: int = 0) -> np.ndarray:
        # Computed as i / rate rather than a running sum, so there is no drift over long steps.
        if not (math.isfinite(duration) and duration >= 0):
            raise ArrivalError(f"duration must be a finite number >= 0, got {duration!r}")
        n = int(math.ceil(duration * self.rate - self.phase)) + 1
        t = (np.arange(max(n, 0)) + self.phase) / self.rate
        return t[t < duration]


class PoissonArrivals(ArrivalProcess):
    """Exponential inter-arrival times (coefficient of variation 1).

    Args:
        rate: mean arrivals per second.
    """

    name = "poisson"

    def interarrivals(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return rng.exponential(1.0 / self.rate, n)


class GammaArrivals(ArrivalProcess):
    """Gamma inter-arrival times with mean ``1/rate`` and coefficient of variation ``cv``.

    The shape is ``k = 1/cv**2`` and the scale ``1/(rate*k)``; ``cv > 1`` gives bursts of
    closely spaced requests separated by lulls, at the same mean rate.

    Args:
        rate: mean arrivals per second.
        cv: coefficient of variation of the inter-arrival times (> 0).
    """

    name = "gamma"

    def __init__(self, rate: float, cv: float = 2.0) -> None:
        super().__init__(rate)
        if not (math.isfinite(cv) and cv > 0):
            raise ArrivalError(f"cv must be a finite number > 0, got {cv!r}")
        self.cv = float(cv)
        self.shape = 1.0 / (self.cv * self.cv)

    def interarrivals(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return rng.gamma(self.shape, 1.0 / (self.rate * self.shape), n)


def make_process(kind: str, rate: float, *, cv: float = 2.0) -> ArrivalProcess:
    """Build a process by its ``--arrival`` name (not ``trace``: see :func:`trace_schedule`).

    Args:
        kind: ``constant``, ``poisson`` or ``gamma``.
        rate: mean arrivals per second.
        cv: burstiness of ``gamma``.

    Raises:
        ArrivalError: an unknown kind or a bad parameter.
    """
    if kind == "constant":
        return ConstantArrivals(rate)
    if kind == "poisson":
        return PoissonArrivals(rate)
    if kind == "gamma":
        return GammaArrivals(rate, cv)
    raise ArrivalError(f"unknown arrival process {kind!r}; choose one of constant, poisson, gamma")


def schedule(process: ArrivalProcess, duration: float, robots: int, *, seed: int = 0,
             deadline_ms: float | None = None) -> list[Arrival]:
    """The arrivals of ``process`` over ``duration``, dealt to ``robots`` sessions in turn.

    Round-robin dealing gives each session ``rate/robots`` on average (with a constant
    process, exactly, staggered evenly), whatever the process.

    Args:
        process: the arrival process (its rate is the total offered load).
        duration: seconds.
        robots: sessions sharing the load (>= 1).
        seed: random seed (same seed, same schedule).
        deadline_ms: deadline to stamp on each arrival (``None``: the step's).
    """
    if robots < 1:
        raise ArrivalError(f"need at least one robot session, got {robots}")
    return [Arrival(t=float(t), robot=i % robots, deadline_ms=deadline_ms)
            for i, t in enumerate(process.times(duration, seed))]


# ---------------------------------------------------------------------------------- traces

def _parse_shape(value: Any) -> tuple[int, ...] | None:
    if value in (None, ""):
        return None
    if isinstance(value, str):
        parts = value.lower().replace(",", "x").split("x")
    elif isinstance(value, (list, tuple)):
        parts = list(value)
    else:
        raise ArrivalError(f"bad shape {value!r}")
    try:
        shape = tuple(int(p) for p in parts)
    except (TypeError, ValueError):
        raise ArrivalError(f"bad shape {value!r}") from None
    if not shape or any(d < 1 for d in shape):
        raise ArrivalError(f"bad shape {value!r}")
    return shape


def _opt(row: dict[str, Any], key: str, kind: type) -> Any:
    value = row.get(key)
    if value in (None, ""):
        return None
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ArrivalError(f"bad {key} {value!r}") from None


def _record(row: dict[str, Any], line: int) -> tuple[float, dict[str, Any]]:
    try:
        t = float(row["t"])
    except KeyError:
        raise ArrivalError(f"trace line {line}: no 't' column") from None
    except (TypeError, ValueError):
        raise ArrivalError(f"trace line {line}: bad t {row['t']!r}") from None
    if not math.isfinite(t):
        raise ArrivalError(f"trace line {line}: t must be finite")
    try:
        fields = {
            "robot": _opt(row, "robot", str),
            "tenant": _opt(row, "tenant", str),
            "cls": _opt(row, "class", str) or "policy",
            "shape": _parse_shape(row.get("shape")),
            "prompt_len": _opt(row, "prompt_len", int),
            "output_len": _opt(row, "output_len", int),
            "deadline_ms": _opt(row, "deadline_ms", float),
        }
    except ArrivalError as exc:
        raise ArrivalError(f"trace line {line}: {exc}") from None
    return t, fields


def load_trace(path: Path | str) -> list[Arrival]:
    """Read a trace file (JSON lines, or CSV when the name ends in ``.csv``).

    Times are shifted so the first arrival is at 0 and sorted. Robots are numbered in order of
    first appearance of their ``robot`` value (or of their ``tenant`` when there is no robot
    column: one session per tenant), else all requests come from robot 0.

    Raises:
        ArrivalError: the file is missing a ``t`` column or has a malformed value.
    """
    path = Path(path)
    rows: list[dict[str, Any]] = []
    try:
        if path.suffix == ".csv":
            with open(path, newline="") as f:
                rows = list(csv.DictReader(f))
        else:
            with open(path) as f:
                for n, text in enumerate(f, 1):
                    if text.strip():
                        try:
                            obj = json.loads(text)
                        except json.JSONDecodeError as exc:
                            raise ArrivalError(f"trace line {n}: not JSON ({exc.msg})") from None
                        if not isinstance(obj, dict):
                            raise ArrivalError(f"trace line {n}: not an object")
                        rows.append(obj)
    except OSError as exc:
        raise ArrivalError(f"cannot read trace {path}: {exc}") from None
    parsed = sorted((_record(row, n) for n, row in enumerate(rows, 1)), key=lambda r: r[0])
    if not parsed:
        return []
    origin = parsed[0][0]
    sessions: dict[str, int] = {}
    out = []
    for t, fields in parsed:
        key = fields.pop("robot")
        if key is None:
            key = fields["tenant"]
        robot = sessions.setdefault(key, len(sessions)) if key is not None else 0
        out.append(Arrival(t=t - origin, robot=robot, **fields))
    return out


def save_trace(path: Path | str, arrivals: Iterable[Arrival]) -> None:
    """Write arrivals as a JSON-lines trace that :func:`load_trace` reads back."""
    with open(path, "w") as f:
        for a in arrivals:
            row: dict[str, Any] = {"t": a.t, "robot": a.robot}
            if a.tenant is not None:
                row["tenant"] = a.tenant
            if a.cls != "policy":
                row["class"] = a.cls
            if a.shape is not None:
                row["shape"] = "x".join(str(d) for d in a.shape)
            for key in ("prompt_len", "output_len", "deadline_ms"):
                if getattr(a, key) is not None:
                    row[key] = getattr(a, key)
            f.write(json.dumps(row) + "\n")


def trace_rate(arrivals: Sequence[Arrival]) -> float:
    """The mean rate of a trace: arrivals per second over its span (0 for fewer than 2)."""
    if len(arrivals) < 2:
        return 0.0
    span = arrivals[-1].t - arrivals[0].t
    # n arrivals span n-1 gaps: the rate is gaps per second.
    return (len(arrivals) - 1) / span if span > 0 else math.inf


def trace_schedule(arrivals: Sequence[Arrival], *, rate: float | None = None, duration: float | None = None,
                   robots: int | None = None, deadline_ms: float | None = None) -> list[Arrival]:
    """A trace as a schedule: time-scaled to ``rate``, cut at ``duration``, robots folded.

    Args:
        arrivals: a loaded trace (times from 0).
        rate: target mean rate; ``None`` replays the recorded timing.
        duration: keep arrivals before this time (after scaling); ``None`` keeps all.
        robots: fold the trace's sessions onto this many (``robot % robots``); ``None`` keeps them.
        deadline_ms: default deadline for arrivals that carry none.
    """
    scale = 1.0
    if rate is not None:
        recorded = trace_rate(arrivals)
        if not (math.isfinite(recorded) and recorded > 0):
            raise ArrivalError("the trace has no duration to scale")
        scale = recorded / rate
    out = []
    for a in arrivals:
        t = a.t * scale
        if duration is not None and t >= duration:
            break
        out.append(dataclasses.replace(
            a, t=t, robot=a.robot % robots if robots else a.robot,
            deadline_ms=a.deadline_ms if a.deadline_ms is not None else deadline_ms))
    return out


# ---------------------------------------------------------------------------------- statistics

def interarrival_cv(times: Sequence[float] | np.ndarray) -> float:
    """Coefficient of variation of the gaps between sorted arrival times (NaN for < 3 times)."""
    t = np.asarray(times, dtype=float)
    if t.size < 3:
        return float("nan")
    gaps = np.diff(t)
    mean = gaps.mean()
    return float(gaps.std() / mean) if mean > 0 else float("nan")


def index_of_dispersion(times: Sequence[float] | np.ndarray, window: float, duration: float) -> float:
    """Variance over mean of the counts in consecutive windows (1 for Poisson, 0 for constant,
    above 1 for bursty arrivals).

    Args:
        times: arrival times in ``[0, duration)``.
        window: window length in seconds.
        duration: the span covered.
    """
    n = int(duration // window)
    if n < 2:
        return float("nan")
    counts, _ = np.histogram(np.asarray(times, dtype=float), bins=n, range=(0.0, n * window))
    mean = counts.mean()
    return float(counts.var() / mean) if mean > 0 else float("nan")
