"""Compressing an observation's fields before upload: fixed JPEG, or adaptive to the uplink.

:class:`Compression` is the client's setting: ``raw`` (the default), ``jpeg`` (every field the
spec allows at one quality; PNG for lossless-only fields) or ``adaptive`` (per request, raw or a
JPEG quality so that the upload meets the latency budget). :func:`plan_fields` (pure) decides from
the session's agreed encodings and the spec; :class:`AdaptiveChooser` (sans-I/O) keeps the link
estimate; :class:`FieldCompressor` encodes fields on worker threads off the control loop. The
uplink is estimated from each request's completion as the server saw it (send start to reply, less
``server_ms``), since a send completes once the kernel buffers it."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import statistics
import time
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import numpy as np

from .wire.encodings import JPEG, PNG, RAW, EncodedArray, encode_array, require, unfit_reason

__all__ = ["Compression", "AdaptiveChooser", "FieldPlan", "UploadPlan", "FieldCompressor", "plan_fields", "Compressed", "iter_arrays"]

CompressionMode = Literal["raw", "jpeg", "adaptive"]

#: JPEG qualities the adaptive mode chooses among, best first
DEFAULT_QUALITIES: tuple[int, ...] = (95, 90, 85, 80, 70, 60, 50)


@dataclasses.dataclass(frozen=True)
class Compression:
    """How a client sends image fields (only fields whose spec allows an encoding, and only
    encodings the session agreed at the handshake; everything else goes raw).

    Args:
        mode: ``raw``, ``jpeg`` (always, at ``quality``) or ``adaptive``.
        quality: the JPEG quality of the ``jpeg`` mode (1 to 100).
        latency_budget_ms: the adaptive mode's target for compression plus upload plus the
            server's decode: the best fidelity predicted to fit is chosen (raw first), else the
            fastest option.
        qualities: the JPEG qualities the adaptive mode chooses among (a field's spec may set a
            floor, ``jpeg_min_quality``).
        workers: encoding threads (one field each at a time).
    """

    mode: CompressionMode = "raw"
    quality: int = 90
    latency_budget_ms: float = 50.0
    qualities: tuple[int, ...] = DEFAULT_QUALITIES
    workers: int = 4

    def __post_init__(self) -> None:
        if self.mode not in ("raw", "jpeg", "adaptive"):
            raise ValueError(f"mode must be raw, jpeg or adaptive, got {self.mode!r}")
        if not 1 <= self.quality <= 100 or not all(1 <= q <= 100 for q in self.qualities) or not self.qualities:
            raise ValueError("JPEG qualities are 1 to 100")
        if not (math.isfinite(self.latency_budget_ms) and self.latency_budget_ms > 0):
            raise ValueError("latency_budget_ms must be > 0")
        if self.workers < 1:
            raise ValueError("workers must be >= 1")
        if self.mode != "raw":
            require(JPEG)  # a clear error now, with the install line, rather than at the first request

    @property
    def offered(self) -> list[str]:
        """The compressed encodings this client offers at the handshake."""
        return [] if self.mode == "raw" else [e for e in (JPEG, PNG) if _can(e)]


def _can(encoding: str) -> bool:
    try:
        require(encoding)
    except ImportError:
        return False
    return True


@dataclasses.dataclass(frozen=True, slots=True)
class FieldPlan:
    """How one field goes: its encoding and, for JPEG, the quality."""

    encoding: str
    quality: int | None = None

    def label(self) -> str:
        return f"{self.encoding}:{self.quality}" if self.quality is not None else self.encoding


@dataclasses.dataclass(frozen=True, slots=True)
class UploadPlan:
    """How one observation goes up: its fields to compress, the JPEG quality chosen for its
    camera fields (``None``: they go raw) and their raw size (what the choice was made for)."""

    fields: dict[str, FieldPlan]
    quality: int | None
    eligible_bytes: int


def iter_arrays(obs: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, np.ndarray]]:
    """``(flattened name, array)`` for each array of an observation (nested maps join their keys
    with ``/``, as the server flattens them: ``{"images": {"cam": a}}`` is ``images/cam``)."""
    for key, value in obs.items():
        name = f"{prefix}{key}"
        if isinstance(value, np.ndarray):
            yield name, value
        elif isinstance(value, Mapping):
            yield from iter_arrays(value, f"{name}/")


def plan_fields(obs: Mapping[str, Any], observation_spec: Mapping[str, Any], agreed: list[str],
                jpeg_quality: int | None) -> dict[str, FieldPlan]:
    """The fields to compress and how (everything else goes raw).

    Args:
        obs: the observation.
        observation_spec: the model's published ``observation`` (its ``hello`` metadata).
        agreed: the session's encodings.
        jpeg_quality: the JPEG quality for fields that allow JPEG; ``None``: send those raw
            (lossless PNG still goes where it is allowed).
    """
    plans: dict[str, FieldPlan] = {}
    for name, arr in iter_arrays(obs):
        spec = observation_spec.get(name)
        allowed = spec.get("encodings", []) if isinstance(spec, Mapping) else []
        usable = [e for e in allowed if e in agreed and unfit_reason(e, arr.dtype, arr.shape) is None]
        if JPEG in usable and jpeg_quality is not None:
            floor = spec.get("jpeg_min_quality", 1) if isinstance(spec, Mapping) else 1
            plans[name] = FieldPlan(JPEG, max(jpeg_quality, int(floor)))
        elif PNG in usable and JPEG not in usable:
            plans[name] = FieldPlan(PNG)
    return plans


class AdaptiveChooser:
    """Picks the JPEG quality (or raw) of each request from the measured uplink.

    Predicted latency of an option: its encode and decode time (measured, per raw byte) plus its
    payload (raw bytes times the option's measured compression ratio) over the measured uplink
    rate. The best fidelity predicted within the budget wins (raw, then the qualities in
    order); if none fits, the fastest. Until the link has been measured, the best JPEG quality
    goes first (a small upload that measures the link without risking a raw one on a slow link).

    Args:
        budget_s: the latency budget in seconds.
        qualities: candidate qualities, best first.
        window: uplink samples kept (their median is the estimate: one stall does not swing it).
    """

    # Until measured: a camera frame at quality 90 is roughly this fraction of its raw size, and
    # JPEG costs this many seconds per raw byte to encode and decode (libjpeg-turbo, one core).
    _PRIOR_RATIO = 0.12
    _PRIOR_CODEC_S_PER_BYTE = 8e-9
    # How a frame's JPEG size moves with the quality, relative to quality 90 (libjpeg-turbo on
    # rendered camera frames); scales a measured quality's size to an unmeasured one.
    _SIZE_CURVE = ((100, 2.6), (95, 1.32), (90, 1.0), (85, 0.85), (80, 0.76), (70, 0.66), (60, 0.58), (50, 0.53), (1, 0.3))

    def __init__(self, budget_s: float, qualities: tuple[int, ...] = DEFAULT_QUALITIES, window: int = 8) -> None:
        self.budget_s = budget_s
        self.qualities = tuple(sorted(set(qualities), reverse=True))
        self._rates: deque[float] = deque(maxlen=window)
        self._ratio: dict[int, float] = {}
        self._codec_s_per_byte = self._PRIOR_CODEC_S_PER_BYTE

    @property
    def uplink_bytes_per_s(self) -> float | None:
        """The current estimate (``None`` before the first measurement)."""
        return statistics.median(self._rates) if self._rates else None

    @classmethod
    def _size_factor(cls, quality: int) -> float:
        """The typical size at ``quality`` relative to quality 90 (linear between the curve's points)."""
        curve = cls._SIZE_CURVE
        for (q_hi, f_hi), (q_lo, f_lo) in zip(curve, curve[1:], strict=False):
            if q_lo <= quality <= q_hi:
                return f_lo + (f_hi - f_lo) * (quality - q_lo) / (q_hi - q_lo)
        return curve[-1][1]

    def _ratio_of(self, quality: int) -> float:
        known = self._ratio.get(quality)
        if known is not None:
            return known
        # An unmeasured quality: the nearest measured one's size scaled along the typical curve
        # (so a lower quality is tried when the measured one does not fit), else the prior.
        if self._ratio:
            nearest = min(self._ratio, key=lambda q: abs(q - quality))
            return self._ratio[nearest] * self._size_factor(quality) / self._size_factor(nearest)
        return self._PRIOR_RATIO * self._size_factor(quality)

    def predict_s(self, quality: int | None, raw_bytes: int) -> float:
        """Predicted seconds for one observation of ``raw_bytes`` sent at ``quality`` (``None``: raw)."""
        rate = self.uplink_bytes_per_s
        if rate is None:
            return math.inf if quality is None else 0.0
        if quality is None:
            return raw_bytes / rate
        return raw_bytes * (self._codec_s_per_byte + self._ratio_of(quality) / rate)

    def choose(self, raw_bytes: int) -> int | None:
        """The quality to send the next observation at; ``None`` for raw."""
        if self.uplink_bytes_per_s is None:
            return self.qualities[0]
        options: list[int | None] = [None, *self.qualities]
        for option in options:
            if self.predict_s(option, raw_bytes) <= self.budget_s:
                return option
        return min(options, key=lambda o: self.predict_s(o, raw_bytes))

    def observe(self, quality: int | None, raw_bytes: int, payload_bytes: int, sent_bytes: int, transit_s: float,
                codec_s: float) -> None:
        """One finished request: what was chosen and what it cost.

        Args:
            quality: the choice (``None``: raw).
            raw_bytes: the compressible fields' raw size.
            payload_bytes: their size as sent.
            sent_bytes: the whole message's size.
            transit_s: send start to reply, less the server's own time.
            codec_s: the client's compression plus the server's decode of the fields.
        """
        if transit_s > 0 and sent_bytes > 0:
            self._rates.append(sent_bytes / transit_s)
        if quality is not None and raw_bytes > 0:
            ratio = payload_bytes / raw_bytes
            old = self._ratio.get(quality)
            self._ratio[quality] = ratio if old is None else 0.7 * old + 0.3 * ratio
            per_byte = max(codec_s, 0.0) / raw_bytes
            self._codec_s_per_byte = 0.7 * self._codec_s_per_byte + 0.3 * per_byte


@dataclasses.dataclass(frozen=True, slots=True)
class Compressed:
    """An observation with its planned fields compressed, and what it took."""

    obs: dict[str, Any]
    seconds: float
    raw_bytes: int
    payload_bytes: int
    label: str


def _replace(obs: Mapping[str, Any], values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A copy of ``obs`` with the flattened names in ``values`` replaced (containers copied, arrays not)."""
    out: dict[str, Any] = {}
    for key, value in obs.items():
        name = f"{prefix}{key}"
        if name in values:
            out[key] = values[name]
        elif isinstance(value, Mapping):
            out[key] = _replace(value, values, f"{name}/")
        else:
            out[key] = value
    return out


def _encode_or_raw(arr: np.ndarray, plan: FieldPlan) -> np.ndarray | EncodedArray:
    """The field compressed, or as it is when compression would not make it smaller (noise)."""
    encoded = encode_array(arr, plan.encoding, plan.quality or 90)
    return encoded if len(encoded.payload) < arr.nbytes else arr


class FieldCompressor:
    """Worker threads that compress the planned fields of one observation in parallel.

    Args:
        workers: threads.
    """

    def __init__(self, workers: int = 4) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="chunkline-encode")

    def submit(self, obs: Mapping[str, Any], plans: Mapping[str, FieldPlan]) -> dict[str, concurrent.futures.Future[Any]]:
        """Start compressing ``obs``'s planned fields; one future per field."""
        arrays = dict(iter_arrays(obs))
        return {name: self._pool.submit(_encode_or_raw, arrays[name], plan) for name, plan in plans.items() if name in arrays}

    @staticmethod
    def assemble(obs: Mapping[str, Any], plans: Mapping[str, FieldPlan], results: Mapping[str, Any], started: float) -> Compressed:
        """The compressed observation from the finished fields (``started``: ``time.perf_counter()``
        when :meth:`submit` was called)."""
        seconds = time.perf_counter() - started
        raw = sum(int(v.raw_nbytes) if isinstance(v, EncodedArray) else int(v.nbytes) for v in results.values())
        payload = sum(len(v.payload) if isinstance(v, EncodedArray) else int(v.nbytes) for v in results.values())
        labels = sorted({plans[n].label() if isinstance(v, EncodedArray) else RAW for n, v in results.items()})
        return Compressed(_replace(obs, results) if results else dict(obs), seconds, raw, payload, "+".join(labels) or RAW)

    def compress(self, obs: Mapping[str, Any], plans: Mapping[str, FieldPlan]) -> Compressed:
        """Compress and wait (the calling thread blocks; the work runs on the pool's threads)."""
        started = time.perf_counter()
        futures = self.submit(obs, plans)
        return self.assemble(obs, plans, {name: f.result() for name, f in futures.items()}, started)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
