"""Start-up sized to the policy: batch 1 before ready, the larger sizes timed in quiet spells or
grown into under a backlog, and caps from out-of-memory, hangs and the GPU memory guard."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pytest

from chunkline.policies.base import ArraySpec, PolicySpec, validate_observation
from chunkline.policies.embedded.noop import NoopPolicy
from chunkline.server.core.admission import AdmissionConfig, ServiceTimeModel
from chunkline.server.core.quotas import QuotaManager
from chunkline.server.core.tenants import TenantRegistry
from chunkline.server.robot.batching import BatchPolicy
from chunkline.server.robot.runner import ModelRunner
from chunkline.server.robot.sizing import BatchSizing, MemorySample, size_ladder
from tests.loop_helpers import until

ANON = TenantRegistry.anonymous()
TENANT = next(iter(ANON.tenants.values()))
SPEC = PolicySpec(observation={"state": ArraySpec((4,), "float32")}, action_dim=2, horizon=3, dt=0.05)
GIB = 1 << 30


class OutOfMemoryError(RuntimeError):
    """Named as torch's CUDA out-of-memory error is (the server recognises it by name)."""


class Recording(NoopPolicy):
    """Records each batch's size; a size at or above ``oom_from`` runs out of memory; a size in
    ``blocks`` waits for the event first (a hung pass)."""

    def __init__(self, oom_from: int | None = None, blocks: Mapping[int, threading.Event] | None = None) -> None:
        super().__init__("recording", SPEC)
        self.sizes: list[int] = []
        self.oom_from = oom_from
        self.blocks = dict(blocks or {})

    def infer_batch(self, obs: Mapping[str, Any]) -> np.ndarray:
        size = len(obs["state"])
        self.sizes.append(size)
        if size in self.blocks:
            self.blocks[size].wait(10)
        if self.oom_from is not None and size >= self.oom_from:
            raise OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().infer_batch(obs)


def runner_for(policy: Recording, sizing: BatchSizing, clock: Callable[[], float] = time.perf_counter,
               hang_timeout: float = 30.0, t1: float = 0.001) -> ModelRunner:
    size = sizing.max_batch_size
    return ModelRunner("m", policy, quotas=QuotaManager(ANON), admission=AdmissionConfig(max_batch_size=size),
                       batching=BatchPolicy(max_batch_size=size, max_batch_wait=0.0), service=ServiceTimeModel(initial={1: t1}),
                       hang_timeout=hang_timeout, sizing=sizing, clock=clock)



def obs(seed: int) -> dict[str, Any]:
    return validate_observation(SPEC, {"state": np.full(4, seed, np.float32)})


# ---------------------------------------------------------------------- the sizing core


def test_the_ladder_is_powers_of_two_then_the_configured_size() -> None:
    assert size_ladder(16) == (1, 2, 4, 8, 16)
    assert size_ladder(12) == (1, 2, 4, 8, 12)
    assert size_ladder(1) == (1,)
    with pytest.raises(ValueError):
        BatchSizing(8, timed=(2,))  # batch 1 is always timed before serving


def test_a_size_is_timed_only_after_a_quiet_spell_long_enough_for_its_pass() -> None:
    sizing = BatchSizing(8, quiet_s=0.5)
    assert sizing.next_timing(10.0, lambda b: 0.01 * b) == (2, 10.5), "short pass: the quiet spell is 0.5 s"
    assert sizing.next_timing(10.0, lambda b: 1.0 * b) == (2, 12.0), "long pass: a spell as long as the pass"
    sizing.started(2)
    assert sizing.next_timing(10.0, lambda b: 0.01) is None, "one timing at a time"
    sizing.record_timing(2)
    assert sizing.next_timing(20.0, lambda b: 0.01)[0] == 4  # type: ignore[index]
    assert BatchSizing(8, background=False).next_timing(-float("inf"), lambda b: 0.0) is None


