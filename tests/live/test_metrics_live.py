"""Metrics and probes against a live server: what each counter says matches what the clients saw."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from chunkline.bench.serverproc import ServerProcess, http_get
from chunkline.bench.soak.policy import FAULT_POLICY_REF
from chunkline.client import AsyncClient, ErrorCode, ServerError
from chunkline.server.version import VERSION


@pytest.fixture(scope="module")
def fault_server() -> Iterator[ServerProcess]:
    """One lane, batches of one, on the soak's fault policy (each observation says how long it takes)."""
    with ServerProcess(["--policy", FAULT_POLICY_REF, "--lanes", "1", "--max-batch-size", "1", "--metrics-port", "0"]) as server:
        yield server


def _obs(run_ms: float = 0.0) -> dict[str, object]:
    state = np.zeros(14, np.float32)
    state[2] = run_ms  # the fault policy runs this long
    return {"state": state, "prompt": "x"}


def _scrape(server: ServerProcess) -> tuple[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    status, body = http_get("127.0.0.1", server.metrics_port, "/metrics")
    assert status == 200
    text = body.decode()
    return text, {(s.name, tuple(sorted(s.labels.items()))): s.value
                  for fam in text_string_to_metric_families(text) for s in fam.samples}


def _value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return sum(v for (n, lab), v in samples.items() if n == name and all(dict(lab).get(k) == x for k, x in labels.items()))


def test_admitted_request_dropped_at_its_deadline_is_a_deadline_miss_and_a_labelled_refusal(fault_server: ServerProcess) -> None:
    async def go() -> tuple[str, ErrorCode]:
        async with AsyncClient(fault_server.uri) as client:
            assert client.hello is not None
            model = client.hello.default_model
            await client.infer(_obs(), deadline_ms=5000)  # warm: the model has seen fast requests only
            slow = asyncio.ensure_future(client.infer(_obs(run_ms=600), deadline_ms=5000))
            await asyncio.sleep(0.1)  # the slow one holds the only lane for about 0.5 s more
            # Admission expects a fast policy, so this one is admitted; its deadline passes in the queue.
            with pytest.raises(ServerError) as dropped:
                await client.infer(_obs(), deadline_ms=150)
            await slow
            return model, dropped.value.code

    _, before = _scrape(fault_server)
    model, code = asyncio.run(go())
    assert code is ErrorCode.DEADLINE_EXCEEDED
    _, after = _scrape(fault_server)

    def delta(name: str, **labels: str) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    assert delta("chunkline_requests_total", model=model, outcome="deadline_exceeded") == 1
    assert delta("chunkline_deadline_misses_total", **{"class": "policy", "model": model}) == 1
    assert delta("chunkline_refusals_total", **{"class": "policy", "model": model, "reason": "deadline_exceeded"}) == 1


def test_unknown_model_refusals_never_carry_the_clients_name(fault_server: ServerProcess) -> None:
    async def go() -> ErrorCode:
        async with AsyncClient(fault_server.uri) as client:
            with pytest.raises(ServerError) as refused:
                await client.infer(_obs(), deadline_ms=5000, model="robot-chose-this-name")
            return refused.value.code

    _, before = _scrape(fault_server)
    assert asyncio.run(go()) is ErrorCode.UNKNOWN_MODEL
    text, after = _scrape(fault_server)
    assert "robot-chose-this-name" not in text
    labels = {"class": "policy", "model": "(unknown)", "reason": "unknown_model"}
    assert _value(after, "chunkline_refusals_total", **labels) - _value(before, "chunkline_refusals_total", **labels) == 1


def test_exposition_has_build_info_and_no_created_series(fault_server: ServerProcess) -> None:
    text, samples = _scrape(fault_server)
    assert "_created" not in text
    assert _value(samples, "chunkline_build_info", version=VERSION) == 1
    assert _value(samples, "chunkline_model_info", **{"class": "policy"}) == 1  # one model, with its fingerprint
    assert ("chunkline_ledger_dropped_rows_total", ()) in samples


@pytest.mark.parametrize("port", ["request", "metrics"])
def test_probes_answer_without_a_key_on_every_port(fault_server: ServerProcess, port: str) -> None:
    number = fault_server.port if port == "request" else fault_server.metrics_port
    assert http_get("127.0.0.1", number, "/healthz") == (200, b"ok\n")
    assert http_get("127.0.0.1", number, "/readyz") == (200, b"ready\n")
    assert http_get("127.0.0.1", number, "/readyz?verbose=1") == (200, b"ready\n")
    if port == "metrics":
        assert http_get("127.0.0.1", number, "/nope")[0] == 404
