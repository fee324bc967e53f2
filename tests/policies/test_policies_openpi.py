"""The openpi adapter, and the test-helper policies the server's tests rely on."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
from policies_for_tests import CountingPolicy

from chunkline.policies import (
    InjectedPolicyFailure,
    OpenPIPolicy,
    PolicyConfigError,
    PolicyLoadError,
    PolicyOutputError,
    example_observation,
    stack_observations,
)
from chunkline.policies.embedded import FailingPolicy, NoopPolicy, SleepPolicy, aloha_spec
from chunkline.policies.openpi_adapter import unflatten


class FakeOpenPI:
    """openpi's interface: one unbatched observation in, a dict with actions out."""

    def __init__(self, actions: Any = None, result: Any = None) -> None:
        self.calls: list[dict[str, Any]] = []
        self.metadata = {"action_horizon": 50, "precision": "bfloat16", "name": "overridden"}
        self._actions = actions
        self._result = result

    def infer(self, obs: dict[str, Any]) -> Any:
        self.calls.append(obs)
        if self._result is not None:
            return self._result
        if self._actions is not None:
            return {"actions": self._actions, "policy_timing": {"infer_ms": 1.0}}
        # depends on the item, so a mixed-up batch would show
        return {"actions": np.full((50, 14), float(obs["state"][0]), np.float64)}


def _batch(n: int, prompts: list[str] | None = None) -> dict[str, Any]:
    spec = aloha_spec()
    items = [example_observation(spec, np.random.default_rng(i)) for i in range(n)]
    for i, item in enumerate(items):
        if prompts is None or not prompts[i]:
            item.pop("prompt")
        else:
            item["prompt"] = prompts[i]
    return stack_observations(spec, items)


def test_calls_infer_per_item_in_order() -> None:
    fake = FakeOpenPI()
    policy = OpenPIPolicy(fake, aloha_spec())
    obs = _batch(3, ["a", "", "c"])
    out = policy.infer_batch(obs)
    assert out.shape == (3, 50, 14) and out.dtype == np.float32
    np.testing.assert_allclose(out[:, 7, 3], obs["state"][:, 0], rtol=1e-6)
    assert len(fake.calls) == 3
    assert [c.get("prompt") for c in fake.calls] == ["a", None, "c"]  # absent prompt: not sent
    assert fake.calls[0]["images/cam_high"].shape == (224, 224, 3)


def test_nested_layout() -> None:
    fake = FakeOpenPI()
    OpenPIPolicy(fake, aloha_spec(), nest=True).infer_batch(_batch(1, ["go"]))
    call = fake.calls[0]
    assert set(call) == {"images", "state", "prompt"}
    assert set(call["images"]) == {"cam_high", "cam_left_wrist", "cam_right_wrist"}
    assert unflatten({"a/b/c": 1, "a/d": 2, "e": 3}) == {"a": {"b": {"c": 1}, "d": 2}, "e": 3}


def test_metadata_merged_but_ours_wins() -> None:
    policy = OpenPIPolicy(FakeOpenPI(), aloha_spec(), name="pi0")
    meta = policy.metadata()
    assert meta["precision"] == "bfloat16" and meta["name"] == "pi0"
    assert meta["fingerprint"] == policy.fingerprint and meta["action_horizon"] == 50


@pytest.mark.parametrize(
    "result",
    [
        {"actions": np.zeros((49, 14), np.float32)},
        {"actions": np.zeros((50, 32), np.float32)},  # un-sliced padded action dim
        {"actions": np.zeros((1, 50, 14), np.float32)},
        {"actions": np.zeros((50, 14), np.int64)},
        {"actions": [[0.0] * 14] * 50},
        {"action": np.zeros((50, 14), np.float32)},
        np.zeros((50, 14), np.float32),
    ],
)
def test_bad_results_refused(result: Any) -> None:
    with pytest.raises(PolicyOutputError):
        OpenPIPolicy(FakeOpenPI(result=result), aloha_spec()).infer_batch(_batch(1))


def test_nan_passes_and_needs_infer() -> None:
    out = OpenPIPolicy(FakeOpenPI(actions=np.full((50, 14), np.nan)), aloha_spec()).infer_batch(_batch(2))
    assert np.isnan(out).all()
    with pytest.raises(PolicyLoadError):
        OpenPIPolicy(object(), aloha_spec())


# ---------------------------------------------------------------------------- test helpers


def test_noop() -> None:
    policy = NoopPolicy()
    out = policy.infer_batch(_batch(4))
    assert out.shape == (4, 50, 14) and out.dtype == np.float32 and not out.any()
    assert policy.infer_batch(_batch(1)) is not policy.infer_batch(_batch(1))  # fresh each call


def test_sleep_policy_blocks_per_batch_not_at_warmup() -> None:
    slept: list[float] = []
    policy = SleepPolicy(2.0, sleep=slept.append)
    policy.warmup()
    assert slept == []
    out = policy.infer_batch(_batch(3))
    assert slept == [2.0] and out.shape == (3, 50, 14)
    assert policy.name == "sleep:2"
    for bad in (-1.0, float("nan")):
        with pytest.raises(PolicyConfigError):
            SleepPolicy(bad)


def test_sleep_policy_really_blocks_its_thread() -> None:
    # an event set by another thread while infer_batch runs: proves the call blocks in sleep()
    entered, release = threading.Event(), threading.Event()

    def sleep(seconds: float) -> None:
        entered.set()
        assert release.wait(timeout=10)

    policy = SleepPolicy(2.0, sleep=sleep)
    worker = threading.Thread(target=policy.infer_batch, args=(_batch(1),))
    worker.start()
    assert entered.wait(timeout=10)
    assert worker.is_alive()
    release.set()
    worker.join(timeout=10)
    assert not worker.is_alive()


def test_failing_policy() -> None:
    policy = FailingPolicy("boom", succeed_first=2)
    policy.warmup()  # loads fine
    assert policy.infer_batch(_batch(1)).shape == (1, 50, 14)
    assert policy.infer_batch(_batch(2)).shape == (2, 50, 14)
    for _ in range(2):
        with pytest.raises(InjectedPolicyFailure, match="boom"):
            policy.infer_batch(_batch(1))
    assert policy.failures == 2


def test_counting_policy_records_sizes_from_many_threads() -> None:
    policy = CountingPolicy()
    policy.warmup()
    assert policy.batch_sizes == []
    batches = {n: _batch(n) for n in (1, 2, 3)}
    threads = [threading.Thread(target=policy.infer_batch, args=(batches[1 + i % 3],)) for i in range(30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(policy.batch_sizes) == sorted([1 + i % 3 for i in range(30)])
    assert policy.calls == 30 and policy.fingerprint == NoopPolicy().fingerprint
    policy.reset()
    assert policy.batch_sizes == []


def test_counting_wraps_another_policy() -> None:
    class Ones(NoopPolicy):
        def infer_batch(self, obs: Mapping[str, Any]) -> np.ndarray:
            return super().infer_batch(obs) + 1.0

    policy = CountingPolicy(Ones(name="ones"))
    assert policy.name == "ones"
    assert (policy.infer_batch(_batch(2)) == 1.0).all() and policy.batch_sizes == [2]
