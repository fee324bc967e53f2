"""`chunkline cluster`: the status table for people, and a foreground `cluster up` that exits when
the fleet is taken down."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from chunkline.server.cluster.cli import format_status, wait_while_alive
from chunkline.server.entrypoints.cli_errors import ERROR_LINE_CHARS, error_line

STATUS: dict[str, Any] = {
    "uri": "ws://127.0.0.1:8000", "version": "v1", "desired": 2, "rollout": None, "rollout_result": None, "placements": 3,
    "replicas": [
        {"name": "r1", "version": "v1", "uri": "ws://127.0.0.1:40001", "ready": True, "draining": False, "sessions": 3,
         "load_rps": 29.5, "fingerprint": "abc"},
        {"name": "r2", "version": "v1", "uri": None, "ready": False, "draining": False, "sessions": 0, "load_rps": 0.0,
         "fingerprint": None},
    ],
    "events": [{"t": 1_000_000.0, "event": "replica_ready", "replica": "r1"},
               {"t": 1_003_590.0, "event": "replica_lost", "replica": "r2"}],
}


def test_status_is_a_table_with_event_ages() -> None:
    text = format_status(STATUS, now=1_003_600.0)
    lines = text.splitlines()
    assert lines[0].startswith("fleet at ws://127.0.0.1:8000: version v1, 2 replica(s), desired 2")
    assert lines[1].split() == ["REPLICA", "VERSION", "STATE", "SESSIONS", "LOAD/S", "URI"]
    assert lines[2].split() == ["r1", "v1", "ready", "3", "29.5", "ws://127.0.0.1:40001"]
    assert lines[3].split() == ["r2", "v1", "starting", "0", "0.0", "-"]
    assert "(60m ago)  replica_ready  replica=r1" in text and "(10s ago)  replica_lost  replica=r2" in text
    assert "1000000" not in text and "1003590" not in text  # no raw Unix times


# What Ray's error for a task that raised looks like: a header naming the task, the remote
# traceback, then the exception that ended it.
RAY_TASK_ERROR = """ray::ReplicaActor.start() (pid=4242, ip=10.0.0.2, actor_id=abc)
  File "/srv/chunkline/server/cluster/replica.py", line 120, in start
    await self.server.start()
  File "/srv/chunkline/server/entrypoints/app.py", line 330, in _start_steps
    await self.robot.start()
chunkline.server.entrypoints.app.StartFailed: OSError: checkpoint /ckpt/act not found"""


def test_an_event_s_error_with_a_ray_traceback_shows_as_its_last_line() -> None:
    status = {**STATUS, "events": [{"t": 1_003_590.0, "event": "replica_failed", "replica": "r3",
                                    "error": f"RayTaskError(StartFailed): {RAY_TASK_ERROR}"}]}
    text = format_status(status, now=1_003_600.0)
    assert text.splitlines()[-1].endswith(
        "replica_failed  replica=r3 error=chunkline.server.entrypoints.app.StartFailed: OSError: checkpoint /ckpt/act not found")
    assert "File " not in text and len(text.splitlines()) == 6


def test_error_line_keeps_one_line_of_any_error() -> None:
    class RayTaskError(Exception):
        pass

    assert error_line(RayTaskError(RAY_TASK_ERROR)).endswith("StartFailed: OSError: checkpoint /ckpt/act not found")
    assert error_line(ValueError("bad\n\tclass_name: Replica")) == "ValueError: bad"
    assert error_line(TimeoutError()) == "TimeoutError"
    assert len(error_line("x" * 1000)) == ERROR_LINE_CHARS


class _Gone(Exception):
    pass


def test_waiting_ends_when_the_fleet_is_gone_or_on_a_signal() -> None:
    calls = []

    def ping() -> None:
        calls.append(1)
        if len(calls) >= 3:
            raise _Gone

    assert wait_while_alive(ping, threading.Event(), 0.001, gone=(_Gone,)) is False
    stop = threading.Event()
    stop.set()
    assert wait_while_alive(lambda: None, stop, 0.001, gone=(_Gone,)) is True


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_a_foreground_fleet_notices_cluster_down() -> None:
    ray = pytest.importorskip("ray")
    from chunkline.server.cluster.config import FleetConfig
    from chunkline.server.cluster.ray_fleet import fleet_up
    from chunkline.server.config import PolicyConfig, ServerConfig

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False, namespace="chunkline")
    try:
        server = ServerConfig(no_auth=True, port=0, policies=[PolicyConfig(ref="noop")], shutdown_grace_s=1.0)
        config = FleetConfig(server=server, replicas=1, directory_port=0, ledger=None, replica_cpus=0.5, drain_grace_s=1.0)
        actor, _ = fleet_up(config, None)
        assert "REPLICA" in format_status(ray.get(actor.status.remote(), timeout=30), time.time())
        result: list[bool] = []
        waiter = threading.Thread(target=lambda: result.append(wait_while_alive(
            lambda: ray.get(actor.status.remote(), timeout=10), threading.Event(), 0.2, gone=(ray.exceptions.RayActorError,))))
        waiter.start()
        ray.get(actor.stop.remote(), timeout=60)  # what `chunkline cluster down` does
        ray.kill(actor)
        waiter.join(timeout=60)
        assert result == [False]
    finally:
        ray.shutdown()
