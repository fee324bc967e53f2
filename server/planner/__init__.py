"""The planner request class: plans (subtasks for a local policy) on the shared serving core.

- :mod:`.config`: one served planner's settings (:class:`PlannerConfig`).
- :mod:`.schema`: the plan document every planner returns, its JSON schema and its validation.
- :mod:`.errors`: the planner's typed refusals (``plan_invalid``).
- :mod:`.planners`: the planner interface and the embedded deterministic planner.
- :mod:`.upstream`: the adapter to an OpenAI-compatible (vision-)language model.
- :mod:`.service`: :class:`PlannerService`, the :class:`~chunkline.server.core.serving.RequestClass`.

It imports only :mod:`chunkline.server.core` and :mod:`chunkline.server.errors`; the native
``plan`` exchange lives in :mod:`chunkline.server.entrypoints.planner_native`.
"""

from chunkline.server.planner.config import PlannerConfig
from chunkline.server.planner.errors import PlanInvalid
from chunkline.server.planner.planners import NearestTargetPlanner, PlanInput, Planner, PlanResult
from chunkline.server.planner.schema import SKILLS, PlanDocument, PlanStep, parse_plan_text, plan_json_schema
from chunkline.server.planner.service import PlanJob, PlannerService

__all__ = [
    "PlannerConfig",
    "PlanInvalid",
    "Planner",
    "PlanInput",
    "PlanResult",
    "NearestTargetPlanner",
    "SKILLS",
    "PlanDocument",
    "PlanStep",
    "parse_plan_text",
    "plan_json_schema",
    "PlannerService",
    "PlanJob",
]
