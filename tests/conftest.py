"""Shared fixtures: real server processes on loopback, and the ``live`` mark.

A test is ``live`` (starts real processes: servers, proxies, Ray) when it lives under ``tests/live/``,
uses a fixture that starts one (``noop_server``, ``sleepy_server``, ``server_process``,
``tenants_file``), or its module says ``pytestmark = pytest.mark.live``; ``pytest -m "not live"``
runs the unit tests alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from tenants_files import TenantsFile, tenants_file_factory

from chunkline.bench.serverproc import ServerProcess

LIVE_DIR = Path(__file__).resolve().parent / "live"
_LIVE_FIXTURES = frozenset({"noop_server", "sleepy_server", "server_process", "tenants_file"})


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


@pytest.fixture
def server_process() -> Iterator[Callable[..., ServerProcess]]:
    """Starts a server with the given flags (``ServerProcess``'s arguments); each one started is
    stopped when the test ends."""
    with contextlib.ExitStack() as started:
        yield lambda args, **kwargs: started.enter_context(ServerProcess(args, **kwargs))


@pytest.fixture(scope="session")
def tenants_file(tmp_path_factory: pytest.TempPathFactory) -> TenantsFile:
    """A factory for the tenants file of a server a test starts (see ``tenants_files``)."""
    return tenants_file_factory(tmp_path_factory)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(LIVE_DIR) or _LIVE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.live)
