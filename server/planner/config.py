"""Configuration of one served planner (pydantic: it comes from flags or a TOML file)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from chunkline.server.planner.planners import Workspace

__all__ = ["PlannerConfig"]

#: a workspace bound: within the plan schema's coordinates
Coordinate = Annotated[float, Field(ge=-1000.0, le=1000.0, allow_inf_nan=False)]


class PlannerConfig(BaseModel):
    """One served planner.

    Args:
        name: the planner name clients ask for (``plan.planner``).
        backend: ``embedded`` (the deterministic nearest-target planner, which plans from the
            observation's ``position`` and ``targets``) or ``upstream`` (an OpenAI-compatible
            (vision-)language model with structured output) or ``constrained`` (the embedded text
            model decoding under the plan grammar: every output a valid plan; see
            :mod:`chunkline.server.planner.constrained`).
        max_queue: most plan requests waiting; more are refused ``overloaded``.
        concurrency: most plans computed at once.
        default_deadline_ms: the budget of a ``plan`` that carries none (seconds: plans are slow).
        valid_for_s: how long a plan stays usable on the robot clock after its observation.
        max_steps: most steps in one plan.
        expected_plan_s: the service time admission assumes until it has measured one.
        upstream_url: upstream: base URL of its OpenAI API, e.g. ``http://10.0.0.5:8000/v1``.
        upstream_model: upstream: the model name there (default ``name``).
        upstream_api_key: upstream: sent as ``Authorization: Bearer``.
        max_output_tokens: upstream: ``max_tokens`` of each completion.
        max_response_bytes: upstream: longest response body read; a longer one is refused.
        max_retry_after_s: upstream: the longest wait an upstream's ``Retry-After`` can pass on
            to robots (longer ones are clamped).
        default_retry_after_s: upstream: the wait passed on for a 429 whose ``Retry-After`` is
            absent, or not a finite non-negative number of seconds.
        model_seed: constrained: the seed of the embedded text model's weights.
        pass_note: upstream: pass the model's free-text ``note`` on to robots, cleaned (escape
            sequences, control and format characters stripped) and cut to ``max_note_chars``;
            by default it is dropped (never acted on, it may carry text injected for whoever
            reads it next).
        max_note_chars: upstream: the longest note passed on.
        workspace: ``[xmin, ymin, xmax, ymax]`` (scene units): where observed positions and
            targets may lie (others are refused ``invalid_observation``) and where a plan's goals
            may be (a plan with a goal outside is invalid).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:/-]*$")]
    backend: Literal["embedded", "upstream", "constrained"] = "embedded"
    max_queue: Annotated[int, Field(ge=1)] = 64
    concurrency: Annotated[int, Field(ge=1, le=256)] = 4
    default_deadline_ms: Annotated[float, Field(gt=0, le=3_600_000)] = 5_000.0
    valid_for_s: Annotated[float, Field(gt=0, le=3600, allow_inf_nan=False)] = 10.0
    max_steps: Annotated[int, Field(ge=1, le=16)] = 4
    expected_plan_s: Annotated[float, Field(gt=0, le=600, allow_inf_nan=False)] = 0.05
    upstream_url: str | None = None
    upstream_model: str | None = None
    upstream_api_key: str | None = None
    max_output_tokens: Annotated[int, Field(ge=16, le=8192)] = 512
    max_response_bytes: Annotated[int, Field(ge=1024, le=16 << 20)] = 256 * 1024
    max_retry_after_s: Annotated[float, Field(gt=0, le=3600, allow_inf_nan=False)] = 60.0
    default_retry_after_s: Annotated[float, Field(ge=0, le=3600, allow_inf_nan=False)] = 1.0
    model_seed: int = 0
    pass_note: bool = False
    max_note_chars: Annotated[int, Field(ge=0, le=200)] = 120
    workspace: tuple[Coordinate, Coordinate, Coordinate, Coordinate] = (-1000.0, -1000.0, 1000.0, 1000.0)

    @model_validator(mode="after")
    def _upstream_needs_url(self) -> PlannerConfig:
        if self.backend == "upstream" and not self.upstream_url:
            raise ValueError(f"planner {self.name!r}: an upstream planner needs upstream_url")
        xmin, ymin, xmax, ymax = self.workspace
        if not (xmin < xmax and ymin < ymax):
            raise ValueError(f"planner {self.name!r}: workspace is [xmin, ymin, xmax, ymax] with xmin < xmax and ymin < ymax")
        return self

    def workspace_area(self) -> Workspace:
        """:attr:`workspace` as the planners take it."""
        return Workspace(*self.workspace)