def test_a_backlog_grows_the_batch_size_one_measured_rung_at_a_time() -> None:
    sizing = BatchSizing(16, background=False)
    assert sizing.limit(queued=1) == 1, "no backlog: batch 1, the only size timed"
    assert sizing.limit(queued=10) == 2, "a backlog: the next rung, its first use"
    assert sizing.limit(queued=10) == 2, "not again before a batch of 2 has been measured"
    sizing.measured(2)
    assert sizing.limit(queued=10) == 4
    sizing.measured(4)
    assert sizing.limit(queued=3) == 4, "no larger batch without more queued than allowed"
    assert BatchSizing(16, timed=(1, 8)).limit(queued=1) == 8, "sizes timed at start-up are allowed at once"


def test_out_of_memory_and_hangs_cap_below_the_failing_size() -> None:
    sizing = BatchSizing(16)
    sizing.started(8)
    sizing.failed(8, "ran out of memory")
    assert (sizing.cap, sizing.timing) == (4, None)
    assert sizing.pending == (2, 4) and sizing.cap_reason == "batch 8 ran out of memory"
    sizing.measured(2)
    sizing.measured(4)
    assert sizing.done
    sizing.failed(3, "hung")  # a real batch of an odd size
    assert sizing.cap == 2 and sizing.limit(queued=100) == 2
    sizing.failed(1, "hung")
    assert sizing.cap == 2, "nothing is below batch 1"


def test_the_memory_guard_caps_sizes_predicted_not_to_fit() -> None:
    sizing = BatchSizing(64, headroom=0.9)
    # 1 GiB of weights, 1 GiB more per robot at batch 2, 10 GiB available: 8 robots fit in 90 %.
    sizing.record_timing(2, MemorySample(base=GIB, peak=3 * GIB, limit=10 * GIB))
    assert sizing.cap == 8 and sizing.pending == (4, 8)
    sizing.record_timing(4, MemorySample(base=GIB, peak=2 * GIB, limit=10 * GIB))
    assert sizing.cap == 8, "a smaller estimate never raises a cap"
    assert BatchSizing(4).cap == 4


def test_timing_passes_prime_the_service_model_and_real_batches_replace_them() -> None:
    service = ServiceTimeModel(initial={1: 0.01})
    assert service.mean(8) == pytest.approx(0.08), "before timing: proportional, the cautious direction"
    service.prime({8: 0.02})
    assert service.mean(8) == pytest.approx(0.02) and service.mean(4) == pytest.approx(0.01 + 3 / 7 * 0.01)
    service.observe(8, 0.03)
    service.prime({8: 0.5, 2: float("nan")})
    assert service.mean(8) == pytest.approx(0.03), "a size real batches have shown keeps its estimate"
    assert 2 not in service.snapshot(), "a bogus timing is ignored"


# ---------------------------------------------------------------------- the runner


def test_an_idle_runner_times_every_larger_size_in_the_background(caplog: pytest.LogCaptureFixture) -> None:
    policy = Recording()
    sizing = BatchSizing(8, quiet_s=0.0)

    async def go() -> ModelRunner:
        runner = runner_for(policy, sizing)
        runner.start_background_timing()
        await until(lambda: runner.sizes_timed_at is not None, "every size is timed")
        await runner.stop()
        return runner

    with caplog.at_level(logging.INFO, logger="chunkline.server"):
        runner = asyncio.run(go())
    assert policy.sizes == [2, 4, 8], "smallest first, one pass each, batch 1 was timed at start-up"
    assert set(runner.core.service.snapshot()) == {1, 2, 4, 8}
    assert "every batch size up to 8 timed" in caplog.text and "batch 4 takes" in caplog.text


def test_a_busy_runner_waits_and_a_request_comes_first() -> None:
    gate = threading.Event()
    policy = Recording(blocks={1: gate})
    sizing = BatchSizing(4, quiet_s=0.0)

    async def go() -> None:
        runner = runner_for(policy, sizing)
        item = runner.submit(obs(0), tenant=TENANT, session="a", deadline=time.perf_counter() + 10)
        runner.start_background_timing()
        await until(lambda: policy.sizes == [1], "the request runs")
        assert sizing.timing is None, "a batch is running: no timing beside it"
        gate.set()
        await item.future
        await until(lambda: sizing.done, "the sizes are timed once idle")
        await runner.stop()

    asyncio.run(go())
    assert policy.sizes == [1, 2, 4]


