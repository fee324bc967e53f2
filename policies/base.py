"""The policy interface every backend implements, and observation validation against its spec.

A policy declares what it accepts (:class:`PolicySpec`) and how it behaves (its fingerprint);
the server validates every observation against the spec before any inference, stacks a batch
and calls :meth:`Policy.infer_batch` from a worker thread, never from the event loop.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import hashlib
import json
import math
import platform
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from chunkline.client.wire.encodings import JPEG, RAW, unfit_reason

from .prefix import PrefixBatch

__all__ = [
    "ArraySpec",
    "TextSpec",
    "FieldSpec",
    "PolicySpec",
    "Policy",
    "ObservationError",
    "validate_observation",
    "flatten_observation",
    "stack_observations",
    "make_fingerprint",
    "example_observation",
]


class ObservationError(ValueError):
    """An observation does not match the policy's spec. The message names the field, never its content."""


@dataclasses.dataclass(frozen=True)
class ArraySpec:
    """One array field of an observation.

    Args:
        shape: per-item shape; ``None`` for a dimension of any size.
        dtype: numpy dtype name (``"uint8"``, ``"float32"``, ...).
        required: whether the field must be present.
        cast: for float fields, accept any int/float dtype and convert (robots often send
            float64 state). Integer and bool fields must match exactly: a float image is a bug.
        encodings: how the field may travel (:mod:`chunkline.client.wire.encodings`): ``raw`` always,
            plus ``jpeg`` for uint8 camera frames the policy tolerates lossy, ``png`` for depth
            maps and masks (lossless). A client sends only what both this and its session allow.
        jpeg_min_quality: the lowest JPEG quality the policy was checked at; clients choosing a
            quality (the adaptive mode) never go below it.
    """

    shape: tuple[int | None, ...]
    dtype: str
    required: bool = True
    cast: bool = True
    encodings: tuple[str, ...] = (RAW,)
    jpeg_min_quality: int = 50

    def __post_init__(self) -> None:
        if RAW not in self.encodings:
            raise ValueError("every array field may travel raw: include 'raw' in encodings")
        for encoding in self.encodings:
            reason = unfit_reason(encoding, np.dtype(self.dtype), self.shape)
            if reason is not None:
                raise ValueError(f"encoding {encoding!r} does not fit a {self.dtype} field of shape {list(self.shape)}: {reason}")
        if not 1 <= self.jpeg_min_quality <= 100:
            raise ValueError(f"jpeg_min_quality must be 1 to 100, got {self.jpeg_min_quality}")

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"kind": "array", "shape": list(self.shape), "dtype": self.dtype, "required": self.required}
        if self.encodings != (RAW,):  # raw-only fields keep the metadata (and fingerprints) they always had
            wire["encodings"] = list(self.encodings)
            if JPEG in self.encodings:
                wire["jpeg_min_quality"] = self.jpeg_min_quality
        return wire


@dataclasses.dataclass(frozen=True)
class TextSpec:
    """A string field, e.g. the language instruction ``prompt``."""

    max_chars: int = 2048
    required: bool = False

    def to_wire(self) -> dict[str, Any]:
        return {"kind": "text", "max_chars": self.max_chars, "required": self.required}


FieldSpec = ArraySpec | TextSpec


_NO_DTYPE = np.dtype("V1")


class _Check(NamedTuple):
    """One field's checks (see :attr:`PolicySpec.checks`)."""

    name: str
    required: bool
    text: bool
    max_chars: int
    exact_shape: tuple[int, ...] | None  # when no dimension is free: compared as one tuple
    shape: tuple[int | None, ...]
    dtype: np.dtype[Any]
    casts: bool  # a float field that converts other int/float dtypes


