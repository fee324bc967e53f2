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
