"""Shared fixtures: real server processes on loopback."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from chunkline.bench.serverproc import ServerProcess


@pytest.fixture(scope="module")
def noop_server() -> Iterator[ServerProcess]:
    """A server on the no-op policy (fast), shared by a test module."""
    with ServerProcess(["--policy", "noop", "--max-message-bytes", str(8 * 1024 * 1024)]) as server:
        yield server


@pytest.fixture(scope="module")
def sleepy_server() -> Iterator[ServerProcess]:
    """A server whose policy sleeps 2 s per inference."""
    with ServerProcess(["--policy", "sleep:2", "--shutdown-grace", "10"]) as server:
        yield server


# Names whose presence in a test module means its tests start real processes (servers, proxies,
# Ray): those tests are marked ``live`` so ``pytest -m "not live"`` runs the unit tests alone.
_LIVE_NAMES = ("ServerProcess", "FaultProxy", "ray", "HttpServer", "ChunklineServer", "ServiceHandle")
_LIVE_FIXTURES = frozenset({"noop_server", "sleepy_server"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = getattr(item, "module", None)
        names = vars(module) if module is not None else {}
        if any(name in names for name in _LIVE_NAMES) or _LIVE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.live)
