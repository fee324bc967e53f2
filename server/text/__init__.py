"""The text request class: text-LLM requests on the shared serving core, an embedded
continuous-batching model, and an adapter that forwards to any OpenAI-compatible engine.

Wiring it into a server (the whole integration contract)::

    from chunkline.server.text import PolicyPriorityGate, TextModelConfig, TextService

    text = TextService(
        core,                             # the server's ServingCore: keys, tenants, quotas, metrics, ledger
        models=[TextModelConfig(name="tiny-text")],
        # optional: robots first. The engine pauses between decode steps while policy work of a
        # higher priority (tenants' class_priority / priority) is queued or running.
        yield_to=PolicyPriorityGate(lambda: [r.core for r in server.runners.values()],
                                    lambda: core.quotas.registry),
    )
    await text.start()                               # load, warm, start engines
    job = text.submit(request, tenant, session)      # raises Refusal; else job.stream() yields
    text.cancel(job); text.release_session(session)  # Delta... then Finished
    await text.stop()

The front-ends are entrypoints: the OpenAI-compatible HTTP API
(:mod:`chunkline.server.entrypoints.http`) and the native ``generate`` exchange
(:mod:`chunkline.server.entrypoints.text_native`).

Modules: :mod:`.service` (admission, scheduling, metering, ledger), :mod:`.job` (one request's
events), :mod:`.backend` (backend interface, embedded backend), :mod:`.engine` (continuous
batching), :mod:`.model` (the torch transformer, imported lazily), :mod:`.sampling`,
:mod:`.tokenizer`, :mod:`.upstream` (the adapter) and :mod:`.transport` (its HTTP/1.1 client
transport), :mod:`.load` (TTFT prediction), :mod:`.priority` (robots-first gate), :mod:`.config`,
:mod:`.errors`.
"""

from __future__ import annotations

from chunkline.server.text.config import TextModelConfig
from chunkline.server.text.errors import TextError
from chunkline.server.text.priority import PolicyPriorityGate
from chunkline.server.text.service import TextJob, TextService

__all__ = ["TextService", "TextModelConfig", "TextJob", "TextError", "PolicyPriorityGate"]