def test_a_background_out_of_memory_caps_the_batch_size_served() -> None:
    policy = Recording(oom_from=4)
    sizing = BatchSizing(16, quiet_s=0.0)

    async def go() -> tuple[ModelRunner, list[int]]:
        runner = runner_for(policy, sizing)
        runner.start_background_timing()
        await until(lambda: runner.sizes_timed_at is not None, "the sizes below the cap are timed")
        policy.sizes.clear()
        items = [runner.submit(obs(i), tenant=TENANT, session=f"s{i}", deadline=time.perf_counter() + 10) for i in range(9)]
        results = await asyncio.gather(*(i.future for i in items))
        await runner.stop()
        return runner, [r.batch_size for r in results]

    runner, sizes = asyncio.run(go())
    assert runner.max_batch_size == 2 and runner.batching.max_batch_size == 2 and sizing.cap == 2
    assert max(policy.sizes) <= 2 and max(sizes) <= 2, "nothing above the cap runs again"


def test_a_real_batch_out_of_memory_under_backlog_caps_and_still_answers() -> None:
    gate = threading.Event()
    policy = Recording(oom_from=4, blocks={1: gate})
    sizing = BatchSizing(8, background=False)

    async def go() -> list[int]:
        runner = runner_for(policy, sizing)
        items = [runner.submit(obs(i), tenant=TENANT, session=f"s{i}", deadline=time.perf_counter() + 10) for i in range(8)]
        gate.set()  # the first batch (1) ends with 7 queued: 2, then 4 (out of memory), then 2s
        results = await asyncio.gather(*(i.future for i in items))
        await runner.stop()
        return [r.batch_size for r in results]

    sizes = asyncio.run(go())
    assert sizes.count(4) == 4, "the batch of 4 that ran out of memory answered its robots one at a time"
    assert policy.sizes[:4] == [1, 2, 4, 1] and sizing.cap == 2 and 4 not in policy.sizes[7:]


def test_a_hung_timing_pass_replaces_its_lane_and_caps() -> None:
    stuck = threading.Event()
    policy = Recording(blocks={4: stuck})
    sizing = BatchSizing(8, quiet_s=0.0)

    async def go() -> ModelRunner:
        runner = runner_for(policy, sizing, hang_timeout=0.05, t1=0.0001)
        runner.start_background_timing()
        await until(lambda: sizing.cap == 2, "the hang caps the batch size")
        assert not runner.healthy, "the stuck call has not returned"
        item = runner.submit(obs(0), tenant=TENANT, session="a", deadline=time.perf_counter() + 10)
        await item.future  # the replaced lane serves
        stuck.set()
        await until(lambda: runner.healthy, "the stuck call returns")
        await runner.stop()
        return runner

    runner = asyncio.run(go())
    assert runner.max_batch_size == 2 and sizing.cap_reason == "batch 4 hung"


# ---------------------------------------------------------------------- start-up (the robot class)


class FakeCuda:
    """torch.cuda's memory calls for a 10 GiB device: 1 GiB of weights, 1 GiB per robot in a pass."""

    def __init__(self) -> None:
        self.peak = GIB

    def reset_peak_memory_stats(self) -> None:
        self.peak = GIB

    def memory_allocated(self) -> int:
        return GIB

    def max_memory_allocated(self) -> int:
        return self.peak

    def mem_get_info(self) -> tuple[int, int]:
        return 9 * GIB, 10 * GIB

    def memory_reserved(self) -> int:
        return GIB


class OnDevice(Recording):
    def __init__(self, cuda: FakeCuda) -> None:
        super().__init__()
        self.cuda = cuda

    def infer_batch(self, obs: Mapping[str, Any]) -> np.ndarray:
        self.cuda.peak = GIB + len(obs["state"]) * GIB
        return super().infer_batch(obs)


