"""Robots first: robot-policy and text traffic on one event loop, sharing the quota manager, the
metrics and the CPU. With robots given priority (tenants' class priorities), the text engine holds
its steps while robot work is queued or running, so text load cannot push robot requests past
their deadlines; and the gate that enforces it, unit by unit."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

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


class GateProbe:
    """The text engine's ``yield_to``, wrapping the real gate to count what the engine did.

    The engine asks it on the engine thread before every step, so two checks are exact whatever
    the machine's load: after a "hold" the engine takes no step before asking again
    (``stepped_while_held``), and a step let through while robot work was active both just before
    and just after the question is one that slipped past the gate (``slipped``). Only a robot
    batch moving from queued to running during the gate's read can make a correct gate slip.
    """

    def __init__(self, gate: Callable[[int], bool], robot_active: Callable[[], bool], steps: Callable[[], int]) -> None:
        self._gate = gate
        self._robot_active = robot_active
        self._steps = steps
        self._held_at: int | None = None  # the step count when the last answer was "hold"
        self.held = 0
        self.let_through = 0
        self.slipped = 0
        self.stepped_while_held = 0

    def __call__(self, priority: int) -> bool:
        steps = self._steps()
        if self._held_at is not None and steps != self._held_at:
            self.stepped_while_held += 1
        before = self._robot_active()
        hold = self._gate(priority)
        after = self._robot_active()
        if hold:
            self.held += 1
        else:
            self.let_through += 1
            if before and after:
                self.slipped += 1
        self._held_at = steps if hold else None
        return hold

    def __repr__(self) -> str:
        return (f"GateProbe(held={self.held}, let_through={self.let_through}, slipped={self.slipped}, "
                f"stepped_while_held={self.stepped_while_held})")


@pytest.mark.slow
def test_text_load_cannot_push_robots_past_their_deadlines() -> None:
    """Robots first, checked by counting rather than by the clock: while a robot request is queued
    or running, the text engine takes no step (beyond the one already in progress), so text load
    adds at most one text step to a robot's wait. Whether a robot then meets its deadline is the
    admission controller's call on the machine's speed (a CPU shared with other work slows robot
    batches with or without text, and admission refuses what it cannot serve in time); this test
    checks what text load may not do, whatever the machine's load."""
    from chunkline.policies.base import example_observation
    from chunkline.policies.registry import load_policy

    loop = LoopThread()
    robot = TenantInfo("robot", class_priority={"policy": 10, "text": 0})
    writer = TenantInfo("writer")
    reg, _ = registry_with_keys({"robot": robot, "writer": writer})
    runners: list[ModelRunner] = []
    gate = PolicyPriorityGate(lambda: [r.core for r in runners], lambda: handle.quotas.registry)

    def robot_active() -> bool:
        return bool(runners) and (runners[0].core.queued_for("robot") > 0 or runners[0].core.running_for("robot") > 0)

    probe = GateProbe(gate, robot_active, lambda: handle.service.models["text"].backend.engine.steps)
    text_model = TextModelConfig(name="text", max_batch=8, max_output_tokens=64)
    handle = ServiceHandle([text_model], loop, reg, yield_to=probe)
    handle.start()
    policy = load_policy("loadtest")
    policy.warmup()
    obs = example_observation(policy.spec, np.random.default_rng(0))

    async def make_runner() -> ModelRunner:
        # The robot lane and the text engine share the same quota manager, as in the server.
        return ModelRunner("pi", policy, quotas=handle.quotas, admission=AdmissionConfig(max_queue=64, max_batch_size=4),
                           batching=BatchPolicy(max_batch_size=4, max_batch_wait=0.002), service=ServiceTimeModel())

    runners.append(loop.run(make_runner()))
    runner = runners[0]
    svc = handle.service
    deadline_s = 0.15  # a 20 Hz robot's budget
    outcomes: list[str] = []
    text_tokens: list[int] = []

    async def robot_loop(i: int, stop_at: float) -> None:
        period = 1 / 20
        nxt = time.perf_counter() + i * period / 4
        while time.perf_counter() < stop_at:
            await asyncio.sleep(max(0.0, nxt - time.perf_counter()))
            nxt += period
            try:
                item = runner.submit(obs, tenant=robot, session=f"r{i}", deadline=time.perf_counter() + deadline_s)
                outcomes.append("late" if (await item.future).late else "ok")
            except Refusal as exc:
                outcomes.append(exc.code.value)

    async def text_loop(i: int, stop_at: float) -> None:
        n = 0
        while time.perf_counter() < stop_at:  # at least one whole request per writer
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
        loop.run(scenario(), timeout=120)
    finally:
        loop.run(runner.stop())
        handle.close()
        loop.close()
    counts = {o: outcomes.count(o) for o in set(outcomes)}
    # Both sides were really loaded: every writer finished a 64-token request, robots were served.
    assert sum(text_tokens) >= 8 * 64 and counts.get("ok", 0) > 0, counts
    # The engine held its steps for robot work, and never stepped while held.
    assert probe.held > 0 and probe.let_through > 0, probe
    assert probe.stepped_while_held == 0, probe
    # Without the gate most text steps run while robots have work; with it, only the rare read
    # racing a queued-to-running move of a robot batch slips through.
    assert probe.slipped <= max(1, 0.05 * probe.let_through), probe
