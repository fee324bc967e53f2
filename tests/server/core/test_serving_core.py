"""The shared serving core: the gate every request class passes, request ids unique across classes,
the FIFO baseline as a selection strategy rather than a special case, and -- against a live server with a robot
policy and a text model -- one id space and one in-flight limit per session across classes, and
ledger request ids that never repeat."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from wire_helpers import native_session

from chunkline.bench.fifo import FifoSelector, fifo_config
from chunkline.bench.serverproc import ServerProcess
from chunkline.client.wire.codec import encode
from chunkline.client.wire.errors import ErrorCode
from chunkline.server.core.admission import (
    AdmissionConfig,
    AdmissionController,
    Admitted,
    PolicyCost,
    Request,
    ServiceTimeModel,
)
from chunkline.server.core.quotas import QuotaManager
from chunkline.server.core.serving import RequestClass, ServingCore
from chunkline.server.core.tenants import TenantInfo, TenantRegistry
from chunkline.server.errors import Refusal, http_status_for
from chunkline.server.robot.service import RobotActions
from tests.helpers import aloha_obs

pytestmark = pytest.mark.live  # its tests start servers or proxies on loopback

# ----------------------------------------------------------------------------- the gate


def _core(tmp_path: Path | None = None, fail_closed: bool = True) -> ServingCore:
    registry = TenantRegistry({"a": TenantInfo("a"), "robots": TenantInfo("robots", classes=frozenset({"policy"}),
                                                                           models=frozenset({"pi0"}))})
    return ServingCore(registry, ledger_path=None if tmp_path is None else tmp_path / "ledger.db",
                       ledger_fail_closed=fail_closed)


def test_gate_refuses_while_draining_for_forbidden_models_and_classes() -> None:
    core = _core()
    a, robots = core.registry.get("a"), core.registry.get("robots")
    assert a is not None and robots is not None
    core.gate(a, "text", "tiny")
    core.gate(robots, "policy", "pi0")
    for tenant, cls, model in ((robots, "text", "pi0"), (robots, "policy", "other")):
        with pytest.raises(Refusal) as info:
            core.gate(tenant, cls, model)
        assert info.value.code is ErrorCode.FORBIDDEN and http_status_for(info.value.code_str) == 403
    core.draining = True
    with pytest.raises(Refusal) as info:
        core.gate(a, "text", "tiny")
    assert info.value.code is ErrorCode.SHUTTING_DOWN and info.value.retry_after_ms == 1000.0


def test_gate_refuses_unrecorded_work_while_a_fail_closed_ledger_is_down(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "closed").mkdir()
    (tmp_path / "open").mkdir()
    closed, open_ = _core(tmp_path / "closed"), _core(tmp_path / "open", fail_closed=False)
    a = closed.registry.get("a")
    assert a is not None and closed.ledger is not None
    closed.gate(a, "policy", "m")
    monkeypatch.setattr(type(closed.ledger), "healthy", property(lambda self: False))  # what a failed write leaves
    with pytest.raises(Refusal) as info:
        closed.gate(a, "policy", "m")
    assert info.value.code is ErrorCode.NOT_READY and not closed.ledger_ok
    open_.gate(a, "policy", "m")  # fail-open: served although it cannot be recorded
    assert open_.ledger_ok
    closed.close()
    open_.close()


def test_request_ids_are_unique_across_sessions_and_classes() -> None:
    core = _core()
    ids = [core.request_id(s) for s in ("s1", "s1", "s2", "s1") for _ in range(50)]
    assert len(set(ids)) == len(ids)


def test_every_request_class_implements_the_interface_the_process_drives() -> None:
    from chunkline.server.text import TextService

    members = {"name", "start", "stop", "in_flight", "healthy", "release_session", "stats"}
    assert members <= {m for m in dir(RequestClass) if not m.startswith("_")} | {"name"}
    for cls in (RobotActions, TextService):  # mypy checks the signatures (app.py lists them as RequestClass)
        assert all(hasattr(cls, m) for m in members), cls
    with pytest.raises(ValueError):
        RobotActions(_core(), [])


# ----------------------------------------------------------------------------- FIFO is a benchmark strategy


def _controller(fifo: bool) -> AdmissionController:
    reg = TenantRegistry({"a": TenantInfo("a"), "b": TenantInfo("b")})
    return AdmissionController("m", QuotaManager(reg), fifo_config(max_queue=100) if fifo else AdmissionConfig(max_queue=100),
                               ServiceTimeModel(initial={1: 0.010}), FifoSelector() if fifo else None)


def _req(i: int, tenant: str, deadline: float) -> Request:
    return Request(i, f"s{i}", tenant, "policy", PolicyCost(), deadline)


def test_fifo_admits_what_deadline_admission_refuses_and_serves_in_arrival_order() -> None:
    edf, fifo = _controller(False), _controller(True)
    # Ten requests of 10 ms each, one at a time, with budgets of about 30 ms: deadline-aware
    # admission refuses those that would queue too long; the FIFO baseline takes them all. Deadlines
    # fall with arrival (alternating tenants), so earliest-deadline order is the reverse of arrival.
    offers = [(i, "ab"[i % 2], 0.0001 * i, 0.035 - 0.0001 * i) for i in range(10)]
    edf_verdicts = [edf.offer(_req(i, t, d), now) for i, t, now, d in offers]
    assert any(isinstance(v, Refusal) and v.code is ErrorCode.DEADLINE_UNMEETABLE for v in edf_verdicts)
    assert all(isinstance(fifo.offer(_req(i, t, d), now), Admitted) for i, t, now, d in offers)
    assert fifo.next_expiry() is None
    fifo.expire(10.0)  # long past every deadline: the baseline drops nothing
    assert fifo.take_dropped() == [] and fifo.queued == 10
    order = []
    while fifo.queued:
        batch = fifo.next_batch(10.0)
        order += [r.id for r in batch]
        fifo.complete_batch(batch, 10.0, 0.01)
    assert order == list(range(10))


# ----------------------------------------------------------------------------- live: one session, two classes


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("core")
    config = folder / "server.toml"
    config.write_text('no_auth = true\nmax_in_flight_per_session = 4\n'
                      '[[policies]]\nref = "noop"\n[[policies]]\nref = "loadtest"\n'
                      '[[text]]\nname = "tiny"\n')
    with ServerProcess(["--config", str(config), "--ledger", str(folder / "ledger.db")]) as proc:
        proc.test_ledger = folder / "ledger.db"  # type: ignore[attr-defined]
        yield proc


def _generate(i: int) -> bytes:
    return encode({"type": "generate", "id": i, "prompt": "hello", "max_tokens": 250, "ignore_eos": True})


def _infer(i: int, model: str | None = None) -> bytes:
    msg: dict[str, Any] = {"type": "infer", "id": i, "obs": aloha_obs(i), "obs_time": 0.0, "deadline_ms": 5000.0}
    if model:
        msg["model"] = model
    return encode(msg)


def test_an_infer_may_not_reuse_the_id_of_a_generate_in_flight(server: ServerProcess) -> None:
    finals = asyncio.run(native_session(server, [_generate(1), _infer(1)], 1))
    first = finals[0]
    assert first["type"] == "error" and first["id"] == 1 and first["code"] == ErrorCode.DUPLICATE_ID.value


def test_the_in_flight_limit_counts_every_class(server: ServerProcess) -> None:
    # Four long generations fill the session's limit of 4; the fifth request, of either class, is refused.
    finals = asyncio.run(native_session(server, [_generate(i) for i in range(4)] + [_infer(10), _generate(11)], 2))
    assert {(m["id"], m["type"], m.get("code")) for m in finals} == {
        (10, "error", ErrorCode.OVERLOADED.value), (11, "error", ErrorCode.OVERLOADED.value)}


def test_ledger_request_ids_are_unique_across_models_and_classes(server: ServerProcess) -> None:
    frames = [_infer(1, "noop"), _infer(2, "loadtest"), _generate(3), _infer(4, "noop"), _infer(5, "loadtest")]
    finals = asyncio.run(native_session(server, frames, len(frames)))
    assert sorted(m["id"] for m in finals) == [1, 2, 3, 4, 5]
    server.stop()  # the ledger is flushed on shutdown
    with sqlite3.connect(server.test_ledger) as db:  # type: ignore[attr-defined]
        rows = db.execute("SELECT request_id, class, model FROM requests").fetchall()
    ids = [r[0] for r in rows]
    assert len(ids) >= len(frames) and len(set(ids)) == len(ids)
    assert {r[1] for r in rows} == {"policy", "text"} and {r[2] for r in rows} >= {"noop", "loadtest", "tiny"}
