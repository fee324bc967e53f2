"""Helpers for tests and benchmarks of the text class (no pytest dependency): a gate that holds
the engine between steps, a small model, a registry with fresh keys.

A served text service on loopback (its HTTP API included) is
:class:`chunkline.server.entrypoints.http.testing.ServiceHandle`; the text class does not build
front-ends.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Mapping
from typing import Any, TypeVar

from chunkline.server.core.tenants import KeyRecord, TenantInfo, TenantRegistry, generate_key, key_id
from chunkline.server.text.config import TextModelConfig

__all__ = ["StepGate", "small_model", "registry_with_keys"]

T = TypeVar("T")


class StepGate:
    """A ``yield_to`` gate for tests: lets a chosen number of engine steps run, then holds the engine.

    The engine asks the gate before every step while it has work; each "go" uses up one allowed
    step. Open by default.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._allowed = math.inf
        self.asked = 0

    def __call__(self, priority: int) -> bool:
        """``True`` (hold) once the allowed steps are used up."""
        with self._lock:
            self.asked += 1
            if self._allowed > 0:
                self._allowed -= 1
                return False
            return True

    def open(self) -> None:
        """Let every step run."""
        with self._lock:
            self._allowed = math.inf

    def close(self) -> None:
        """Hold the engine before its next step."""
        self.allow(0)

    def allow(self, steps: int) -> None:
        """Let exactly ``steps`` more steps run, then hold."""
        with self._lock:
            self._allowed = steps


def small_model(name: str = "tiny", **overrides: Any) -> TextModelConfig:
    """An embedded model small enough for fast tests (width 64, 2 layers, context 256).

    Args:
        name: its name.
        overrides: any :class:`TextModelConfig` field.
    """
    base: dict[str, Any] = {"name": name, "d_model": 64, "n_layers": 2, "n_heads": 2, "d_ff": 128, "context": 256,
                            "max_prompt_tokens": 192, "max_output_tokens": 64, "default_max_tokens": 16, "max_batch": 4}
    base.update(overrides)
    return TextModelConfig(**base)


def registry_with_keys(tenants: Mapping[str, TenantInfo]) -> tuple[TenantRegistry, dict[str, str]]:
    """A registry holding ``tenants``, each with one fresh API key.

    Args:
        tenants: name to tenant.

    Returns:
        ``(registry, keys)`` with ``keys[name]`` the tenant's key.
    """
    keys = {name: generate_key() for name in tenants}
    records = tuple(KeyRecord(hashlib.sha256(k.encode()).digest(), name, key_id(k)) for name, k in keys.items())
    return TenantRegistry(dict(tenants), records, "test"), keys
