"""chunkline policies: the :class:`Policy` interface, backends and embedded policies.

Importing this package imports numpy only. The torch and JAX backends (and torch or jax
themselves) load on first use of :class:`TorchPolicy` / :class:`JaxPolicy` or of a policy
built on them, so robot-side code and numpy-only servers never pay for them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .base import (
    ArraySpec,
    FieldSpec,
    ObservationError,
    Policy,
    PolicySpec,
    TextSpec,
    example_observation,
    make_fingerprint,
    stack_observations,
    validate_observation,
)
from .exceptions import (
    InjectedPolicyFailure,
    PolicyConfigError,
    PolicyError,
    PolicyLoadError,
    PolicyNotFound,
    PolicyOutputError,
    UnregisteredProcessorStep,
    WeightsFormatError,
)
from .numpy_backend import NumpyPolicy
from .openpi_adapter import OpenPIPolicy
from .outputs import check_actions, check_chunk
from .registry import default_backend, list_policies, load_policy

if TYPE_CHECKING:  # pragma: no cover
    from .jax_backend import JaxPolicy
    from .torch_backend import TorchPolicy

__all__ = [
    "ArraySpec",
    "TextSpec",
    "FieldSpec",
    "PolicySpec",
    "Policy",
    "ObservationError",
    "validate_observation",
    "stack_observations",
    "example_observation",
    "make_fingerprint",
    "PolicyError",
    "PolicyNotFound",
    "PolicyLoadError",
    "UnregisteredProcessorStep",
    "PolicyConfigError",
    "WeightsFormatError",
    "PolicyOutputError",
    "InjectedPolicyFailure",
    "check_actions",
    "check_chunk",
    "NumpyPolicy",
    "OpenPIPolicy",
    "TorchPolicy",
    "JaxPolicy",
    "load_policy",
    "list_policies",
    "default_backend",
]

# Exported names whose module imports a heavy framework: resolved on first access.
_LAZY = {"TorchPolicy": ".torch_backend", "JaxPolicy": ".jax_backend"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # later lookups skip this hook
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
