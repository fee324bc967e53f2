"""The text request class: text-LLM requests on the shared serving core, served by an embedded
continuous-batching model or forwarded to an OpenAI-compatible engine.

``TextService(core, models=[...], yield_to=...)`` is the whole integration contract: ``start()``,
``submit(request, tenant, session)`` (raises ``Refusal``; the job's ``stream()`` yields deltas, then
the finish), ``cancel(job)``, ``release_session(session)``, ``stop()``. The optional
``PolicyPriorityGate`` pauses embedded decode steps while robot work of a higher priority waits.
The front-ends are entrypoints: the OpenAI-compatible HTTP API and the native ``generate`` exchange."""

from __future__ import annotations

from chunkline.server.text.config import TextModelConfig
from chunkline.server.text.errors import TextError
from chunkline.server.text.priority import PolicyPriorityGate
from chunkline.server.text.service import TextJob, TextService

__all__ = ["TextService", "TextModelConfig", "TextJob", "TextError", "PolicyPriorityGate"]
