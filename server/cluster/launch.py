"""How the fleet manager starts replicas: as Ray actors (production) or as threads (tests, demos).

Both give the manager the same :class:`ReplicaHandle`: awaitable ``start``, ``state``,
``set_leases``, ``drain`` and ``kill``. With Ray, each replica is an actor placed with its own
resources (``num_cpus``, ``num_gpus``), so Ray decides where it runs, on which host and GPU; the
robots still reach it over a direct WebSocket.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any, Protocol

from chunkline.server.cluster.replica import ReplicaHost
from chunkline.server.core.ledger import LedgerRow
from chunkline.server.core.tenants import TenantLimits

__all__ = ["ReplicaHandle", "Launcher", "ThreadLauncher", "RayLauncher", "NAMESPACE", "MANAGER_NAME"]

#: Ray namespace and actor name of a fleet's manager (``chunkline cluster status`` finds it by them).
NAMESPACE = "chunkline"
MANAGER_NAME = "chunkline-fleet"

LedgerWrite = Callable[[str, int, list[LedgerRow]], Any]


class ReplicaHandle(Protocol):
    """The manager's view of one replica."""

    name: str
    version: str

    async def start(self) -> dict[str, str]: ...

    async def state(self) -> dict[str, Any]: ...

    async def set_leases(self, leases: dict[str, TenantLimits]) -> None: ...

    async def drain(self, grace_s: float) -> None: ...

    async def kill(self) -> None: ...


class Launcher(Protocol):
    """Starts replicas."""

    def launch(self, name: str, version: str, config: dict[str, Any], tenants_text: str | None, secret: bytes,
               ledger_write: LedgerWrite | None) -> ReplicaHandle: ...


class _ThreadReplica:
    def __init__(self, host: ReplicaHost) -> None:
        self.host = host
        self.name = host.name
        self.version = host.version
        self._killed = False

    def _alive(self) -> None:
        if self._killed:
            raise ConnectionError(f"replica {self.name} was killed")

    async def start(self) -> dict[str, str]:
        return await asyncio.to_thread(self.host.start)

    async def state(self) -> dict[str, Any]:
        self._alive()
        return await asyncio.to_thread(self.host.state)

    async def set_leases(self, leases: dict[str, TenantLimits]) -> None:
        self._alive()
        await asyncio.to_thread(self.host.set_leases, leases)

    async def drain(self, grace_s: float) -> None:
        self._alive()
        await asyncio.to_thread(self.host.drain, grace_s)

    async def kill(self) -> None:
        if not self._killed:
            self._killed = True
            await asyncio.to_thread(self.host.stop)


class ThreadLauncher:
    """Replicas as threads of this process: no Ray needed (tests, single-host experiments)."""

    def launch(self, name: str, version: str, config: dict[str, Any], tenants_text: str | None, secret: bytes,
               ledger_write: LedgerWrite | None) -> ReplicaHandle:
        return _ThreadReplica(ReplicaHost(name, version, config, tenants_text, secret, ledger_write))


def _ray_ledger_write(manager: Any, source: str, offset: int, rows: list[LedgerRow]) -> Any:
    import ray

    return ray.get(manager.write_ledger.remote(source, offset, rows), timeout=10.0)


class _RayReplica:
    def __init__(self, actor: Any, name: str, version: str) -> None:
        self.actor = actor
        self.name = name
        self.version = version

    async def start(self) -> dict[str, str]:
        started: dict[str, str] = await self.actor.start.remote()
        return started

    async def state(self) -> dict[str, Any]:
        state: dict[str, Any] = await self.actor.state.remote()
        return state

    async def set_leases(self, leases: dict[str, TenantLimits]) -> None:
        await self.actor.set_leases.remote(leases)

    async def drain(self, grace_s: float) -> None:
        await self.actor.drain.remote(grace_s)

    async def kill(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)


class RayLauncher:
    """Replicas as Ray actors.

    Args:
        num_cpus, num_gpus: resources each replica reserves.
        manager: the manager actor's handle, which replicas send their ledger batches to.
    """

    def __init__(self, num_cpus: float, num_gpus: float, manager: Any | None) -> None:
        self.num_cpus = num_cpus
        self.num_gpus = num_gpus
        self.manager = manager

    def ledger_write(self) -> LedgerWrite | None:
        return functools.partial(_ray_ledger_write, self.manager) if self.manager is not None else None

    def launch(self, name: str, version: str, config: dict[str, Any], tenants_text: str | None, secret: bytes,
               ledger_write: LedgerWrite | None) -> ReplicaHandle:
        import ray

        actor_cls: Any = ray.remote(ReplicaHost)  # ray's decorator types lose the actor class's methods
        actor = actor_cls.options(
            namespace=NAMESPACE, num_cpus=self.num_cpus, num_gpus=self.num_gpus,
            max_concurrency=4, max_restarts=0,
        ).remote(name, version, config, tenants_text, secret, ledger_write)
        return _RayReplica(actor, name, version)
