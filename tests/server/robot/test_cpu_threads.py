"""torch's intra-op threads for CPU policies: the choice (config, OMP_NUM_THREADS, cores over
lanes) and a served torch policy running its warm-up and its lanes' batches on that many."""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import pytest

from chunkline.policies.base import Policy, example_observation, validate_observation
from chunkline.policies.registry import load_policy
from chunkline.server.core.serving import ServingCore
from chunkline.server.core.tenants import TenantRegistry
from chunkline.server.robot import cpu_threads
from chunkline.server.robot.config import PolicyConfig
from chunkline.server.robot.cpu_threads import ThreadChoice, choose_torch_threads, on_cpu, policy_threads
from chunkline.server.robot.service import RobotActions

ANON = TenantRegistry.anonymous()
TENANT = next(iter(ANON.tenants.values()))


@pytest.mark.parametrize(("configured", "env", "cores", "lanes", "expected"), [
    (None, {}, 2, 1, ThreadChoice(1, "auto")),    # the event loop keeps a core: 2 cores, 1 lane -> 1
    (None, {}, 16, 1, ThreadChoice(15, "auto")),
    (None, {}, 16, 3, ThreadChoice(5, "auto")),   # every CPU lane may run a batch at once
    (None, {}, 1, 1, ThreadChoice(1, "auto")),
    (None, {}, 4, 8, ThreadChoice(1, "auto")),    # never below one
    (None, {"OMP_NUM_THREADS": "3"}, 16, 1, ThreadChoice(3, "OMP_NUM_THREADS")),
    (None, {"OMP_NUM_THREADS": " 4,2"}, 16, 1, ThreadChoice(4, "OMP_NUM_THREADS")),  # a nested list: the outer level
    (None, {"OMP_NUM_THREADS": "0"}, 16, 1, ThreadChoice(15, "auto")),
    (None, {"OMP_NUM_THREADS": "many"}, 16, 1, ThreadChoice(15, "auto")),
    (6, {"OMP_NUM_THREADS": "3"}, 2, 4, ThreadChoice(6, "config")),  # the policy's setting comes first
])
def test_the_thread_count_chosen(configured: int | None, env: dict[str, str], cores: int, lanes: int,
                                 expected: ThreadChoice) -> None:
    got = choose_torch_threads(configured, env, cores, lanes)
    assert (got.count, got.source.partition(":")[0]) == (expected.count, expected.source)


def test_cores_are_shared_by_the_lanes_of_cpu_policies_only() -> None:
    pcs = [PolicyConfig(ref="a", lanes=2), PolicyConfig(ref="b", device="CPU:0"), PolicyConfig(ref="g", device="cuda:0", lanes=4),
           PolicyConfig(ref="c", torch_threads=2)]
    chosen = policy_threads(pcs, env={}, cores=8)
    assert {n: c.count for n, c in chosen.items()} == {"a": 1, "b": 1, "c": 2}, "7 cores over 4 CPU lanes; cuda untouched"
    assert [on_cpu(d) for d in ("cpu", "cpu:0", "cuda", "cuda:1", "mps")] == [True, True, False, False, False]


def test_torch_threads_is_a_serve_flag() -> None:
    from chunkline.server.entrypoints.server_flags import add_server_flags, server_config_from_args

    p = argparse.ArgumentParser()
    add_server_flags(p)
    cfg = server_config_from_args(p.parse_args(["--no-auth", "--policy", "noop", "--policy", "reach-bc", "--torch-threads", "3"]))
    assert [pc.torch_threads for pc in cfg.policies] == [3, 3]
    assert [pc.torch_threads for pc in server_config_from_args(p.parse_args(["--no-auth"])).policies] == [None]


class ThreadsSeen(Policy):
    """A served policy as loaded, recording torch's intra-op threads on each thread that runs it."""

    def __init__(self, inner: Policy) -> None:
        self.inner, self.name, self.spec = inner, inner.name, inner.spec
        self.seen: dict[str, set[int]] = {}

    @property
    def fingerprint(self) -> str:
        return self.inner.fingerprint

    def infer_batch(self, obs: Mapping[str, Any]) -> np.ndarray:
        import torch

        self.seen.setdefault(threading.current_thread().name, set()).add(torch.get_num_threads())
        return self.inner.infer_batch(obs)


