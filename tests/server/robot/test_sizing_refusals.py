"""A request refused for its deadline while a background timing pass holds a lane is told when
the pass ends (its retry time) and why, as one refused during the idle re-measurement is."""

from __future__ import annotations

import pytest

from chunkline.client.wire.errors import ErrorCode
from chunkline.server.errors import Refusal
from chunkline.server.robot.batching import BatchPolicy
from chunkline.server.robot.sizing import BatchSizeTuner, BatchSizing

ALONE = Refusal(ErrorCode.DEADLINE_UNMEETABLE, "predicted to finish in 400.0 ms, budget is 100.0 ms")


def test_a_refusal_without_a_retry_time_during_a_timing_pass_gets_the_pass_end() -> None:
    tuner = BatchSizeTuner("m", BatchPolicy(max_batch_size=16), BatchSizing(16))
    tuner.serving(100.0)
    assert tuner.while_timing(ALONE, 100.0) is ALONE, "no pass: nothing to wait for"
    tuner.start(2, 100.0, 0.4)
    during = tuner.while_timing(ALONE, 100.1)
    assert during.code is ErrorCode.DEADLINE_UNMEETABLE and during.retry_after_ms == pytest.approx(300.0)
    assert during.message.endswith("; batch 2 is being timed in the background (planned to end in 300 ms)")
    late = tuner.while_timing(ALONE, 100.5)
    assert late.retry_after_ms == pytest.approx(400.0) and "100 ms past its planned 400 ms" in late.message
    # a refusal with its own retry time, or of another kind, is answered as it is
    waits = Refusal(ErrorCode.DEADLINE_UNMEETABLE, "short", 20.0)
    full = Refusal(ErrorCode.OVERLOADED, "queue full")
    assert tuner.while_timing(waits, 100.1) is waits and tuner.while_timing(full, 100.1) is full
    tuner.timed(2, 0.3, None, 100.3)
    assert tuner.while_timing(ALONE, 100.35) is ALONE, "the pass has ended"
