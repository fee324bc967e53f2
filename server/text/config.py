"""Configuration of one served text model (pydantic: it comes from flags or a TOML file)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

__all__ = ["TextModelConfig", "HONOURABLE_FIELDS"]

#: Request fields a backend may or may not honour; ``upstream_unsupported`` names a subset.
HONOURABLE_FIELDS: tuple[str, ...] = ("temperature", "top_p", "seed", "stop", "ignore_eos", "max_tokens")


class TextModelConfig(BaseModel):
    """One text model served on the OpenAI-compatible API and the native ``generate`` message.

    One field per key of a text model's settings.

    Args:
        name: the model name clients ask for.
        backend: ``embedded`` (the built-in load-test transformer, continuous batching) or
            ``upstream`` (forward to an OpenAI-compatible engine: vLLM, SGLang, llama.cpp, ...).
        max_batch: most sequences running at once (embedded: the running batch; upstream: requests
            in flight to the upstream). ``1`` is one request at a time.
        max_queue: most requests waiting for a slot; more are refused ``overloaded`` (503).
        max_prompt_tokens: longest prompt accepted (embedded: exact; upstream: estimated).
        max_output_tokens: largest ``max_tokens`` accepted.
        default_max_tokens: ``max_tokens`` when the request gives none (capped by what fits).
        default_ttft_ms: time-to-first-token budget of requests that carry none; the admission
            deadline (refused at once if predicted to miss it, dropped if it passes in the queue).
        yield_to_policy: pause this model's decode steps while robot-policy work of a higher
            priority (tenants' ``class_priority``) is queued or running, so text load cannot push
            robots past their deadlines (only when the server passes a gate; see ``TextService``).
        context: embedded: the context length (prompt + output).
        d_model, n_layers, n_heads, d_ff: embedded: the architecture.
        seed: embedded: the dummy weights' seed (the fingerprint names it).
        batch_invariant: embedded: fixed-shape decode steps, so that a seeded request gives the
            same tokens alone or batched, bit for bit (costs a full batch's work at low load).
        max_prefill_tokens: embedded: prompt tokens prefilled per engine step before decoding the
            running batch (at least one prompt per step), so a burst of joins cannot stall it long.
        device: embedded: torch device.
        threads: embedded: torch intra-op threads of the engine thread (on this project's 2-core
            CPU one is faster than two from a worker thread, and leaves a core to the robot lanes).
        upstream_url: upstream: base URL of its OpenAI API, e.g. ``http://10.0.0.5:8000/v1``.
        upstream_model: upstream: the model name there (default ``name``).
        upstream_api_key: upstream: the key sent as ``Authorization: Bearer``.
        upstream_unsupported: upstream: request fields it cannot honour (of ``temperature``,
            ``top_p``, ``seed``, ``stop``, ``ignore_eos``, ``max_tokens``).
        translation_loss: upstream: a request that sets an unsupported field is ``refuse``-d (400)
            or forwarded without it and the loss ``report``-ed in the response; never dropped silently.
        upstream_retries: upstream: retries before the first byte reached the caller (this adapter
            is the only layer that retries; none once a byte was streamed).
        upstream_stall_timeout_s: upstream: longest silence between tokens once streaming.
        upstream_bytes_per_token: upstream: prompt bytes per token, to estimate the prompt's
            tokens for admission before the upstream reports usage (1.0 is a safe upper bound).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:/-]*$")]
    backend: Literal["embedded", "upstream"] = "embedded"
    max_batch: Annotated[int, Field(ge=1, le=256)] = 16
    max_queue: Annotated[int, Field(ge=1)] = 256
    max_prompt_tokens: Annotated[int, Field(ge=1)] = 384
    max_output_tokens: Annotated[int, Field(ge=1)] = 256
    default_max_tokens: Annotated[int, Field(ge=1)] = 128
    default_ttft_ms: Annotated[float, Field(gt=0, le=3_600_000)] = 10_000.0
    yield_to_policy: bool = True
    context: Annotated[int, Field(ge=8, le=8192)] = 512
    d_model: Annotated[int, Field(ge=8, le=4096)] = 128
    n_layers: Annotated[int, Field(ge=1, le=64)] = 4
    n_heads: Annotated[int, Field(ge=1, le=64)] = 4
    d_ff: Annotated[int, Field(ge=8, le=16384)] = 512
    seed: int = 0
    batch_invariant: bool = True
    max_prefill_tokens: Annotated[int, Field(ge=1)] = 512
    device: str = "cpu"
    threads: Annotated[int, Field(ge=1, le=256)] = 1
    upstream_url: str | None = None
    upstream_model: str | None = None
    upstream_api_key: SecretStr | None = None
    upstream_unsupported: list[Literal["temperature", "top_p", "seed", "stop", "ignore_eos", "max_tokens"]] = Field(default_factory=list)
    translation_loss: Literal["refuse", "report"] = "refuse"
    upstream_retries: Annotated[int, Field(ge=0, le=5)] = 1
    upstream_stall_timeout_s: Annotated[float, Field(gt=0)] = 30.0
    upstream_bytes_per_token: Annotated[float, Field(gt=0, le=16)] = 1.0

    @model_validator(mode="after")
    def _consistent(self) -> TextModelConfig:
        if self.backend == "upstream":
            if not self.upstream_url or not self.upstream_url.startswith(("http://", "https://")):
                raise ValueError("an upstream model needs upstream_url (http:// or https://)")
        else:
            if self.d_model % self.n_heads:
                raise ValueError("d_model must be a multiple of n_heads")
            if self.max_prompt_tokens >= self.context:
                raise ValueError("max_prompt_tokens must leave room in the context for output")
        return self

    @property
    def remote_model(self) -> str:
        """The model name to ask the upstream for."""
        return self.upstream_model or self.name
