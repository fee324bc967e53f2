"""The plan document: what every planner returns, its JSON schema, and its validation.

One definition serves three purposes: the pydantic models below validate a planner's output
(strictly: no coercion, no unknown fields, bounded strings and lists); :func:`plan_json_schema`
is what a planner publishes in its metadata and what the upstream adapter sends as
``response_format``; and the robot reads the same fields. A plan is an ordered list of steps
over a fixed skill vocabulary (:data:`SKILLS`):

* ``goto``: move the end effector to ``target`` (an id the robot's perception reported; ``goal``
  is where the target was when planned, a hint);
* ``hold``: stay where you are (nothing to do, or wait for the scene to change);
* ``return``: go back to the home pose.
"""

from __future__ import annotations

import copy
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from chunkline.server.planner.errors import PlanInvalid

__all__ = ["SKILLS", "PlanStep", "PlanDocument", "plan_json_schema", "parse_plan_text", "validate_plan"]

#: The skills a plan step may name (the local policy's vocabulary).
SKILLS: tuple[str, ...] = ("goto", "hold", "return")
#: Longest target id, note, and most steps any planner may return.
MAX_TARGET_LENGTH = 32
MAX_NOTE_LENGTH = 200
MAX_STEPS = 16

Coordinate = Annotated[float, Field(ge=-1000.0, le=1000.0, allow_inf_nan=False)]


class _Strict(BaseModel):
    # strict: a model's "1" is not the number 1; extra fields are refused, never dropped.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class PlanStep(_Strict):
    """One subtask.

    Args:
        skill: one of :data:`SKILLS`.
        target: the target's id for ``goto`` (``t<id>`` for the embedded planner); ``None`` otherwise.
        goal: ``[x, y]`` where the target was when planned, or ``None``.
    """

    skill: Literal["goto", "hold", "return"]
    target: Annotated[str, Field(min_length=1, max_length=MAX_TARGET_LENGTH, pattern=r"^[A-Za-z0-9_.-]+$")] | None
    goal: Annotated[list[Coordinate], Field(min_length=2, max_length=2)] | None

    @model_validator(mode="after")
    def _goto_names_a_target(self) -> PlanStep:
        if self.skill == "goto" and self.target is None:
            raise ValueError("a goto step needs a target")
        return self


class PlanDocument(_Strict):
    """A plan: the subtasks in order, and a short note (why; for logs, never acted on).

    Args:
        steps: 1 to :data:`MAX_STEPS` steps.
        note: free text, at most :data:`MAX_NOTE_LENGTH` characters.
    """

    steps: Annotated[list[PlanStep], Field(min_length=1, max_length=MAX_STEPS)]
    note: Annotated[str, Field(max_length=MAX_NOTE_LENGTH)]


_SCHEMA = PlanDocument.model_json_schema()


def plan_json_schema(max_steps: int = MAX_STEPS) -> dict[str, Any]:
    """The JSON schema of a plan of at most ``max_steps`` steps (what a planner publishes)."""
    schema = copy.deepcopy(_SCHEMA)
    schema["properties"]["steps"]["maxItems"] = min(max_steps, MAX_STEPS)
    return schema


def _first_error(exc: ValidationError) -> str:
    err = exc.errors(include_url=False, include_input=False)[0]
    where = ".".join(str(p) for p in err["loc"]) or "plan"
    return f"{where}: {err['msg']}"[:300]


def validate_plan(document: Any, max_steps: int = MAX_STEPS) -> PlanDocument:
    """Validate a decoded plan (a dict) against the schema.

    Raises:
        PlanInvalid: it does not match (the first error, without the offending value).
    """
    try:
        plan = PlanDocument.model_validate(document)
    except ValidationError as exc:
        raise PlanInvalid(_first_error(exc)) from None
    if len(plan.steps) > max_steps:
        raise PlanInvalid(f"steps: at most {max_steps} steps, got {len(plan.steps)}")
    return plan


def parse_plan_text(text: str, max_steps: int = MAX_STEPS, max_chars: int = 64 * 1024) -> PlanDocument:
    """Parse and validate a plan written as JSON text (a language model's answer).

    Args:
        text: the JSON.
        max_steps: the planner's step limit.
        max_chars: longer text is refused before parsing.

    Raises:
        PlanInvalid: too long, not JSON, or not a valid plan.
    """
    if len(text) > max_chars:
        raise PlanInvalid(f"the plan is {len(text)} characters long; at most {max_chars}")
    try:
        document = json.loads(text)
    except ValueError as exc:
        raise PlanInvalid(f"not JSON: {str(exc)[:120]}") from None
    return validate_plan(document, max_steps)
