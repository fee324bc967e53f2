"""A plan checked against the scene it answers, and free text made safe to pass on.

A model's plan matches the schema and can still be wrong about the world: a ``goto`` to a target
the robot never reported (``t999``, ``base_station``), or a goal far outside where the robot can
reach. :func:`check_scene` refuses such a plan (``plan_invalid``: the robot keeps its current
plan) and takes each ``goto``'s goal from the observation, never from the model. Free text from
a model is never acted on; :func:`clean_text` strips what a terminal or a log would interpret
(escape sequences, control and format characters) and caps its length.
"""

from __future__ import annotations

import re
import unicodedata

from chunkline.server.planner.errors import PlanInvalid
from chunkline.server.planner.planners import Workspace
from chunkline.server.planner.schema import PlanDocument, PlanStep

__all__ = ["check_scene", "clean_text"]

# ESC followed by a CSI/OSC/other sequence, or a lone C1 introducer; removed whole.
_ESCAPES = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[@-Z\\-_])|[\x80-\x9f]")


def clean_text(text: str, max_chars: int) -> str:
    """``text`` without escape sequences, control or format characters (bidirectional overrides
    included), whitespace collapsed, at most ``max_chars`` characters."""
    text = _ESCAPES.sub("", text)
    kept = "".join(" " if ch.isspace() else ch for ch in text if ch.isspace() or unicodedata.category(ch)[0] != "C")
    return " ".join(kept.split())[:max_chars]


def check_scene(plan: PlanDocument, targets: dict[str, tuple[float, float]] | None, workspace: Workspace) -> PlanDocument:
    """``plan`` with each ``goto``'s goal the observed position of its target.

    Args:
        plan: a plan that matches the schema.
        targets: the observation's targets by id, or ``None`` when it lists none (then a
            ``goto``'s target cannot be checked here; its goal must still be in the workspace).
        workspace: where goals may be.

    Raises:
        PlanInvalid: a ``goto`` to a target the observation does not list, or a goal outside
            the workspace (the message names the step, and only ids the schema allows).
    """
    steps = []
    for i, step in enumerate(plan.steps):
        goal = step.goal
        if step.skill == "goto" and targets is not None:
            if step.target not in targets:
                observed = ", ".join(sorted(targets)[:16]) or "none"
                raise PlanInvalid(f"steps.{i}.target: {step.target} is not a target in the observation (observed: {observed})")
            goal = list(targets[step.target])
        if goal is not None and not workspace.contains(goal[0], goal[1]):
            raise PlanInvalid(f"steps.{i}.goal: outside the planner's workspace ({workspace})")
        steps.append(PlanStep(skill=step.skill, target=step.target, goal=goal))
    return PlanDocument(steps=steps, note=plan.note)