@pytest.fixture
def torch_defaults(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """torch's count as this test started, restored after (a thread that sets it sets new threads' default too)."""
    torch = pytest.importorskip("torch")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(before)  # what a new thread takes too, whatever a test before set elsewhere
    yield before
    torch.set_num_threads(before)


def serve(configs: list[PolicyConfig]) -> tuple[dict[str, ThreadsSeen], dict[str, Any]]:
    """Serve ``configs`` (each a real reach-bc), one request each; what each policy saw, and the stats."""
    loaded: dict[str, ThreadsSeen] = {}

    def load(pc: PolicyConfig) -> Policy:
        loaded[pc.model_name] = ThreadsSeen(load_policy(pc.ref))  # on the CPU, whatever pc.device says
        return loaded[pc.model_name]

    async def go() -> dict[str, Any]:
        actions = RobotActions(ServingCore(ANON, authenticate=False), configs, load=load)
        await actions.start()
        try:
            for name, runner in actions.runners.items():
                obs = validate_observation(runner.policy.spec, example_observation(runner.policy.spec))
                item = runner.submit(obs, tenant=TENANT, session=name, deadline=time.perf_counter() + 10)
                await item.future
            return actions.stats()
        finally:
            await actions.stop()

    return loaded, asyncio.run(go())


def test_a_served_torch_policy_runs_on_the_chosen_threads(torch_defaults: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # Cores faked so that the auto count (usable cores less one) differs from torch's own default.
    monkeypatch.setattr(cpu_threads, "usable_cores", lambda: torch_defaults + 3)
    loaded, stats = serve([PolicyConfig(ref="reach-bc", background_timing=False)])
    auto = torch_defaults + 2
    seen = loaded["reach-bc"].seen
    assert any(name.startswith("lane-reach-bc") for name in seen), seen
    assert all(counts == {auto} for counts in seen.values()), f"the lane, warm-up and timing: {seen}"
    assert stats["reach-bc"]["torch_threads"] == auto


def test_each_cpu_policy_keeps_its_own_count_in_its_own_lanes(torch_defaults: int) -> None:
    # torch's count is per thread: two policies' lanes run on different counts side by side.
    loaded, stats = serve([PolicyConfig(ref="reach-bc", name="one", torch_threads=1, background_timing=False),
                           PolicyConfig(ref="reach-bc", name="three", torch_threads=3, lanes=2, background_timing=False)])
    lanes = {name: {n: c for n, c in p.seen.items() if n.startswith("lane-")} for name, p in loaded.items()}
    assert lanes["one"] and all(c == {1} for c in lanes["one"].values()), lanes
    assert lanes["three"] and all(c == {3} for c in lanes["three"].values()), lanes
    assert (stats["one"]["torch_threads"], stats["three"]["torch_threads"]) == (1, 3)


def test_a_policy_on_another_device_keeps_torch_s_own_count(torch_defaults: int) -> None:
    # No CUDA here: a CPU policy served under a cuda device name stands in (nothing calls torch.cuda).
    _loaded, stats = serve([PolicyConfig(ref="reach-bc", device="cuda:0", background_timing=False)])
    assert stats["reach-bc"]["torch_threads"] is None
    # Served after a CPU policy whose count was set (threads started later would take it): torch's own.
    loaded, stats = serve([PolicyConfig(ref="reach-bc", name="cpu", torch_threads=torch_defaults + 2, background_timing=False),
                           PolicyConfig(ref="reach-bc", name="gpu", device="cuda", background_timing=False)])
    assert all(c == {torch_defaults} for c in loaded["gpu"].seen.values()), loaded["gpu"].seen
    assert any(n.startswith("lane-gpu") for n in loaded["gpu"].seen)
    assert all(c == {torch_defaults + 2} for c in loaded["cpu"].seen.values()), loaded["cpu"].seen
    assert (stats["cpu"]["torch_threads"], stats["gpu"]["torch_threads"]) == (torch_defaults + 2, None)


def test_omp_num_threads_from_the_environment_is_kept(torch_defaults: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch_defaults + 2))
    monkeypatch.setattr(cpu_threads, "usable_cores", lambda: 64)
    loaded, stats = serve([PolicyConfig(ref="reach-bc", background_timing=False)])
    assert all(c == {torch_defaults + 2} for c in loaded["reach-bc"].seen.values())
    assert stats["reach-bc"]["torch_threads"] == torch_defaults + 2
