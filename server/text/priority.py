"""Robots first: a gate that tells the text engine to yield while higher-priority policy work runs.

Priority inside one model is the admission core's job. Across models it is not: robot policies
and the embedded text model are separate admission controllers that share the same CPU (or GPU).
When an operator gives robots priority (tenants' ``class_priority = {policy = 10, text = 0}``, or
a robot tenant with a higher ``priority``), :class:`PolicyPriorityGate` answers the text engine's
question before every decode step: is policy work of a higher priority than my running
sequences queued or running? While it is, the engine does not step, so a robot's batch only
ever overlaps the one text step already in progress (a few milliseconds).

It reads the policy controllers through their public counters (``queued``, ``running``,
``queued_for``, ``running_for``) from the engine's thread; each read is a single dictionary
lookup or attribute read, atomic under the GIL, and a stale answer only delays or advances one
text step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from chunkline.server.core.tenants import TenantRegistry

__all__ = ["PolicyLoad", "PolicyPriorityGate"]


class PolicyLoad(Protocol):
    """The counters of a policy's admission controller the gate reads."""

    @property
    def queued(self) -> int: ...

    @property
    def running(self) -> int: ...

    def queued_for(self, tenant: str) -> int: ...

    def running_for(self, tenant: str) -> int: ...


class PolicyPriorityGate:
    """``gate(priority)`` is true while policy work of a priority above ``priority`` is active.

    Args:
        controllers: returns the policy models' admission controllers (``runner.core``), read at
            each call so that models loaded later count.
        registry: returns the tenant registry in force (reloads on SIGHUP are picked up).
    """

    def __init__(self, controllers: Callable[[], Iterable[PolicyLoad]], registry: Callable[[], TenantRegistry]) -> None:
        self._controllers = controllers
        self._registry = registry
        self._cache: tuple[object, dict[int, tuple[str, ...]]] = (None, {})

    def _tenants_above(self, priority: int) -> tuple[str, ...]:
        reg = self._registry()
        src, table = self._cache
        if src is not reg:
            table = {}
            self._cache = (reg, table)
        names = table.get(priority)
        if names is None:
            names = tuple(t.name for t in reg.tenants.values() if t.priority_for("policy") > priority)
            table[priority] = names
        return names

    def __call__(self, priority: int) -> bool:
        """Whether the text engine (running sequences of at most ``priority``) should wait.

        Args:
            priority: the highest text priority among the engine's active sequences.
        """
        names = self._tenants_above(priority)
        if not names:
            return False
        for core in self._controllers():
            if core.queued == 0 and core.running == 0:
                continue
            for name in names:
                if core.queued_for(name) or core.running_for(name):
                    return True
        return False
