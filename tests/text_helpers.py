"""Text-class helpers for tests: a gate that holds the engine between steps, a small model, a
registry with fresh keys, and a text service with its own serving core served on loopback."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import math
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from chunkline.server.core.auth import Authenticator, NoAuth
from chunkline.server.core.ledger import Ledger
from chunkline.server.core.loopthread import LoopThread
from chunkline.server.core.metrics import Metrics
from chunkline.server.core.quotas import QuotaManager
from chunkline.server.core.serving import ServingCore
from chunkline.server.core.tenants import KeyRecord, TenantInfo, TenantRegistry, generate_key, key_id
from chunkline.server.entrypoints.http.openai_app import OpenAIApi
from chunkline.server.entrypoints.http.server import HttpLimits, HttpServer
from chunkline.server.text.config import TextModelConfig
from chunkline.server.text.service import TextService


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


class ServiceHandle:
    """A started :class:`TextService` with its own :class:`ServingCore`, its HTTP API on loopback.

    Args:
        models: the text models.
        loop: where to run.
        registry: tenants and keys (``None``: ``--no-auth``).
        ledger_path: a ledger file, or ``None`` for no ledger.
        yield_to: passed to the service.
        clock: the service's clock.
        limits: the HTTP listener's limits.
    """

    def __init__(self, models: list[TextModelConfig], loop: LoopThread, registry: TenantRegistry | None = None,
                 ledger_path: Path | None = None, yield_to: Callable[[int], bool] | None = None,
                 clock: Callable[[], float] = time.perf_counter, limits: HttpLimits | None = None) -> None:
        self.loop = loop
        self.core = ServingCore(registry if registry is not None else TenantRegistry.anonymous(), authenticate=registry is not None,
                                ledger_path=ledger_path)
        self.service = TextService(self.core, models=models, yield_to=yield_to, clock=clock)
        self.http = HttpServer(OpenAIApi(self.service), limits,
                               on_refused=lambda reason: self.core.metrics.observe_connection_refused("http", reason))
        self.port = 0

    @property
    def auth(self) -> Authenticator | NoAuth:
        return self.core.auth

    @property
    def quotas(self) -> QuotaManager:
        return self.core.quotas

    @property
    def metrics(self) -> Metrics:
        return self.core.metrics

    @property
    def ledger(self) -> Ledger | None:
        return self.core.ledger

    def start(self) -> ServiceHandle:
        """Start the service and its HTTP listener."""
        async def boot() -> int:
            await self.service.start()
            return await self.http.start("127.0.0.1", 0)

        self.port = self.loop.run(boot(), timeout=120.0)
        return self

    @property
    def base_url(self) -> str:
        """The OpenAI API base URL (``http://127.0.0.1:<port>/v1``)."""
        return f"http://127.0.0.1:{self.port}/v1"

    def close(self) -> None:
        """Drain and stop the listener and the service; close the ledger."""
        async def stop() -> None:
            self.core.draining = True
            await self.http.close()
            await self.service.stop()

        try:
            self.loop.run(stop(), timeout=30.0)
        except concurrent.futures.TimeoutError:
            # Say what is stuck before failing: the loop's tasks and where each one waits.
            async def tasks() -> str:
                out = []
                for task in asyncio.all_tasks():
                    out.append(repr(task))
                    out.extend(f"    {f.f_code.co_filename}:{f.f_lineno} {f.f_code.co_name}" for f in task.get_stack())
                return "\n".join(out)

            raise RuntimeError("the text service did not stop within 30 s; tasks:\n" + self.loop.run(tasks(), timeout=5.0)) from None
        self.core.close()

    def metric(self, name: str, **labels: str) -> float:
        """A sample's value from the service's metrics registry (0 when absent)."""
        value = self.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else float(value)
