"""Helpers to run text services on loopback, for tests and benchmarks (no pytest dependency).

:class:`LoopThread` runs an asyncio loop on a daemon thread, so that blocking clients (the
``openai`` package, ``httpx``) can talk to services on that loop from the calling thread.
:class:`ServiceHandle` builds a :class:`~chunkline.server.text.service.TextService` with its own
authenticator, quotas, metrics and (optionally) ledger, starts it there and serves its HTTP API.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import math
import threading
import time
from collections.abc import Coroutine, Mapping
from pathlib import Path
from typing import Any, TypeVar

from chunkline.server.core.auth import Authenticator, NoAuth
from chunkline.server.core.ledger import Ledger
from chunkline.server.core.metrics import Metrics
from chunkline.server.core.quotas import QuotaManager
from chunkline.server.core.tenants import KeyRecord, TenantInfo, TenantRegistry, generate_key, key_id
from chunkline.server.text.config import TextModelConfig
from chunkline.server.text.service import TextService

__all__ = ["LoopThread", "ServiceHandle", "StepGate", "small_model", "registry_with_keys"]

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


class LoopThread:
    """An event loop on its own daemon thread.

    Args:
        name: the thread's name.
    """

    def __init__(self, name: str = "text-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = 60.0) -> T:
        """Run ``coro`` on the loop and wait for its result.

        Args:
            coro: the coroutine.
            timeout: most seconds to wait.
        """
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coro`` on the loop; returns a future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        """Stop the loop and join its thread."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5.0)
        if not self.loop.is_running():
            self.loop.close()


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
    """A started :class:`TextService` with its own core objects, served on loopback.

    Args:
        models: the text models.
        loop: where to run (a :class:`LoopThread`).
        registry: tenants and keys (``None``: ``--no-auth``).
        ledger_path: a ledger file, or ``None`` for no ledger.
        yield_to: passed to the service.
    """

    def __init__(self, models: list[TextModelConfig], loop: LoopThread, registry: TenantRegistry | None = None,
                 ledger_path: Path | None = None, yield_to: Any = None, clock: Any = time.perf_counter) -> None:
        self.loop = loop
        self.auth: Authenticator | NoAuth = NoAuth() if registry is None else Authenticator(registry, time.monotonic)
        self.quotas = QuotaManager(self.auth.registry)
        self.metrics = Metrics()
        self.ledger = Ledger(ledger_path, max_age_s=0.05) if ledger_path is not None else None
        self.service = TextService(auth=self.auth, quotas=self.quotas, metrics=self.metrics, ledger=self.ledger,
                                   models=models, yield_to=yield_to, clock=clock)
        self.port = 0

    def start(self) -> ServiceHandle:
        """Start the service and its HTTP listener."""
        async def boot() -> int:
            await self.service.start()
            return await self.service.serve_http("127.0.0.1", 0)

        self.port = self.loop.run(boot(), timeout=120.0)
        return self

    @property
    def base_url(self) -> str:
        """The OpenAI API base URL (``http://127.0.0.1:<port>/v1``)."""
        return f"http://127.0.0.1:{self.port}/v1"

    def close(self) -> None:
        """Stop the service; close the ledger."""
        try:
            self.loop.run(self.service.stop(), timeout=30.0)
        except concurrent.futures.TimeoutError:
            # Say what is stuck before failing: the loop's tasks and where each one waits.
            async def tasks() -> str:
                out = []
                for task in asyncio.all_tasks():
                    out.append(repr(task))
                    out.extend(f"    {f.f_code.co_filename}:{f.f_lineno} {f.f_code.co_name}" for f in task.get_stack())
                return "\n".join(out)

            raise RuntimeError("the text service did not stop within 30 s; tasks:\n" + self.loop.run(tasks(), timeout=5.0)) from None
        if self.ledger is not None:
            self.ledger.close()

    def metric(self, name: str, **labels: str) -> float:
        """A sample's value from the service's metrics registry (0 when absent)."""
        value = self.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else float(value)
