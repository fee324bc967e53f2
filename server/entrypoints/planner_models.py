"""The language models the server hands its planners: the embedded text model behind the
planner class's :class:`~chunkline.server.planner.constrained.TokenModel` interface.

This lives with the entrypoints because it joins two request classes (the planner must not import
the text class, nor the text class the planner).
"""

from __future__ import annotations

import numpy as np

from chunkline.server.planner import PlannerConfig
from chunkline.server.planner.constrained import ConstrainedPlanner
from chunkline.server.planner.planners import Planner
from chunkline.server.planner.service import default_planner_factory

__all__ = ["EmbeddedTokenModel", "planner_factory"]


class EmbeddedTokenModel:
    """The embedded text model (TinyLM, byte tokens), one sequence at a time.

    Args:
        seed: the seed of its weights.
    """

    def __init__(self, seed: int = 0) -> None:
        from chunkline.server.text.model import TinyLM, TinyLMConfig

        cfg = TinyLMConfig(seed=seed)
        self._model = TinyLM(cfg, max_slots=1, fixed_shape=False)
        self.context = cfg.context
        self.fingerprint = f"tinylm:{self._model.weights_digest}:{TinyLM.NUMERICS}"
        self._position = 0

    def start(self, prompt: bytes) -> np.ndarray:
        self._position = len(prompt)
        return self._model.prefill(0, list(prompt))

    def step(self, token: int) -> np.ndarray:
        logits = self._model.decode([0], [token], [self._position])[0]
        self._position += 1
        return logits


def planner_factory(cfg: PlannerConfig) -> Planner:
    """Every planner backend, ``constrained`` included (it needs the embedded text model)."""
    if cfg.backend == "constrained":
        return ConstrainedPlanner(cfg.name, lambda: EmbeddedTokenModel(cfg.model_seed), cfg.max_steps, cfg.workspace_area())
    return default_planner_factory(cfg)
