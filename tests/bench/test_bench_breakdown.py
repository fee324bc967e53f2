"""The latency breakdown: client and server timings joined per request without a shared clock."""

from __future__ import annotations

import pytest

from chunkline.bench.breakdown import STAGES, stage_table, stage_times, summarize_stages

SERVER = {"decode_ms": 0.2, "queue_ms": 1.0, "infer_ms": 6.0, "encode_ms": 0.1, "server_ms": 7.5, "batch_size": 1.0}
CLIENT = {"encode_ms": 0.3, "send_ms": 0.4, "round_trip_ms": 9.0, "decode_ms": 0.2}


def test_stages_add_up_to_the_observation_to_broker_time() -> None:
    s = stage_times(SERVER, CLIENT, handover_ms=0.05)
    assert s["server_other"] == pytest.approx(7.5 - (0.2 + 1.0 + 6.0 + 0.1))
    assert s["send"] == pytest.approx(0.4)
    assert s["return"] == pytest.approx(9.0 - 7.5 - 0.4)
    assert s["total"] == pytest.approx(0.3 + 9.0 + 0.2 + 0.05)
    assert sum(v for k, v in s.items() if k != "total") == pytest.approx(s["total"])
    # In path order, optional stages the server does not report left out.
    assert list(s) == ["client_encode", "send", "server_decode", "queue_wait", "inference", "server_encode",
                       "server_other", "return", "client_decode", "handover", "total"]


def test_optional_server_stages_are_used_when_reported() -> None:
    s = stage_times(SERVER | {"admission_ms": 0.05, "batch_wait_ms": 0.5, "server_ms": 8.05}, CLIENT)
    assert s["admission"] == 0.05 and s["batch_wait"] == 0.5
    assert s["server_other"] == pytest.approx(8.05 - (0.2 + 0.05 + 1.0 + 0.5 + 6.0 + 0.1))
    assert "handover" not in s
    assert s["total"] == pytest.approx(0.3 + 9.0 + 0.2)


def test_send_is_capped_at_the_transport_time() -> None:
    # A large request: the client's send call returned after the server had already started.
    s = stage_times(SERVER, CLIENT | {"send_ms": 3.0})
    assert s["send"] == pytest.approx(9.0 - 7.5)
    assert s["return"] == 0.0
    assert s["total"] == pytest.approx(0.3 + 9.0 + 0.2)


def test_a_missing_required_timing_is_a_key_error() -> None:
    with pytest.raises(KeyError):
        stage_times({k: v for k, v in SERVER.items() if k != "infer_ms"}, CLIENT)
    with pytest.raises(KeyError):
        stage_times(SERVER, {k: v for k, v in CLIENT.items() if k != "round_trip_ms"})


def test_summaries_per_stage() -> None:
    rows = [stage_times(SERVER | {"infer_ms": float(i), "server_ms": 1.3 + i}, CLIENT | {"round_trip_ms": 3.0 + i})
            for i in range(1, 101)]
    stats = summarize_stages(rows)
    assert stats["inference"]["p50"] == pytest.approx(50.5)
    assert stats["inference"]["mean"] == pytest.approx(50.5)
    assert stats["inference"]["n"] == 100
    assert stats["server_other"]["p99"] == pytest.approx(0.0, abs=1e-9)
    assert "admission" not in stats
    # Means add up across stages; the table lists every reported stage plus the total.
    assert sum(v["mean"] for k, v in stats.items() if k != "total") == pytest.approx(stats["total"]["mean"])
    table = stage_table({"A": stats})
    assert "inference" in table and "total (obs to broker)" in table
    assert len(table.splitlines()) == 3 + len(stats) + 2  # plus the median remainder row and the note under the table
    assert {name for name, _ in STAGES} >= set(stats) - {"total"}