def test_start_up_is_ready_after_batch_1_and_the_memory_guard_caps_before_trying(monkeypatch: pytest.MonkeyPatch,
                                                                                   caplog: pytest.LogCaptureFixture) -> None:
    from chunkline.server.core.serving import ServingCore
    from chunkline.server.robot import timing
    from chunkline.server.robot.config import PolicyConfig
    from chunkline.server.robot.service import RobotActions

    cuda = FakeCuda()
    policy = OnDevice(cuda)
    monkeypatch.setattr(timing, "_cuda", lambda: cuda)

    async def go() -> dict[str, Any]:
        actions = RobotActions(ServingCore(ANON, authenticate=False), [PolicyConfig(ref="fake", max_batch_size=16)],
                               load=lambda pc: policy)
        await actions.start()
        runner = actions.default
        await until(lambda: runner.sizes_timed_at is not None, "the sizes that fit are timed")
        stats = actions.stats()["fake"]
        await actions.stop()
        return stats

    with caplog.at_level(logging.INFO, logger="chunkline.server"):
        stats = asyncio.run(go())
    assert policy.sizes[:4] == [1, 1, 1, 1], "warm-up and three timed passes at batch 1 ..."
    assert caplog.text.index("ready: fake") < caplog.text.index("timing batch 2"), "... then ready, then the rest"
    # 90 % of 10 GiB, less 1 GiB of weights, at 1 GiB per robot: 8 robots.
    assert policy.sizes[4:] == [2, 4, 8], "batch 16 is never tried"
    assert stats["max_batch_size"] == 8 and stats["batch_sizes_timed"] == [1, 2, 4, 8]


def test_admission_plans_around_a_timing_pass() -> None:
    """A request that cannot wait for the pass is refused at once, not admitted behind it and dropped."""
    from chunkline.client.wire.errors import ErrorCode
    from chunkline.server.errors import Refusal

    stuck = threading.Event()
    policy = Recording(blocks={2: stuck})
    sizing = BatchSizing(4, quiet_s=0.0)

    async def go() -> None:
        runner = runner_for(policy, sizing, t1=0.01)  # batch 2 predicted at 20 ms
        runner.start_background_timing()
        await until(lambda: policy.sizes == [2], "the timing pass runs")
        with pytest.raises(Refusal) as refused:  # alone it would take 10 ms, but only after the pass
            runner.submit(obs(0), tenant=TENANT, session="a", deadline=time.perf_counter() + 0.015)
        assert refused.value.code is ErrorCode.DEADLINE_UNMEETABLE
        stuck.set()
        await until(lambda: 2 in sizing.timed, "the pass ends")
        item = runner.submit(obs(0), tenant=TENANT, session="a", deadline=time.perf_counter() + 10)
        await item.future
        await runner.stop()

    asyncio.run(go())


def test_a_timing_pass_ignores_a_torch_another_thread_is_still_importing(monkeypatch: pytest.MonkeyPatch) -> None:
    # The server loads its text models (which import torch) while the robot lanes already time
    # batch sizes: a half-built torch in sys.modules, without torch.cuda, must not fail the pass
    # (it did, and capped a no-op policy at 2 robots per batch).
    import importlib.machinery
    import sys
    import types

    from chunkline.server.robot.timing import release_device_memory, timing_pass

    half = types.ModuleType("torch")
    half.__spec__ = importlib.machinery.ModuleSpec("torch", None)
    half.__spec__._initializing = True  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", half)
    outcome = timing_pass(NoopPolicy(), 4)
    assert outcome.size == 4 and outcome.seconds >= 0 and outcome.memory is None
    release_device_memory()  # nothing to release, and no AttributeError


def test_background_timing_is_a_serve_flag() -> None:
    import argparse

    from chunkline.server.entrypoints.server_flags import add_server_flags, server_config_from_args

    p = argparse.ArgumentParser()
    add_server_flags(p)
    on = server_config_from_args(p.parse_args(["--no-auth", "--policy", "noop"]))
    off = server_config_from_args(p.parse_args(["--no-auth", "--policy", "noop", "--no-background-timing"]))
    assert [pc.background_timing for pc in on.policies] == [True]
    assert [pc.background_timing for pc in off.policies] == [False]
