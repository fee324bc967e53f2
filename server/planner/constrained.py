"""A language-model planner whose every output is a valid plan: constrained decoding over a fixed
skill vocabulary.

The model writes the plan byte by byte, greedily, with every byte that would leave the grammar
masked: ``plan := step (";" step)* "."`` (at most ``max_steps``), ``step := "goto t<id>" | "hold"
| "return"`` (ids of targets pending in the observation, each once; ``hold`` and ``return`` end
it). Whatever its weights, the text parses into a plan that validates, the goals taken from the
observation. The model is reached through :class:`TokenModel`, so this class never imports the
text request class."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from chunkline.client.wire.errors import ErrorCode
from chunkline.server.errors import Refusal
from chunkline.server.planner.planners import (
    DEFAULT_WORKSPACE,
    PlanInput,
    PlanResult,
    Workspace,
    read_targets,
    target_planner_metadata,
)
from chunkline.server.planner.schema import PlanDocument, PlanStep, validate_plan

__all__ = ["TokenModel", "ConstrainedPlanner", "plan_grammar_choices"]

_SEP, _END = ord(";"), ord(".")


class TokenModel(Protocol):
    """A byte-level language model, one sequence at a time (token ``b`` is byte ``b`` for 0-255).

    ``fingerprint`` names its weights and arithmetic (it becomes part of the planner's).
    """

    fingerprint: str
    context: int  # longest sequence, prompt and output together

    def start(self, prompt: bytes) -> np.ndarray:
        """Run the prompt; the logits of the next token (at least 256 entries, bytes first)."""

    def step(self, token: int) -> np.ndarray:
        """Append one token; the logits of the next."""


def plan_grammar_choices(pending: list[int]) -> list[bytes]:
    """The steps a plan may take next, given the targets not yet visited in it."""
    return [f"goto t{i}".encode() for i in pending] + [b"hold", b"return"]


def _allowed_bytes(prefix: bytes, choices: list[bytes], can_continue: bool) -> list[int]:
    """Bytes that keep ``prefix`` (the current step written so far) inside the grammar."""
    allowed = {c[len(prefix)] for c in choices if len(c) > len(prefix) and c.startswith(prefix)}
    if prefix in choices:  # a complete step: end the plan, or go on to another one
        allowed.add(_END)
        if can_continue and prefix.startswith(b"goto"):
            allowed.add(_SEP)
    return sorted(allowed)


class ConstrainedPlanner:
    """The planner over a :class:`TokenModel` (see the module docstring).

    Args:
        name: the planner's served name.
        model_factory: builds the model on :meth:`start` (off the event loop).
        max_steps: most steps per plan.
        workspace: where positions and targets may lie; others are refused ``invalid_observation``.
    """

    def __init__(self, name: str, model_factory: Callable[[], TokenModel], max_steps: int = 4,
                 workspace: Workspace = DEFAULT_WORKSPACE) -> None:
        self.name = name
        self.max_steps = max_steps
        self.workspace = workspace
        self._factory = model_factory
        self._model: TokenModel | None = None
        self._lock = threading.Lock()  # one sequence at a time: the model keeps one cache
        self.fingerprint = ""

    async def start(self) -> None:
        self._model = await asyncio.get_running_loop().run_in_executor(None, self._factory)
        self.fingerprint = "sha256:" + hashlib.sha256(
            f"chunkline.constrained-planner.v1:{self.max_steps}:{self._model.fingerprint}".encode()).hexdigest()

    async def stop(self) -> None:
        self._model = None

    def metadata(self) -> dict[str, Any]:
        return target_planner_metadata("constrained", self.fingerprint, self.max_steps)

    def check(self, request: PlanInput) -> None:
        read_targets(request.obs, self.workspace)

    async def plan(self, request: PlanInput, deadline: float) -> PlanResult:
        return PlanResult(await asyncio.get_running_loop().run_in_executor(None, self.decode, request))

    def decode(self, request: PlanInput) -> PlanDocument:
        """The plan, decoded under the grammar (blocking: a worker thread runs it)."""
        model = self._model
        if model is None:
            raise Refusal(ErrorCode.NOT_READY, f"planner {self.name!r} is not started", retry_after_ms=1000.0)
        position, targets = read_targets(request.obs, self.workspace)
        goals = {int(row[0]): [float(row[1]), float(row[2])] for row in targets}
        prompt = (f"task: {request.instruction[:200]}\nsubtask: {request.subtask or '-'}\nat: {position[0]:.3f} {position[1]:.3f}\n"
                  "targets: " + " ".join(f"t{i}@{x:.3f},{y:.3f}" for i, (x, y) in goals.items()) + "\nplan: ")
        # The longest plan the grammar allows, and the prompt's tail that fits before it.
        longest = self.max_steps * (len("goto t;") + max((len(str(i)) for i in goals), default=1) + 1) + 8
        encoded = prompt.encode()[-max(1, model.context - longest):]
        text = bytearray()
        steps: list[bytes] = []
        with self._lock:
            logits = model.start(encoded)
            prefix = b""
            while True:
                pending = [i for i in goals if f"goto t{i}".encode() not in steps]
                can_continue = len(steps) + 1 < self.max_steps
                allowed = _allowed_bytes(prefix, plan_grammar_choices(pending), can_continue)
                choice = allowed[int(np.argmax(np.asarray(logits[:256], dtype=np.float64)[allowed]))]
                text.append(choice)
                if choice in (_SEP, _END):
                    steps.append(prefix)
                    if choice == _END:
                        break
                    prefix = b""
                else:
                    prefix += bytes([choice])
                logits = model.step(choice)
        plan_steps = []
        for step in steps:
            if step.startswith(b"goto t"):
                target = int(step[len(b"goto t"):])
                plan_steps.append(PlanStep(skill="goto", target=f"t{target}", goal=goals[target]))
            else:
                plan_steps.append(PlanStep(skill=step.decode(), target=None, goal=None))  # type: ignore[arg-type]
        note = f"constrained decoding: {text.decode()}"
        return validate_plan(PlanDocument(steps=plan_steps, note=note[:200]).model_dump(), self.max_steps)
