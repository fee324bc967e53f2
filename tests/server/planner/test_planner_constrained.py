"""The constrained-decoding planner: whatever the model prefers, every plan it writes is valid,
targets come from the observation, and the embedded text model drives it end to end."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkline.server.entrypoints.planner_models import EmbeddedTokenModel, planner_factory
from chunkline.server.errors import Refusal
from chunkline.server.planner import PlannerConfig
from chunkline.server.planner.constrained import ConstrainedPlanner
from chunkline.server.planner.planners import PlanInput
from chunkline.server.planner.schema import validate_plan


class AdversarialModel:
    """Prefers, at every step, bytes the grammar forbids (its ranking among allowed ones is random)."""

    fingerprint = "fake"
    context = 512

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def _logits(self) -> np.ndarray:
        logits = self.rng.normal(0.0, 1.0, 264)
        logits[[ord("{"), ord("x"), ord("9"), 0, 255, 258]] = 100.0  # what a broken model would write
        return logits

    def start(self, prompt: bytes) -> np.ndarray:
        assert len(prompt) <= self.context
        return self._logits()

    def step(self, token: int) -> np.ndarray:
        return self._logits()


def _obs(ids: list[int], rng: np.random.Generator) -> dict[str, np.ndarray]:
    targets = np.array([[i, *rng.uniform(-0.2, 0.2, 2)] for i in ids], dtype=np.float64).reshape(-1, 3)
    return {"position": np.zeros(2), "targets": targets}


def _planner(model: object, max_steps: int = 4) -> ConstrainedPlanner:
    planner = ConstrainedPlanner("c", lambda: model, max_steps)  # type: ignore[arg-type,return-value]
    asyncio.run(planner.start())
    return planner


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 10_000), unique=True, max_size=12), st.integers(1, 6), st.integers(0, 2**32 - 1))
def test_every_plan_is_valid_whatever_the_model_prefers(ids: list[int], max_steps: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    obs = _obs(ids, rng)
    doc = _planner(AdversarialModel(seed), max_steps).decode(PlanInput(obs=obs, instruction="visit the targets"))
    validate_plan(doc.model_dump(), max_steps)
    assert 1 <= len(doc.steps) <= max_steps
    gotos = [s for s in doc.steps if s.skill == "goto"]
    assert len({s.target for s in gotos}) == len(gotos)  # each target at most once
    for step in gotos:
        row = obs["targets"][obs["targets"][:, 0] == int(step.target[1:])]  # type: ignore[index]
        assert row.shape == (1, 3) and step.goal == [float(row[0, 1]), float(row[0, 2])]  # goals from the observation
    assert all(s.skill == "goto" for s in doc.steps[:-1])  # hold and return end a plan


def test_the_embedded_text_model_plans_through_the_server_factory() -> None:
    planner = planner_factory(PlannerConfig(name="lm", backend="constrained", max_steps=3))
    assert isinstance(planner, ConstrainedPlanner)
    asyncio.run(planner.start())
    obs = _obs([3, 7, 11], np.random.default_rng(0))
    first = asyncio.run(planner.plan(PlanInput(obs=obs, instruction="visit"), deadline=1e9)).document
    again = asyncio.run(planner.plan(PlanInput(obs=obs, instruction="visit"), deadline=1e9)).document
    assert first == again  # greedy: deterministic for the same weights and observation
    validate_plan(first.model_dump(), 3)
    assert planner.metadata()["backend"] == "constrained" and planner.fingerprint.startswith("sha256:")
    assert EmbeddedTokenModel().fingerprint != EmbeddedTokenModel(seed=1).fingerprint


def test_a_bad_observation_is_refused_before_decoding() -> None:
    planner = _planner(AdversarialModel(0))
    with pytest.raises(Refusal):
        planner.check(PlanInput(obs={"position": np.zeros(3), "targets": np.zeros((0, 3))}))
