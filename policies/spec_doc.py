"""A :class:`PolicySpec` from a plain document (a TOML table), or inferred from one example observation.

Policies that do not declare what they accept (openpi policy objects) get their spec from the
server's configuration, ``[policies.spec]``: ``dt`` (always needed), ``horizon``, ``action_dim``,
``observation.<field> = { shape, dtype }`` or ``{ kind = "text" }``, or ``example`` (a ``.npz``
whose names use ``/`` for nesting: its fields, and one ``infer`` call gives horizon and action_dim),
and ``nest`` (hand ``infer()`` nested maps). docs/policies.md has a complete example."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .base import ArraySpec, FieldSpec, PolicySpec, TextSpec, flatten_observation
from .exceptions import PolicyLoadError

__all__ = ["spec_from_doc", "fields_from_example", "load_example"]

_SPEC_KEYS = {"observation", "action_dim", "horizon", "dt", "action_offset", "valid_for", "default_deadline_ms", "example", "nest"}


def _field(name: str, doc: Mapping[str, Any]) -> FieldSpec:
    kind = doc.get("kind", "array")
    try:
        if kind == "text":
            return TextSpec(max_chars=int(doc.get("max_chars", 2048)), required=bool(doc.get("required", False)))
        if kind != "array":
            raise ValueError(f"kind must be 'array' or 'text', got {kind!r}")
        shape = tuple(None if d is None or d == -1 else int(d) for d in doc["shape"])
        return ArraySpec(shape=shape, dtype=np.dtype(doc["dtype"]).name, required=bool(doc.get("required", True)))
    except (KeyError, TypeError, ValueError) as exc:
        raise PolicyLoadError(f"spec field {name!r}: {exc!s} (want shape and dtype, or kind = 'text')") from exc


def fields_from_example(example: Mapping[str, Any]) -> dict[str, FieldSpec]:
    """Field specs from one observation: arrays by their exact shape and dtype, strings as
    optional text; nested maps flattened with ``/``."""
    out: dict[str, FieldSpec] = {}
    for name, value in flatten_observation(example).items():
        if isinstance(value, str):
            out[name] = TextSpec(required=False)
        else:
            arr = np.asarray(value)
            if arr.dtype.kind not in "biuf":
                raise PolicyLoadError(f"example field {name!r} has dtype {arr.dtype}; only numbers, booleans and strings travel")
            out[name] = ArraySpec(shape=tuple(arr.shape), dtype=arr.dtype.name)
    return out


def load_example(path: str) -> dict[str, Any]:
    """An example observation from a ``.npz`` (string fields as 0-d unicode arrays)."""
    try:
        with np.load(path, allow_pickle=False) as data:
            return {k: (str(data[k]) if data[k].dtype.kind == "U" else data[k]) for k in data.files}
    except (OSError, ValueError) as exc:
        raise PolicyLoadError(f"cannot read the example observation {path!r}: {exc}") from exc


def spec_from_doc(doc: Mapping[str, Any] | None, example: Mapping[str, Any] | None = None,
                  infer: Callable[[Mapping[str, Any]], Any] | None = None) -> PolicySpec:
    """The spec ``doc`` describes, its gaps filled from ``example`` (``doc["example"]`` if set).

    Args:
        doc: the ``[policies.spec]`` table (see the module docstring); ``dt`` is required.
        example: an example observation (flat or nested).
        infer: ``infer(example) -> {"actions": [H, A]}``, called once if ``horizon`` or
            ``action_dim`` is missing.

    Raises:
        PolicyLoadError: unknown keys, no ``dt``, or gaps nothing fills.
    """
    doc = dict(doc or {})
    unknown = sorted(set(doc) - _SPEC_KEYS)
    if unknown:
        raise PolicyLoadError(f"unknown spec keys {unknown}; known: {sorted(_SPEC_KEYS)}")
    if "dt" not in doc:
        raise PolicyLoadError("the spec needs dt (seconds between actions): policies do not record their control rate")
    if "example" in doc:
        example = load_example(str(doc["example"]))
    if "observation" in doc:
        observation = {name: _field(name, f) for name, f in dict(doc["observation"]).items()}
    elif example is not None:
        observation = fields_from_example(example)
    else:
        raise PolicyLoadError("the spec needs observation fields, or an example observation to infer them from")
    horizon, action_dim = doc.get("horizon"), doc.get("action_dim")
    if horizon is None or action_dim is None:
        if example is None or infer is None:
            raise PolicyLoadError("the spec needs horizon and action_dim, or an example observation to measure them on")
        result = infer(example)
        actions = np.asarray(result.get("actions") if isinstance(result, Mapping) else None)
        if actions.ndim != 2:
            raise PolicyLoadError(f"infer(example) must return {{'actions': [H, A]}}, got actions of shape {list(actions.shape)}")
        horizon = horizon if horizon is not None else actions.shape[0]
        action_dim = action_dim if action_dim is not None else actions.shape[1]
    try:
        return PolicySpec(observation=observation, action_dim=int(action_dim), horizon=int(horizon), dt=float(doc["dt"]),
                          action_offset=float(doc.get("action_offset", 0.0)),
                          valid_for=None if doc.get("valid_for") is None else float(doc["valid_for"]),
                          default_deadline_ms=float(doc.get("default_deadline_ms", 1000.0)))
    except (TypeError, ValueError) as exc:
        raise PolicyLoadError(f"bad spec: {exc}") from exc
