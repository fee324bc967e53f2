"""The shared serving core: built once per server process and handed to every request class.

It holds what every class shares -- the tenant registry and authenticator, quotas, metrics,
accounting and the usage ledger -- and the rules every request passes before its class sees it
(:meth:`ServingCore.gate`): not while draining, only models and classes the tenant may use, and no
unrecorded work while a fail-closed ledger cannot be written. Request ids written to the ledger
come from one counter (:meth:`ServingCore.request_id`), unique across models and classes.

A request class (:class:`RequestClass`) plugs in by implementing a small interface the server
process drives: start, stop, in-flight count, health, and release of a closed session's state.
Adding a class touches neither the core nor another class.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from chunkline.client.wire.errors import ErrorCode
from chunkline.server.core.accounting import Accounting
from chunkline.server.core.auth import Authenticator, NoAuth
from chunkline.server.core.fair_pool import FairPool
from chunkline.server.core.ledger import Ledger, RowSink
from chunkline.server.core.metrics import Metrics
from chunkline.server.core.quotas import QuotaManager
from chunkline.server.core.tenants import TenantInfo, TenantRegistry
from chunkline.server.errors import Refusal

__all__ = ["ServingCore", "RequestClass", "DEFAULT_LEDGER_PATH"]

#: Where ``serve`` writes its ledger when only ``--ledger`` without a path asks for one.
DEFAULT_LEDGER_PATH = Path("chunkline-ledger.db")


@runtime_checkable
class RequestClass(Protocol):
    """What the server process drives in each request class (robot actions, text, planner).

    ``name`` is the class as tenants' ``classes`` lists and the ledger's ``cls`` column name it.
    Requests reach a class through its own methods, called by the entrypoints; this interface is
    only what the process needs to run, drain and observe every class the same way.
    """

    name: str

    async def start(self) -> None:
        """Load, warm and time the models; afterwards requests are accepted."""

    async def stop(self) -> None:
        """Stop after the drain: withdraw what is queued, release the models."""

    @property
    def in_flight(self) -> int:
        """Requests admitted and not yet answered (the drain waits for zero)."""

    @property
    def healthy(self) -> bool:
        """Whether this class can serve (a hung lane, say, makes the server not ready)."""

    def release_session(self, session: str) -> None:
        """A session closed: withdraw its queued requests and drop its per-session state."""

    def stats(self) -> dict[str, Any]:
        """Per-model load and service curves, for a fleet controller."""


class ServingCore:
    """Authentication, tenants, quotas, metrics, accounting and the ledger of one server process.

    Args:
        registry: the tenants (``TenantRegistry.anonymous()`` without authentication).
        authenticate: ``True`` to check API keys against ``registry``; ``False`` for ``--no-auth``.
        ledger_path: the SQLite ledger file, or ``None`` for no ledger (unless ``ledger_sink``).
        ledger_sink: where the ledger writes instead of a local file (a fleet's one shared ledger).
        ledger_fail_closed: refuse new work while the ledger cannot be written.
        clock: monotonic seconds (rate limits, quotas).
        cpu_pool: the pool every class prepares requests on (image decode and encode), fair
            between tenants.
    """

    def __init__(self, registry: TenantRegistry, *, authenticate: bool = True, ledger_path: Path | None = None,
                 ledger_sink: Callable[[], RowSink] | None = None, ledger_fail_closed: bool = True,
                 clock: Callable[[], float] = time.monotonic, cpu_pool: FairPool | None = None) -> None:
        self.clock = clock
        self.cpu_pool = cpu_pool or FairPool()
        self.metrics = Metrics()
        self.auth: Authenticator | NoAuth = Authenticator(registry, clock) if authenticate else NoAuth()
        self.quotas = QuotaManager(self.auth.registry)
        self.ledger: Ledger | None = None
        if ledger_path is not None or ledger_sink is not None:
            self.ledger = Ledger(ledger_path or DEFAULT_LEDGER_PATH, on_write=self._on_ledger_write, store_factory=ledger_sink)
        self.ledger_fail_closed = ledger_fail_closed
        self.accounting = Accounting(self.metrics, self.ledger)
        #: set when the drain starts: every class refuses new work from then on
        self.draining = False
        #: held while ``draining`` is set and while start-up checks it and says what it made ready
        #: (start-up runs on a loading thread), so nothing is reported ready after the drain began
        self.drain_lock = threading.Lock()
        self._ids = itertools.count(1)

    @property
    def registry(self) -> TenantRegistry:
        return self.auth.registry

    @property
    def ledger_ok(self) -> bool:
        """Whether work may be admitted as far as the ledger is concerned."""
        return self.ledger is None or self.ledger.healthy or not self.ledger_fail_closed

    def gate(self, tenant: TenantInfo, cls: str, model: str) -> None:
        """The rules every request passes before its class admits it.

        Raises:
            Refusal: ``shutting_down`` while draining, ``forbidden`` for a model or class the tenant
                may not use, ``not_ready`` while a fail-closed ledger cannot be written.
        """
        if self.draining:
            raise Refusal(ErrorCode.SHUTTING_DOWN, "the server is shutting down; reconnect", retry_after_ms=1000.0)
        if not tenant.may_use(model, cls):
            raise Refusal(ErrorCode.FORBIDDEN, f"tenant may not use model {model!r}")
        if not self.ledger_ok:
            raise Refusal(ErrorCode.NOT_READY, "usage ledger unavailable: refusing unrecorded work", retry_after_ms=1000.0)

    def request_id(self, session: str) -> str:
        """A ledger request id, unique in this process across models and request classes."""
        return f"{session}:{next(self._ids)}"

    def reload(self, registry: TenantRegistry) -> None:
        """Swap in a re-read tenants file (keys, limits); sessions stay connected."""
        self.auth.swap(registry)
        self.quotas.update_registry(registry, self.clock())

    def _on_ledger_write(self, *_: Any) -> None:
        if self.ledger is not None:  # called from the ledger's thread: gauges are thread-safe
            self.metrics.set_ledger(self.ledger.healthy, self.ledger.pending, self.ledger.dropped)

    def close(self) -> None:
        """Flush and close the ledger, stop the CPU pool (blocking: call it off the event loop)."""
        self.cpu_pool.close()
        if self.ledger is not None:
            self.ledger.close()
