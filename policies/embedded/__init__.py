"""Embedded policies: ``loadtest`` (weight-bound MLP head), ``loadtest-compute`` (compute-bound
transformer), and the zero-action ``noop``, ``sleep:S`` and ``fail``, on the ALOHA-like spec.

Weights are generated from a seed (nothing is downloaded) and run identically on torch, JAX
and numpy. Importing this package imports numpy only; :func:`build_embedded` imports the
chosen framework.
"""

from __future__ import annotations

from .build import BACKENDS, build_embedded
from .config import ComputeConfig, EmbeddedConfig, LoadtestConfig, config_from_dict, config_to_dict
from .noop import FailingPolicy, NoopPolicy, SleepPolicy
from .spec import ALOHA_CAMERAS, aloha_spec, camera_key
from .weights import EmbeddedWeights, default_weights, generate_weights, load_weights, save_weights

__all__ = [
    "BACKENDS",
    "build_embedded",
    "LoadtestConfig",
    "ComputeConfig",
    "EmbeddedConfig",
    "config_from_dict",
    "config_to_dict",
    "NoopPolicy",
    "SleepPolicy",
    "FailingPolicy",
    "ALOHA_CAMERAS",
    "aloha_spec",
    "camera_key",
    "EmbeddedWeights",
    "generate_weights",
    "default_weights",
    "save_weights",
    "load_weights",
]
