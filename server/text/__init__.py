"""Text requests on the shared serving core: an OpenAI-compatible HTTP API and the native
``generate`` / ``token`` / ``done`` exchange, an embedded continuous-batching model, and an
adapter that forwards to any OpenAI-compatible engine.

Wiring it into the server (the whole integration contract)::

    from chunkline.server.text import PolicyPriorityGate, TextModelConfig, TextService

    text = TextService(
        auth=server.auth,                 # Authenticator or NoAuth: same keys, same tenants
        quotas=server.quotas,             # the same QuotaManager as the robot path
        metrics=server.metrics,           # the same Metrics
        ledger=server.ledger,             # the same Ledger, or None
        models=[TextModelConfig(name="tiny-text")],
        # optional: robots first. The engine pauses between decode steps while policy work of a
        # higher priority (tenants' class_priority / priority) is queued or running.
        yield_to=PolicyPriorityGate(lambda: [r.core for r in server.runners.values()],
                                    lambda: server.quotas.registry),
    )
    await text.start()                               # load, warm, start engines
    http_port = await text.serve_http(host, port)    # its own listener; 0 picks a port
    # native session, on a `generate` message (run it as a task; cancel the task on `cancel`
    # or disconnect: the slot is freed at the next engine step):
    await text.handle_generate(msg, tenant, session_id, send)   # send(dict) -> awaitable
    text.models_for(tenant)                          # text models for `hello` / /v1/models
    await text.stop()

Modules: :mod:`.service` (admission, metering, ledger, native protocol), :mod:`.api` and
:mod:`.http` (OpenAI-compatible API on h11), :mod:`.openai_api` (request validation, response
bodies), :mod:`.backend` (backend interface, embedded backend), :mod:`.engine` (continuous
batching), :mod:`.model` (the torch transformer, imported lazily), :mod:`.sampling`,
:mod:`.tokenizer`, :mod:`.upstream` (the adapter), :mod:`.load` (TTFT prediction),
:mod:`.priority` (robots-first gate), :mod:`.config`, :mod:`.errors`.
"""

from __future__ import annotations

from chunkline.server.text.config import TextModelConfig
from chunkline.server.text.errors import TextError
from chunkline.server.text.priority import PolicyPriorityGate
from chunkline.server.text.service import TextJob, TextService

__all__ = ["TextService", "TextModelConfig", "TextJob", "TextError", "PolicyPriorityGate"]
