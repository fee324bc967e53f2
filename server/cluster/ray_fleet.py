"""The fleet on Ray: the manager as a named actor, replicas as actors it places and supervises.

``ray`` is imported only here and in :mod:`.launch` (inside functions): it is the ``cluster``
extra, and nothing else in chunkline needs it.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from chunkline.server.cluster.config import FleetConfig
from chunkline.server.cluster.launch import MANAGER_NAME, NAMESPACE, RayLauncher
from chunkline.server.cluster.manager import FleetManager
from chunkline.server.core.ledger import LedgerRow

__all__ = ["FleetActor", "connect", "fleet_up", "find_fleet"]


class FleetActor:
    """The fleet manager in a Ray actor (async: the directory and control loop run on its loop).

    Args:
        config: :class:`FleetConfig` fields.
        tenants_text: the tenants file's contents (``None`` without authentication).
    """

    def __init__(self, config: dict[str, Any], tenants_text: str | None) -> None:
        self.config = FleetConfig.model_validate(config)
        self.tenants_text = tenants_text
        self.manager: FleetManager | None = None

    async def start(self) -> str:
        import ray

        me = ray.get_runtime_context().current_actor
        launcher = RayLauncher(self.config.replica_cpus, self.config.replica_gpus, me)
        self.manager = FleetManager(self.config, self.tenants_text, launcher, launcher.ledger_write())
        return await self.manager.start()

    def _m(self) -> FleetManager:
        if self.manager is None:
            raise RuntimeError("the fleet is not started")
        return self.manager

    async def status(self) -> dict[str, Any]:
        return self._m().status()

    async def write_ledger(self, source: str, offset: int, rows: list[LedgerRow]) -> int:
        # SQLite blocks: keep it off the loop that answers robots' directory handshakes
        return await asyncio.to_thread(self._m().write_ledger, source, offset, rows)

    async def start_rollout(self, server: dict[str, Any]) -> str:
        return await self._m().start_rollout(server)

    async def kill_replica(self, name: str) -> None:
        """Chaos and tests: kill a replica's actor abruptly (as a lost host would)."""
        await self._m().replicas[name].handle.kill()

    async def scale(self, replicas: int) -> None:
        """Set the desired replica count by hand (within autoscale bounds, if any)."""
        self._m().desired = replicas

    async def stop(self) -> None:
        await self._m().stop()


def connect(address: str | None, local: bool, num_cpus: int | None = None) -> None:
    """Join a Ray cluster (``address``, e.g. ``auto``) or start a local one (``local``)."""
    import ray

    if ray.is_initialized():
        return
    if local:
        ray.init(num_cpus=num_cpus or os.cpu_count() or 1, include_dashboard=False, namespace=NAMESPACE,
                 log_to_driver=False, configure_logging=False)
    else:
        ray.init(address=address or "auto", namespace=NAMESPACE, log_to_driver=False, configure_logging=False)


def fleet_up(config: FleetConfig, tenants_text: str | None, detached: bool = False) -> tuple[Any, str]:
    """Create the named manager actor and start the fleet; return ``(actor, directory_uri)``."""
    import ray

    remote: Any = ray.remote(FleetActor)  # ray's decorator types lose the actor class's methods
    actor = remote.options(
        name=MANAGER_NAME, namespace=NAMESPACE, num_cpus=0, max_concurrency=1000,
        lifetime="detached" if detached else None,
    ).remote(config.model_dump(mode="json"), tenants_text)
    uri = ray.get(actor.start.remote())
    return actor, uri


def find_fleet() -> Any:
    """The running fleet's manager actor (after :func:`connect`)."""
    import ray

    return ray.get_actor(MANAGER_NAME, namespace=NAMESPACE)
