"""The scheduling shell in-process: batches form, results split back to the right requests,
failures stay in their batch, cancelled work leaves its batch, per-session state."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np
import pytest
from helpers import aloha_obs
from policies_for_tests import CallCounter, CountingPolicy
from runner_helpers import CLOCK

from chunkline.client.wire.errors import ErrorCode
from chunkline.policies.base import Policy, stack_observations, validate_observation
from chunkline.policies.registry import load_policy
from chunkline.server.core.admission import AdmissionConfig, ServiceTimeModel
from chunkline.server.core.quotas import QuotaManager
from chunkline.server.core.tenants import TenantRegistry
from chunkline.server.errors import Refusal
from chunkline.server.robot.batching import BatchPolicy
from chunkline.server.robot.runner import ModelRunner

ANON = TenantRegistry.anonymous()
TENANT = next(iter(ANON.tenants.values()))


class Gate(Policy):
    """Wraps a policy; its first batch blocks until the test opens the gate, so later requests queue."""

    def __init__(self, inner: Policy) -> None:
        self.inner, self.name, self.spec, self.stateful = inner, inner.name, inner.spec, inner.stateful
        self.gate = threading.Event()
        self.sizes: list[int] = []

    @property
    def fingerprint(self) -> str:
        return self.inner.fingerprint

    def infer_batch(self, obs: Any) -> np.ndarray:
        self.sizes.append(len(obs["state"]))
        self.gate.wait(10)
        return self.inner.infer_batch(obs)

    def new_session_state(self) -> Any:
        return self.inner.new_session_state()

    def infer_batch_with_state(self, obs: Any, states: Any):
        self.sizes.append(len(obs["state"]))
        self.gate.wait(10)
        return self.inner.infer_batch_with_state(obs, states)


def make_runner(policy: Policy, max_batch: int = 8, wait_s: float = 0.0) -> ModelRunner:
    return ModelRunner(
        "m", policy, quotas=QuotaManager(ANON), admission=AdmissionConfig(max_batch_size=max_batch),
        batching=BatchPolicy(max_batch_size=max_batch, max_batch_wait=wait_s), service=ServiceTimeModel(initial={1: 0.001}),
        clock=CLOCK,
    )


def validated(policy: Policy, seed: int) -> dict[str, Any]:
    return validate_observation(policy.spec, aloha_obs(seed))


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_batched_outputs_equal_each_request_run_alone(backend: str) -> None:
    inner = load_policy("loadtest", backend=backend)
    inner.warmup()
    gate = Gate(inner)

    async def go():
        runner = make_runner(gate)
        first = runner.submit(validated(inner, 100), tenant=TENANT, session="s0", deadline=1e12)
        await asyncio.sleep(0.05)  # the lane is now blocked on the first batch
        items = [runner.submit(validated(inner, i), tenant=TENANT, session=f"s{i}", deadline=1e12) for i in range(1, 6)]
        gate.gate.set()
        results = await asyncio.gather(first.future, *(i.future for i in items))
        await runner.stop()
        return results

    results = asyncio.run(go())
    assert gate.sizes == [1, 5], "the five queued requests must run as one batch"
    assert [r.batch_size for r in results] == [1, 5, 5, 5, 5, 5]
    for seed, result in zip([100, 1, 2, 3, 4, 5], results, strict=False):
        alone = inner.infer_batch(stack_observations(inner.spec, [validated(inner, seed)]))[0]
        np.testing.assert_allclose(result.actions, alone, rtol=1e-4, atol=1e-5)


def test_batches_never_exceed_max_size() -> None:
    counting = CountingPolicy()
    gate = Gate(counting)

    async def go():
        runner = make_runner(gate, max_batch=4)
        items = [runner.submit(validated(counting, i), tenant=TENANT, session=f"s{i}", deadline=1e12) for i in range(11)]
        await asyncio.sleep(0.05)
        gate.gate.set()
        await asyncio.gather(*(i.future for i in items))
        await runner.stop()

    asyncio.run(go())
    assert max(gate.sizes) <= 4 and sum(gate.sizes) == 11


def test_a_failing_batch_does_not_affect_the_next() -> None:
    from policies_for_tests import flaky

    inner = flaky()
    gate = Gate(inner)

    async def go():
        runner = make_runner(gate)
        poison = validated(inner, 0)
        poison["state"] = poison["state"].copy()
        poison["state"][0] = 1e3
        first = runner.submit(poison, tenant=TENANT, session="a", deadline=1e12)
        gate.gate.set()
        with pytest.raises(Refusal) as info:
            await first.future
        second = runner.submit(validated(inner, 1), tenant=TENANT, session="b", deadline=1e12)
        result = await second.future
        await runner.stop()
        return info.value, result

    err, result = asyncio.run(go())
    assert err.code == ErrorCode.POLICY_FAILED
    assert result.actions.shape == (50, 14)


def test_a_cancelled_request_is_dropped_from_its_batch() -> None:
    counting = CountingPolicy()
    gate = Gate(counting)

    async def go():
        runner = make_runner(gate)
        first = runner.submit(validated(counting, 0), tenant=TENANT, session="a", deadline=1e12)
        await asyncio.sleep(0.05)
        queued = [runner.submit(validated(counting, i), tenant=TENANT, session=f"r{i}", deadline=1e12) for i in range(1, 4)]
        runner.cancel(queued[1])  # the robot disconnected
        gate.gate.set()
        results = await asyncio.gather(first.future, queued[0].future, queued[2].future)
        with pytest.raises(Refusal) as info:
            await queued[1].future
        await runner.stop()
        return results, info.value

    results, err = asyncio.run(go())
    assert err.code == ErrorCode.CANCELLED
    assert gate.sizes == [1, 2]


def test_a_requests_listener_is_told_once_as_the_runner_resolves_it_before_any_done_callback() -> None:
    counting = CountingPolicy()
    gate = Gate(counting)

    async def go() -> tuple[list[tuple[int, bool]], list[int]]:
        runner = make_runner(gate)
        told: list[tuple[int, bool]] = []  # (request, its future done when told)
        callbacks: list[int] = []  # how many were told when the first done-callback ran

        def listen(n: int) -> Any:
            item = runner.submit(validated(counting, n), tenant=TENANT, session=f"r{n}", deadline=1e12)
            item.on_answered = lambda: told.append((n, item.future.done()))
            item.future.add_done_callback(lambda _: callbacks.append(len(told)))
            return item

        running = listen(0)
        await asyncio.sleep(0.05)  # it runs (the gate holds it); the next two queue
        queued = [listen(1), listen(2)]
        runner.cancel(queued[0])
        assert told == [(1, True)]  # at once, as it is answered `cancelled`
        gate.gate.set()
        await asyncio.gather(running.future, queued[1].future)
        assert all(item.on_answered is None for item in (running, *queued))  # told once, then dropped
        await runner.stop()
        return told, callbacks

    told, callbacks = asyncio.run(go())
    assert told == [(1, True), (0, True), (2, True)]
    assert callbacks == [1, 2, 3]  # each done-callback ran after its own request's listener


def test_expired_work_is_answered_at_its_deadline_while_the_lane_is_busy() -> None:
    counting = CountingPolicy()
    gate = Gate(counting)

    async def go():
        runner = make_runner(gate)
        asyncio.get_running_loop()
        runner.submit(validated(counting, 0), tenant=TENANT, session="a", deadline=1e12)
        await asyncio.sleep(0.02)
        soon = runner.submit(validated(counting, 1), tenant=TENANT, session="b", deadline=CLOCK() + 0.05)
        with pytest.raises(Refusal) as info:
            await asyncio.wait_for(soon.future, 2)
        answered_while_blocked = not gate.gate.is_set()
        gate.gate.set()
        await runner.stop()
        return info.value, answered_while_blocked

    err, early = asyncio.run(go())
    assert err.code == ErrorCode.DEADLINE_EXCEEDED and early


def test_session_state_is_kept_per_session_and_freed() -> None:
    gate = Gate(CallCounter())
    gate.gate.set()

    async def go():
        runner = make_runner(gate)
        seen: dict[str, list[float]] = {"a": [], "b": []}
        for _ in range(3):
            items = [(s, runner.submit(validated(gate, 0), tenant=TENANT, session=s, deadline=1e12)) for s in ("a", "b", "a")]
            for s, item in items:
                seen[s].append(float((await item.future).actions[0, 0]))
        states_open = runner.session_states
        runner.release_session("a")
        runner.release_session("b")
        await runner.stop()
        return seen, states_open, runner.session_states

    seen, open_states, after = asyncio.run(go())
    # "a" sends two requests per round (never in one batch), "b" one.
    assert seen["b"] == [1.0, 2.0, 3.0]
    assert seen["a"] == sorted(seen["a"]) and seen["a"][-1] == 6.0
    assert open_states == 2 and after == 0


class Gates(Gate):
    """Like :class:`Gate`, but each batch waits on a gate of its own (in order)."""

    def __init__(self, inner: Policy, n: int) -> None:
        super().__init__(inner)
        self.gates = [threading.Event() for _ in range(n)]

    def infer_batch(self, obs: Any) -> np.ndarray:
        gate = self.gates[len(self.sizes)]
        self.sizes.append(len(obs["state"]))
        gate.wait(10)
        return self.inner.infer_batch(obs)


def test_a_running_batch_answers_each_request_at_its_own_deadline() -> None:
    counting = CountingPolicy()
    gates = Gates(counting, 2)

    async def go():
        runner = make_runner(gates, max_batch=4)
        blocker = runner.submit(validated(counting, 0), tenant=TENANT, session="a", deadline=CLOCK() + 60)
        await asyncio.sleep(0.02)  # the lane is now blocked: the next three queue, then run as one batch
        now = CLOCK()
        soon, later, never = (runner.submit(validated(counting, i), tenant=TENANT, session=f"s{i}", deadline=now + budget)
                              for i, budget in ((1, 0.3), (2, 1.5), (3, 60.0)))
        gates.gates[0].set()
        await blocker.future  # the batch of three now runs, blocked on the second gate
        with pytest.raises(Refusal) as first:
            await soon.future
        pending_after_first = not later.future.done() and not never.future.done()
        with pytest.raises(Refusal) as second:
            await later.future
        still_running = not never.future.done() and not gates.gates[1].is_set()
        gates.gates[1].set()
        result = await never.future
        await runner.stop()
        return first.value, second.value, pending_after_first, still_running, result, gates.sizes

    first, second, pending, running, result, sizes = asyncio.run(go())
    assert first.code == second.code == ErrorCode.DEADLINE_EXCEEDED
    assert pending and running  # one timer at a time, each request at its own deadline
    assert result.actions.shape == (50, 14) and sizes == [1, 3]


def test_an_idle_runner_refusing_for_stale_estimates_re_measures_and_admits_again() -> None:
    """Estimates left high by a slow spell: everything is refused as unmeetable, nothing runs, so
    no batch could ever show the spell is over; an idle re-measurement does."""
    policy = load_policy("noop")
    clock = [100.0]

    async def go() -> tuple[float, Any]:
        runner = ModelRunner(
            "m", policy, quotas=QuotaManager(ANON), admission=AdmissionConfig(max_batch_size=1),
            batching=BatchPolicy(max_batch_size=1, max_batch_wait=0.0), service=ServiceTimeModel(initial={1: 5.0}),
            clock=lambda: clock[0],
        )
        obs = validated(policy, 0)
        with pytest.raises(Refusal) as refused:
            runner.submit(obs, tenant=TENANT, session="s", deadline=clock[0] + 0.1)
        assert refused.value.code is ErrorCode.DEADLINE_UNMEETABLE
        assert runner.remeasure.future is not None, "idle and refusing: a re-measurement starts"
        # the stale estimate is named, with the re-measurement's end as the retry time
        assert refused.value.retry_after_ms == runner.remeasure.interval_s * 1000.0 and "re-measuring" in refused.value.message
        with pytest.raises(Refusal):  # one at a time: no second probe while the first runs
            runner.submit(obs, tenant=TENANT, session="s", deadline=clock[0] + 0.1)
        seconds = await runner.remeasure.future
        clock[0] += 0.5  # within the re-measurement interval: the next refusal would not probe again
        item = runner.submit(obs, tenant=TENANT, session="s", deadline=clock[0] + 0.1)
        result = await item.future
        await runner.stop()
        return seconds, result

    seconds, result = asyncio.run(go())
    assert seconds < 0.1
    assert result.actions.shape == (policy.spec.horizon, policy.spec.action_dim)


def test_a_busy_runner_does_not_probe() -> None:
    policy = load_policy("noop")
    gate = Gate(policy)

    async def go() -> None:
        runner = ModelRunner(
            "m", gate, quotas=QuotaManager(ANON), admission=AdmissionConfig(max_batch_size=1),
            batching=BatchPolicy(max_batch_size=1, max_batch_wait=0.0), service=ServiceTimeModel(initial={1: 0.05}),
        )
        runner.remeasure.interval_s = 0.0
        first = runner.submit(validated(policy, 0), tenant=TENANT, session="a", deadline=time.perf_counter() + 10)
        with pytest.raises(Refusal) as refused:  # the lane is busy for 50 ms more: 60 ms cannot be met
            runner.submit(validated(policy, 1), tenant=TENANT, session="b", deadline=time.perf_counter() + 0.06)
        assert refused.value.code is ErrorCode.DEADLINE_UNMEETABLE
        assert runner.remeasure.future is None, "work is running: its own samples will come"
        gate.gate.set()
        await first.future
        await runner.stop()

    asyncio.run(go())


def test_an_answered_request_is_freed_at_once_not_left_to_the_garbage_collector() -> None:
    # The observation of an answered request is freed as soon as its holders let go (no reference
    # cycle through the admission core's request): the server's frame reader reuses the buffer an
    # observation views only once nothing refers to it.
    import gc
    import weakref

    policy = load_policy("noop")

    async def go() -> list[weakref.ref[np.ndarray]]:
        runner = make_runner(policy)
        refs = []
        for i in range(3):
            obs = validated(policy, i)
            refs.append(weakref.ref(obs["state"]))
            item = runner.submit(obs, tenant=TENANT, session="s", deadline=1e12)
            await item.future
            del item, obs
        await runner.stop()
        return refs

    gc.disable()
    try:
        refs = asyncio.run(go())
        assert [r() for r in refs] == [None, None, None]
    finally:
        gc.enable()


@pytest.mark.parametrize("kind", ["stateful", "prefix", "failing"])
def test_requests_run_one_at_a_time_keep_their_sessions_state_prefix_and_failures_apart(kind: str) -> None:
    """Each session's policy state, each robot's prefix, and a failure as the request's own."""
    from policies_for_tests import PrefixEchoPolicy, flaky

    from chunkline.policies.prefix import ActionPrefix

    def requests(policy: Policy) -> list[tuple[str, dict[str, Any], ActionPrefix | None]]:
        if kind == "prefix":
            actions = np.arange(12, dtype=np.float32).reshape(4, 3)
            return [(s, {"state": np.full(2, i, np.float32)},
                     ActionPrefix.from_wire(actions + i, t0=0.0, dt=0.02, action_dim=3, horizon=8, delay_steps=i))
                    for i, s in enumerate(["a", "b", "a"])]
        obs = validated(policy, 0)
        bad = dict(obs, state=np.full_like(obs["state"], 500.0))
        return [("a", obs, None), ("a", bad if kind == "failing" else obs, None), ("b", obs, None), ("a", obs, None)]

    def answers() -> list[Any]:
        policy: Policy = {"stateful": CallCounter, "prefix": PrefixEchoPolicy, "failing": flaky}[kind]()

        async def go() -> list[Any]:
            runner = ModelRunner("m", policy, quotas=QuotaManager(ANON), admission=AdmissionConfig(max_batch_size=4, workers=1),
                                 batching=BatchPolicy(max_batch_size=4, max_batch_wait=0.0),
                                 service=ServiceTimeModel(initial={1: 1e-5}))
            out = []
            for session, obs, prefix in requests(policy):
                item = runner.submit(validate_observation(policy.spec, obs), tenant=TENANT, session=session,
                                     deadline=1e12, prefix=prefix)
                try:
                    result = await item.future
                    out.append((result.actions.tolist(), result.batch_size))
                except Refusal as exc:
                    out.append(exc.code)
            await runner.stop()
            return out

        return asyncio.run(go())

    got = answers()
    if kind == "prefix":  # each robot's own prefix comes back (the echo policy returns it)
        assert [a[0][0][0] for a in got] == [0.0, 1.0, 2.0]
    if kind == "failing":
        assert got[1] == ErrorCode.POLICY_FAILED and got[2] != ErrorCode.POLICY_FAILED
    if kind == "stateful":
        assert [a[0][0][0] for a in got] == [1.0, 2.0, 1.0, 3.0]
