"""Robots first: robot-policy and text traffic on one event loop, sharing the quota manager, the
metrics and the CPU. With robots given priority (tenants' class priorities), text load cannot push
robot requests past their deadlines; and the gate that enforces it, unit by unit."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from text_helpers import ServiceHandle, registry_with_keys

from chunkline.server.core.admission import (
    AdmissionConfig,
    AdmissionController,
    PolicyCost,
    Request,
    ServiceTimeModel,
)
from chunkline.server.core.loopthread import LoopThread
from chunkline.server.core.quotas import QuotaManager
from chunkline.server.core.tenants import TenantInfo, TenantRegistry
from chunkline.server.robot.batching import BatchPolicy
from chunkline.server.robot.runner import ModelRunner, Refusal
from chunkline.server.text import PolicyPriorityGate, TextModelConfig
from chunkline.server.text.backend import GenerationRequest
from chunkline.server.text.sampling import SamplingParams

pytestmark = pytest.mark.live  # its tests start servers or proxies on loopback


def test_gate_opens_only_for_higher_priority_policy_work() -> None:
    robot = TenantInfo("robot", class_priority={"policy": 10, "text": 0})
    writer = TenantInfo("writer")
    reg = TenantRegistry({"robot": robot, "writer": writer})
    quotas = QuotaManager(reg)
    core = AdmissionController("pi", quotas, AdmissionConfig(max_batch_size=2))
    gate = PolicyPriorityGate(lambda: [core], lambda: quotas.registry)
    assert not gate(0)  # nothing active
    core.offer(Request(1, "s", "writer", "policy", PolicyCost(), deadline=10.0, priority=0), now=0.0)
    assert not gate(0)  # equal priority: no yielding
    core.offer(Request(2, "s", "robot", "policy", PolicyCost(), deadline=10.0, priority=10), now=0.0)
    assert gate(0) and gate(9) and not gate(10)  # queued robot work above the text priority
    batch = core.next_batch(0.0)
    assert gate(0)  # running counts too
    core.complete_batch(batch, 0.1, 0.1)
    assert not gate(0)
    # a reloaded registry is picked up
    quotas.update_registry(TenantRegistry({"robot": TenantInfo("robot"), "writer": writer}), 1.0)
    core.offer(Request(3, "s", "robot", "policy", PolicyCost(), deadline=10.0, priority=0), now=1.0)
    assert not gate(0)


@pytest.mark.slow
def test_text_load_cannot_push_robots_past_their_deadlines() -> None:
    from chunkline.policies.base import example_observation, stack_observations
    from chunkline.policies.registry import load_policy

    loop = LoopThread()
    robot = TenantInfo("robot", class_priority={"policy": 10, "text": 0})
    writer = TenantInfo("writer")
    reg, _ = registry_with_keys({"robot": robot, "writer": writer})
    runners: list[ModelRunner] = []
    gate = PolicyPriorityGate(lambda: [r.core for r in runners], lambda: handle.quotas.registry)
    text_model = TextModelConfig(name="text", max_batch=8, max_output_tokens=64)
    handle = ServiceHandle([text_model], loop, reg, yield_to=gate)
    handle.start()
    policy = load_policy("loadtest")
    policy.warmup()
    rng = np.random.default_rng(0)
    obs = example_observation(policy.spec, rng)
    batch = stack_observations(policy.spec, [obs])
    t = time.perf_counter()
    for _ in range(3):
        policy.infer_batch(batch)
    service_s = (time.perf_counter() - t) / 3

    async def make_runner() -> ModelRunner:
        # The robot lane and the text engine share the same quota manager, as in the server.
        return ModelRunner("pi", policy, quotas=handle.quotas, admission=AdmissionConfig(max_queue=64, max_batch_size=4),
                           batching=BatchPolicy(max_batch_size=4, max_batch_wait=0.002),
                           service=ServiceTimeModel(initial={1: service_s}))

    runners.append(loop.run(make_runner()))
    runner = runners[0]
    svc = handle.service
    # A 20 Hz robot's budget of 150 ms; one batch takes ~5 ms alone. Generous because the CPU is
    # shared with other test runs; without the gate, text load pushes robots past 80 ms budgets
    # on this machine (bench/measurement in the report), with it their p50 stays ~10 ms.
    deadline_s = 0.15
    outcomes: list[str] = []
    latencies: list[float] = []
    text_tokens: list[int] = []

    async def robot_loop(i: int, stop_at: float) -> None:
        period = 1 / 20
        nxt = time.perf_counter() + i * period / 4
        while time.perf_counter() < stop_at:
            await asyncio.sleep(max(0.0, nxt - time.perf_counter()))
            nxt += period
            sent = time.perf_counter()
            try:
                item = runner.submit(obs, tenant=robot, session=f"r{i}", deadline=sent + deadline_s)
                result = await item.future
                outcomes.append("late" if result.late else "ok")
                latencies.append(time.perf_counter() - sent)
            except Refusal as exc:
                outcomes.append(exc.code.value)

    async def text_loop(i: int, stop_at: float) -> None:
        n = 0
        while time.perf_counter() < stop_at:
            req = GenerationRequest("completion", "text", prompt=f"writer {i} request {n} " * 4,
                                    params=SamplingParams(max_tokens=64, ignore_eos=True, seed=n), max_tokens_set=True)
            job = svc.submit(req, writer, f"w{i}")
            async for ev in job.stream():
                text_tokens.append(getattr(ev, "tokens", 0))
            n += 1

    async def scenario() -> None:
        stop_at = time.perf_counter() + 3.0
        await asyncio.gather(*(text_loop(i, stop_at) for i in range(8)), *(robot_loop(i, stop_at) for i in range(4)))

    try:
        loop.run(scenario(), timeout=60)
        paused = svc.models["text"].backend.paused_s
    finally:
        loop.run(runner.stop())
        handle.close()
        loop.close()
    assert len(outcomes) >= 100
    counts = {o: outcomes.count(o) for o in set(outcomes)}
    # No robot request is late. A rare deadline_unmeetable refusal is the admission controller
    # reacting to the shared CPU's noise (its service estimate is mean + 2 deviations; CI had one
    # in 217 on 2 cores), not text getting ahead of robots: without the gate robots miss their
    # deadlines in bulk. So: none late, and at most 2% refused.
    assert counts.get("late", 0) == 0, counts
    assert counts.get("ok", 0) >= 0.98 * len(outcomes), counts
    assert max(latencies) < deadline_s
    # The text side was really loaded (not starved into a vacuous pass) and really yielded.
    assert sum(text_tokens) >= 500 and paused > 0
