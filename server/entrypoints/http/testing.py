"""A text service with its own serving core, started on a loop thread and served on loopback,
for tests and benchmarks (no pytest dependency)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from pathlib import Path

from chunkline.server.core.auth import Authenticator, NoAuth
from chunkline.server.core.ledger import Ledger
from chunkline.server.core.loopthread import LoopThread
from chunkline.server.core.metrics import Metrics
from chunkline.server.core.quotas import QuotaManager
from chunkline.server.core.serving import ServingCore
from chunkline.server.core.tenants import TenantRegistry
from chunkline.server.entrypoints.http.openai_app import OpenAIApi
from chunkline.server.entrypoints.http.server import HttpLimits, HttpServer
from chunkline.server.text.config import TextModelConfig
from chunkline.server.text.service import TextService

__all__ = ["ServiceHandle"]


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