@dataclasses.dataclass(frozen=True)
class PolicySpec:
    """What a policy accepts and returns.

    Args:
        observation: field name to spec.
        action_dim: ``A``, the width of one action.
        horizon: ``H``, actions per chunk.
        dt: seconds between consecutive actions (the control period the policy was trained at).
        action_offset: seconds from ``obs_time`` to the due time of the first action.
        valid_for: seconds after ``t0`` for which the chunk may run (``expires = t0 + valid_for``);
            defaults to ``horizon * dt``.
        default_deadline_ms: deadline for requests that carry none (openpi-compatible mode).
    """

    observation: Mapping[str, FieldSpec]
    action_dim: int
    horizon: int
    dt: float
    action_offset: float = 0.0
    valid_for: float | None = None
    default_deadline_ms: float = 1000.0

    @property
    def validity(self) -> float:
        return self.valid_for if self.valid_for is not None else self.horizon * self.dt

    @functools.cached_property
    def checks(self) -> tuple[_Check, ...]:
        """What :func:`validate_observation` checks per field, worked out once per spec (dtype
        objects, exact shapes) rather than once per request."""
        out = []
        for name, field in self.observation.items():
            if isinstance(field, TextSpec):
                out.append(_Check(name, field.required, True, field.max_chars, None, (), _NO_DTYPE, False))
                continue
            want = np.dtype(field.dtype)
            exact = None if None in field.shape else tuple(int(d) for d in field.shape if d is not None)
            out.append(_Check(name, field.required, False, 0, exact, field.shape, want, want.kind == "f" and field.cast))
        return tuple(out)

    def to_wire(self) -> dict[str, Any]:
        return {
            "observation": {k: v.to_wire() for k, v in self.observation.items()},
            "action_dim": self.action_dim,
            "action_horizon": self.horizon,
            "dt": self.dt,
            "action_offset": self.action_offset,
            "valid_for": self.validity,
            "default_deadline_ms": self.default_deadline_ms,
        }


class Policy(abc.ABC):
    """A servable policy.

    Subclasses set :attr:`name` and :attr:`spec`, compute :attr:`fingerprint` at load and
    implement :meth:`infer_batch`. Arrays handed to :meth:`infer_batch` may be read-only views
    of network buffers: never write into them.
    """

    name: str
    spec: PolicySpec
    #: Policies that keep per-session state (history frames, RNG streams) set this and override
    #: :meth:`new_session_state` and :meth:`infer_batch_with_state`. The server keeps one state
    #: per session, never puts two requests of one session in the same batch, and frees the
    #: state when the session ends.
    stateful: bool = False

    @property
    @abc.abstractmethod
    def fingerprint(self) -> str:
        """A digest of everything that changes behaviour: weights, backend and library versions,
        precision, device, batching settings. Two deployments with equal fingerprints act alike."""

    @abc.abstractmethod
    def infer_batch(self, obs: Mapping[str, Any]) -> np.ndarray:
        """Run one forward pass.

        Args:
            obs: field name to a stacked array ``[B, *shape]`` (array fields) or a list of
                ``B`` strings (text fields; ``""`` where absent).

        Returns:
            ``[B, horizon, action_dim]`` float32 actions.
        """

    def new_session_state(self) -> Any:
        """The state of a new session (stateful policies only)."""
        return None

    def infer_batch_with_state(self, obs: Mapping[str, Any], states: Sequence[Any]) -> tuple[np.ndarray, list[Any]]:
        """Like :meth:`infer_batch`, with each item's session state; returns the actions and the
        updated states (one per item). Stateless policies ignore the states."""
        return self.infer_batch(obs), list(states)

    #: Policies that use the robot's prefix (real-time chunking) set this and override
    #: :meth:`infer_batch_with_prefix`; the server then stacks every request's prefix on its
    #: chunk's grid. Others are called through :meth:`infer_batch` / :meth:`infer_batch_with_state`.
    accepts_prefix: bool = False

    def infer_batch_with_prefix(self, obs: Mapping[str, Any], prefix: PrefixBatch,
                                states: Sequence[Any] | None) -> tuple[np.ndarray, list[Any] | None]:
        """Like :meth:`infer_batch_with_state`, with the batch's prefixes (:class:`PrefixBatch`:
        ``[B, H, A]`` actions on the chunk's grid, their mask and frozen rows). ``states`` is
        ``None`` for stateless policies. The default ignores the prefix."""
        if states is None:
            return self.infer_batch(obs), None
        return self.infer_batch_with_state(obs, states)

    def warmup(self) -> None:
        """Run the policy once on a zero observation so the first request pays no compile or
        allocation cost. Backends with several compiled batch sizes override this."""
        self.infer_batch(stack_observations(self.spec, [example_observation(self.spec)]))

    def metadata(self) -> dict[str, Any]:
        """What clients learn on connect (the openpi metadata frame, the native ``hello``)."""
        return {"name": self.name, "fingerprint": self.fingerprint, **self.spec.to_wire()}

    def close(self) -> None:  # noqa: B027 - optional hook: most policies hold nothing to release
        """Release devices and memory. The default does nothing."""


