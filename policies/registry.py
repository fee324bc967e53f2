"""Resolve a policy reference to a loaded :class:`~chunkline.policies.base.Policy`.

A reference is an embedded name (``noop``, ``loadtest``, ``loadtest-compute``, ``fail``,
``sleep:<seconds>``, the closed-loop policies ``reach-expert``, ``track7-expert``, ``reach-bc``,
``reach-flow``, with backend suffixes such as ``-jax``), a path to an ``.npz`` of
:func:`~chunkline.policies.embedded.weights.save_weights`, ``module:factory`` (a :class:`Policy` or
an openpi-style object wrapped in :class:`OpenPIPolicy`; the module is also looked up in the
current directory), or ``lerobot:PATH``. Only ``module:factory`` and ``lerobot:`` take arguments;
``jpeg=Q`` applies to every policy. Nothing here imports torch or jax until a policy on that
backend is built."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import math
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from chunkline.client.wire.encodings import JPEG, unfit_reason

from .base import ArraySpec, Policy, PolicySpec
from .exceptions import PolicyLoadError, PolicyNotFound

__all__ = ["load_policy", "allow_jpeg", "respecify", "check_reference", "list_policies", "default_backend",
           "EMBEDDED_MODELS", "TASK_POLICIES"]

#: embedded models with weights, each servable on every backend.
EMBEDDED_MODELS: tuple[str, ...] = ("loadtest", "loadtest-compute")
#: the closed-loop tasks' policies (chunkline.policies.embedded.tasks / .bc).
TASK_POLICIES: tuple[str, ...] = ("reach-expert", "track7-expert", "reach-bc", "reach-flow")
_BACKENDS = ("torch", "jax", "numpy")
#: task policies with weights, named with a backend suffix too (``reach-bc-jax``, ``reach-flow-torch``).
_LEARNED = ("reach-bc", "reach-flow")
_SIMPLE = ("noop", "fail")
_FACTORY_RE = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


def list_policies() -> list[str]:
    """The names :func:`load_policy` knows (``sleep:<seconds>`` stands for any duration)."""
    return ["noop", *EMBEDDED_MODELS, *TASK_POLICIES, "fail", "sleep:<seconds>"]


def default_backend() -> str:
    """``"torch"`` when torch is importable, else ``"numpy"`` (checked without importing it)."""
    return "torch" if importlib.util.find_spec("torch") is not None else "numpy"


def _split_backend(ref: str, backend: str | None) -> tuple[str, str | None]:
    for b in _BACKENDS:
        base = ref[: -len(b) - 1]
        if ref.endswith("-" + b) and (base in EMBEDDED_MODELS or base in _LEARNED):
            if backend is not None and backend != b:
                raise PolicyLoadError(f"{ref!r} names backend {b!r} but backend={backend!r} was asked for")
            return base, b
    return ref, backend


def _check_backend(backend: str | None) -> str:
    if backend is None:
        return default_backend()
    if backend not in _BACKENDS:
        raise PolicyLoadError(f"unknown backend {backend!r}; choose one of {', '.join(_BACKENDS)}")
    return backend


def _sleep_seconds(ref: str) -> float:
    text = ref.partition(":")[2]
    try:
        seconds = float(text)
    except ValueError:
        raise PolicyNotFound(ref, list_policies()) from None
    if not (math.isfinite(seconds) and seconds >= 0):
        raise PolicyLoadError(f"sleep duration must be a finite number >= 0, got {text!r}")
    return seconds


def _require(module: str, extra: str, what: str) -> None:
    """A one-line :class:`PolicyLoadError` naming the extra to install when ``module`` is missing."""
    if importlib.util.find_spec(module) is None:
        raise PolicyLoadError(f"{what} needs {module}, which is not installed in this environment; "
                              f"install the '{extra}' extra: pip install -e '.[server,{extra}]' in a chunkline checkout")


def check_reference(ref: str, backend: str | None = None) -> None:
    """Raise what :func:`load_policy` would for a reference it cannot understand (or a weights
    file that is not there), without loading anything: a command line checks its ``--policy``
    flags with it before it starts a server.

    Raises:
        PolicyNotFound: ``ref`` is none of the forms.
        PolicyLoadError: a backend that contradicts the name, or no file at an ``.npz`` path.
    """
    if ref.startswith("lerobot:"):
        if not os.path.isdir(ref.partition(":")[2]):
            raise PolicyLoadError(f"no LeRobot checkpoint folder at {ref.partition(':')[2]!r}")
        for module in ("torch", "lerobot"):
            _require(module, "lerobot", "a LeRobot checkpoint")
        return
    name, backend = _split_backend(ref, backend)
    if backend is not None:
        _check_backend(backend)
        if backend != "numpy":
            _require(backend, backend, f"backend {backend!r}")
    if name in EMBEDDED_MODELS or name in TASK_POLICIES or name in _SIMPLE:
        return
    if name.startswith("sleep:"):
        _sleep_seconds(name)
        return
    if name.endswith(".npz") and not os.path.isfile(name):
        raise PolicyLoadError(f"no weights file at {name!r}")
    if os.path.isfile(name) or name.endswith(".npz") or _FACTORY_RE.fullmatch(name):
        return
    raise PolicyNotFound(ref, list_policies())


def load_policy(ref: str, *, device: str = "cpu", backend: str | None = None, args: Mapping[str, Any] | None = None,
                spec: Mapping[str, Any] | None = None) -> Policy:
    """Load the policy ``ref`` names (see the module docstring for the forms).

    Args:
        ref: a name, a path to an ``.npz``, ``module:factory`` or ``lerobot:PATH``.
        device: where to run (``"cpu"``, ``"cuda:0"``, ...). Ignored by ``noop``, ``fail`` and
            ``sleep``; the numpy backend runs on ``"cpu"`` only.
        backend: ``"torch"``, ``"jax"`` or ``"numpy"`` for embedded models and ``.npz`` files;
            default: torch if importable, else numpy.
        args: keyword arguments of a factory or of the LeRobot loader (``fps``, ...).
        spec: a spec document for an openpi-style object (:func:`~chunkline.policies.spec_doc.spec_from_doc`).

    Returns:
        The policy, not yet warmed up (call :meth:`Policy.warmup`).

    Raises:
        PolicyNotFound: ``ref`` is none of the forms (the message lists the names).
        PolicyLoadError: the reference was understood but loading failed (its subclass
            ``WeightsFormatError`` for a bad weights file).
    """
    args = dict(args or {})
    jpeg = args.pop(JPEG_ARG, None)
    policy = _load(ref, device, backend, args, spec)
    if jpeg is not None:
        respecify(policy, allow_jpeg(policy.spec, _jpeg_quality(jpeg), repr(ref)))
    return policy


def respecify(policy: Policy, spec: PolicySpec) -> None:
    """``policy`` serves ``spec`` instead of the spec it computed its fingerprint from, and its
    fingerprint folds the new spec in: a client that compares fingerprints must see that this
    server lets cameras travel as JPEG. Everything else is the policy's own (its class becomes a
    subclass that overrides ``fingerprint`` alone)."""
    doc = {"fingerprint": policy.fingerprint, "spec": spec.to_wire()}
    served = "sha256:" + hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:16]
    policy.spec = spec
    policy.__class__ = _respecified_class(type(policy))
    vars(policy)[_SERVED_FINGERPRINT] = served


_SERVED_FINGERPRINT = "served_fingerprint"


@functools.cache
def _respecified_class(cls: type[Policy]) -> type[Policy]:
    if getattr(cls, "_respecified", False):
        return cls
    fingerprint = property(lambda self: vars(self)[_SERVED_FINGERPRINT], doc=Policy.fingerprint.__doc__)
    return type(cls.__name__, (cls,), {"__slots__": (), "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                       "_respecified": True, "fingerprint": fingerprint})


#: the ``--policy-arg`` (``[policies.args]`` key) every policy takes: its camera fields may travel as JPEG
JPEG_ARG = "jpeg"


def _jpeg_quality(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 100:
        raise PolicyLoadError(f"{JPEG_ARG}={value!r}: give the lowest JPEG quality the policy tolerates, 1 to 100 (e.g. jpeg=80)")
    return value


def allow_jpeg(spec: PolicySpec, quality: int, what: str = "the policy") -> PolicySpec:
    """``spec`` with every camera field (uint8 ``[H, W, 3]`` or ``[H, W, 1]``) allowed to travel as
    JPEG at quality ``quality`` or better; the others stay as they are.

    Raises:
        PolicyLoadError: no field is a camera frame.
    """
    fields: dict[str, Any] = {}
    for name, field in spec.observation.items():
        if isinstance(field, ArraySpec) and unfit_reason(JPEG, np.dtype(field.dtype), field.shape) is None:
            field = dataclasses.replace(field, encodings=tuple(dict.fromkeys((*field.encodings, JPEG))), jpeg_min_quality=quality)
        fields[name] = field
    if fields == dict(spec.observation):
        raise PolicyLoadError(f"{JPEG_ARG}={quality}: {what} has no camera field (uint8 [H, W, 3]) that JPEG could carry")
    return dataclasses.replace(spec, observation=fields)


def _load(ref: str, device: str, backend: str | None, args: dict[str, Any], spec: Mapping[str, Any] | None) -> Policy:
    if ref.startswith("lerobot:"):
        from .factories import call_with_arguments
        from .lerobot_policy import load_lerobot

        return call_with_arguments(functools.partial(load_lerobot, ref.partition(":")[2]), repr(ref), args, device)
    if _FACTORY_RE.fullmatch(ref) and not ref.startswith("sleep:"):
        from .factories import load_factory

        return load_factory(ref, device, args, spec)
    if args or spec:
        raise PolicyLoadError(f"{ref!r} takes no arguments or spec; only 'module:factory' and 'lerobot:PATH' do")
    name, backend = _split_backend(ref, backend)
    if name in EMBEDDED_MODELS:
        from .embedded.build import build_embedded
        from .embedded.weights import default_weights

        return build_embedded(default_weights(name), backend=_check_backend(backend), device=device, name=ref)
    if name in ("reach-expert", "track7-expert"):
        from .embedded import tasks

        return tasks.reach_expert() if name == "reach-expert" else tasks.track7_expert()
    if name == "reach-bc":
        from .embedded.bc import build_reach_bc

        return build_reach_bc(backend=_check_backend(backend), device=device, name=ref)
    if name == "reach-flow":
        from .embedded.flow_build import build_reach_flow

        # numpy has no automatic differentiation for the guidance: the flow policy defaults to
        # torch, and to JAX where torch is absent.
        if backend is None and default_backend() == "numpy" and importlib.util.find_spec("jax") is not None:
            backend = "jax"
        return build_reach_flow(backend=_check_backend(backend), device=device, name=ref)
    if name == "noop":
        from .embedded.noop import NoopPolicy

        return NoopPolicy()
    if name == "fail":
        from .embedded.noop import FailingPolicy

        return FailingPolicy()
    if name.startswith("sleep:"):
        from .embedded.noop import SleepPolicy

        return SleepPolicy(_sleep_seconds(name))
    if name.endswith(".npz") or os.path.isfile(name):
        if not os.path.isfile(name):
            raise PolicyLoadError(f"no weights file at {name!r}")
        from .embedded.build import build_embedded
        from .embedded.weights import load_weights

        stem = os.path.splitext(os.path.basename(name))[0]
        return build_embedded(load_weights(name), backend=_check_backend(backend), device=device, name=stem)
    raise PolicyNotFound(ref, list_policies())