#: Float fields of at most this many elements (a robot's joint state) are checked for NaN and
#: infinity in Python; larger ones with numpy. On a request's path numpy's ufunc and reduction
#: machinery runs with cold caches: ``np.isfinite(x).all()`` on a 14-d state cost 10.9 us of the
#: reply's critical path more than this loop (in-process A/B; 0.9 us against 0.6 warm).
SMALL_FINITE_CHECK = 64


def all_finite(value: np.ndarray) -> bool:
    """Whether a float array holds neither NaN nor infinity."""
    if value.size <= SMALL_FINITE_CHECK:
        return all(map(math.isfinite, value.ravel().tolist()))
    return bool(np.isfinite(value).all())


def _dims_match(spec_shape: Sequence[int | None], shape: Sequence[int]) -> bool:
    return len(spec_shape) == len(shape) and all(s is None or s == d for s, d in zip(spec_shape, shape, strict=False))


def flatten_observation(obs: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Join nested maps' keys with ``/``: openpi examples send ``{"images": {"cam_high": ...}}``,
    specs name the field ``images/cam_high``. Flat observations come back unchanged."""
    if not prefix:
        for v in obs.values():  # a loop, not any(genexpr): this runs once per request
            # An array (most fields) is no Mapping: told by its type, without the ABC's
            # Python-level __instancecheck__.
            if type(v) is not np.ndarray and isinstance(v, Mapping):
                break
        else:
            return dict(obs)
    out: dict[str, Any] = {}
    for key, value in obs.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten_observation(value, f"{name}/"))
        else:
            out[name] = value
    return out


def validate_observation(spec: PolicySpec, obs: Mapping[str, Any]) -> dict[str, Any]:
    """Check an untrusted observation against ``spec`` and return the fields the policy reads.

    Fields the spec does not name are dropped. Float fields are converted to the spec's dtype
    when ``cast`` is set; everything else must match exactly.

    Raises:
        ObservationError: naming the first field at fault.
    """
    out: dict[str, Any] = {}
    for name, required, text, max_chars, exact_shape, shape, want, casts in spec.checks:
        value = obs.get(name)
        if value is None:
            if required:
                raise ObservationError(f"missing field {name!r}")
            continue
        # Exact type tests first: the usual str and ndarray are told without isinstance calls.
        if text:
            if type(value) is not str and not isinstance(value, str):
                raise ObservationError(f"field {name!r} must be a string, got {type(value).__name__}")
            if len(value) > max_chars:
                raise ObservationError(f"field {name!r} is longer than {max_chars} characters")
            out[name] = value
            continue
        if type(value) is not np.ndarray and not isinstance(value, np.ndarray):
            raise ObservationError(f"field {name!r} must be an array, got {type(value).__name__}")
        if value.shape != exact_shape if exact_shape is not None else not _dims_match(shape, value.shape):
            raise ObservationError(f"field {name!r} has shape {list(value.shape)}, expected {list(shape)}")
        if value.dtype != want:
            if casts and value.dtype.kind in "iuf":
                value = value.astype(want)
            elif value.dtype.newbyteorder("=") == want:  # same type, other byte order
                value = value.astype(want)
            else:
                raise ObservationError(f"field {name!r} has dtype {value.dtype.name}, expected {want.name}")
        if want.kind == "f" and not all_finite(value):
            raise ObservationError(f"field {name!r} contains NaN or infinity")
        out[name] = value
    return out


def stack_observations(spec: PolicySpec, items: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Stack validated observations into one batch (see :meth:`Policy.infer_batch`).

    Optional array fields absent from some items are filled with zeros; all items of a batch
    must agree on any ``None`` (free) dimension.

    Raises:
        ObservationError: items disagree on a free dimension.
    """
    batch: dict[str, Any] = {}
    if len(items) == 1:
        # One request (the common batch at low load): no shapes to agree, each array becomes a
        # view with a batch axis, and the per-field lists of the general path are not built.
        (item,) = items
        for check in spec.checks:
            name = check.name
            if check.text:
                batch[name] = [item.get(name, "")]
            elif name in item:
                batch[name] = item[name][np.newaxis]  # a view: no copy of the images
        return batch
    for name, field in spec.observation.items():
        if isinstance(field, TextSpec):
            batch[name] = [item.get(name, "") for item in items]
            continue
        present = [item[name] for item in items if name in item]
        if not present:
            continue
        shape = present[0].shape
        for a in present:  # a loop, not any(genexpr): no generator per field and batch
            if a.shape != shape:
                raise ObservationError(f"field {name!r} differs in shape across the batch")
        if len(present) == len(items):
            batch[name] = np.stack(present)
        else:
            zero = np.zeros(shape, dtype=field.dtype)
            batch[name] = np.stack([item.get(name, zero) for item in items])
    return batch


#: the side of a camera frame whose size the spec leaves free (``[None, None, 3]`` uint8): a 1x1
#: frame would time and exercise a vision policy on nothing.
EXAMPLE_FRAME_SIDE = 224


def _example_shape(field: ArraySpec) -> tuple[int, ...]:
    frame = field.dtype == "uint8" and len(field.shape) == 3 and field.shape[-1] in (1, 3, 4)
    return tuple((EXAMPLE_FRAME_SIDE if frame and i < 2 else 1) if d is None else d for i, d in enumerate(field.shape))


def example_observation(spec: PolicySpec, rng: np.random.Generator | None = None) -> dict[str, Any]:
    """An observation matching ``spec`` (zeros, or random values from ``rng``). Free dimensions get
    size 1, except a camera frame's height and width (uint8 ``H x W x C``), which get
    :data:`EXAMPLE_FRAME_SIDE`."""
    obs: dict[str, Any] = {}
    for name, field in spec.observation.items():
        if isinstance(field, TextSpec):
            obs[name] = "pick up the cube"
            continue
        shape = _example_shape(field)
        dtype = np.dtype(field.dtype)
        if rng is None:
            obs[name] = np.zeros(shape, dtype)
        elif dtype.kind == "f":
            obs[name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind == "b":
            obs[name] = rng.integers(0, 2, shape).astype(bool)
        else:
            info = np.iinfo(dtype)
            obs[name] = rng.integers(max(info.min, 0), min(info.max, 255), shape, dtype=dtype, endpoint=True)
    return obs


def make_fingerprint(
    *,
    weights: str,
    backend: str,
    versions: Mapping[str, str],
    precision: str,
    device: str,
    spec: PolicySpec,
    settings: Mapping[str, Any] | None = None,
) -> str:
    """Digest of everything that changes a policy's behaviour, as ``"sha256:<16 hex>"``.

    Args:
        weights: :func:`~chunkline.client.wire.fingerprint.weights_digest` of the parameters (or another content digest).
        backend: ``"torch"``, ``"jax"``, ``"numpy"``, ``"openpi"``, ...
        versions: library versions that affect numerics (torch, jax, numpy, ...).
        precision: ``"float32"``, ``"bfloat16"``, ...
        device: ``"cpu"``, ``"cuda:0"``, ...
        spec: the policy's spec (horizon, dt, offsets and observation fields all change behaviour).
        settings: anything else that matters (batching settings, compiled batch sizes, ...).
    """
    doc = {
        "weights": weights,
        "backend": backend,
        "versions": dict(sorted(versions.items())),
        "python": platform.python_version(),
        "precision": precision,
        "device": device,
        "spec": spec.to_wire(),
        "settings": dict(sorted((settings or {}).items())),
    }
    return "sha256:" + hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:16]
