"""The chunkline wire protocol: message types and field rules (error and close codes: :mod:`.errors`).

Two modes share one WebSocket endpoint (docs/protocol.md has every field):

* **openpi-compatible** (no subprotocol requested): the server sends a metadata map on
  connect, then answers each bare observation map with ``{"actions": ..., "server_timing": ...}``.
* **native** (subprotocol ``chunkline.v1``): typed messages with a ``type`` and an ``id``,
  several requests in flight, structured errors that end the request, not the session.

Times the robot acts on are in the robot's clock (seconds): an ``infer`` carries
``obs_time``; the ``chunk`` answering it has ``t0`` (= ``obs_time`` + the policy's declared
offset), ``dt`` and ``expires``, and action ``k`` is due at ``t0 + k * dt``. Durations
(``deadline_ms``, timings) are measured by whichever side reports them.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, TypeAdapter, ValidationError, model_validator

from .errors import ErrorCode, ProtocolError

__all__ = [
    "SUBPROTOCOL",
    "RequestId",
    "FiniteFloat",
    "MAX_DEADLINE_MS",
    "MAX_DRY_IN_MS",
    "MAX_PERIOD_MS",
    "MAX_URGENCY_ROWS",
    "ROBOT_WEIGHT_HEADER",
    "MAX_ID_LENGTH",
    "MAX_MODEL_NAME_LENGTH",
    "valid_request_id",
    "error_message",
    "Urgency",
    "Infer",
    "Cancel",
    "ClientMessage",
    "Hello",
    "Chunk",
    "ChunkReply",
    "Error",
    "ServerMessage",
    "parse_client_message",
    "parse_server_message",
    "ErrorCode",
]

SUBPROTOCOL = "chunkline.v1"

#: Longest deadline budget a request may carry (one hour), so no request ever waits unbounded.
MAX_DEADLINE_MS = 3_600_000.0
#: Longest string request id, and longest model name.
MAX_ID_LENGTH = 64
MAX_MODEL_NAME_LENGTH = 128

#: request ids: a non-negative integer or a short string, chosen by the client.
RequestId = (
    Annotated[int, Field(ge=0, lt=1 << 63, strict=True)]
    | Annotated[str, Field(min_length=1, max_length=MAX_ID_LENGTH, strict=True)]
)
#: a deadline budget in milliseconds.
DeadlineMs = Annotated[float, Field(gt=0, le=MAX_DEADLINE_MS)]
#: the name of a served model.
ModelName = Annotated[str, Field(min_length=1, max_length=MAX_MODEL_NAME_LENGTH)]


def valid_request_id(value: object) -> bool:
    """The rule of :data:`RequestId`, for code that checks a field without building a message."""
    return (type(value) is int and 0 <= value < 1 << 63) or (type(value) is str and 1 <= len(value) <= MAX_ID_LENGTH)
#: a finite float (NaN and infinities are refused).
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]


class _Message(BaseModel):
    # Arrays (np.ndarray) ride inside messages as arbitrary types; unknown fields are refused
    # so that a typo never silently drops a setting.
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, frozen=True)


# ---------------------------------------------------------------------------- client -> server


class _ClientMessage(_Message):
    # Strict types on what a client sends: a number is an int or a float (never a string such as
    # "100", never a bool), a bool is a bool, a string is a string. Lax coercion would make the
    # native protocol accept what the HTTP API refuses, and hide a robot's encoding bug.
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, frozen=True, strict=True)


#: Handshake header in which a native session may ask for its robot's service weight (a number
#: above zero; the server bounds it by the tenant's ``robots.max_weight`` and says in ``hello``
#: what it granted).
ROBOT_WEIGHT_HEADER = "X-Chunkline-Robot-Weight"

#: Longest time an urgency may say a plan lasts, and longest control period (one hour, one minute).
MAX_DRY_IN_MS = MAX_DEADLINE_MS
MAX_PERIOD_MS = 60_000.0
#: Most rows a robot may say it executes of one chunk.
MAX_URGENCY_ROWS = 100_000


class Urgency(_ClientMessage):
    """How urgent a request is: the scheduling key, distinct from the hard deadline.

    ``deadline_ms`` bounds (past it the answer is refused or dropped); the urgency orders and
    batches: a scheduler serves first the robot whose plan runs dry soonest, and values a chunk
    by the rows that will run.

    Args:
        dry_in_ms: time from this message until this robot's plan runs dry (0: it already has).
        rows: rows of the chunk this robot will execute (its execution horizon).
        period_ms: its control period.
    """

    dry_in_ms: Annotated[float, Field(ge=0, le=MAX_DRY_IN_MS, allow_inf_nan=False)]
    rows: Annotated[int, Field(ge=1, le=MAX_URGENCY_ROWS)]
    period_ms: Annotated[float, Field(gt=0, le=MAX_PERIOD_MS, allow_inf_nan=False)]

    def wire(self) -> dict[str, Any]:
        """The plain map an ``infer`` carries."""
        return {"dry_in_ms": float(self.dry_in_ms), "rows": int(self.rows), "period_ms": float(self.period_ms)}


class Infer(_ClientMessage):
    """Ask for an action chunk.

    Args:
        id: the client's id for this request, unique among its requests in flight.
        obs: the observation: names to arrays (and strings such as ``prompt``).
        obs_time: when the observation was taken, robot clock, seconds. The chunk's ``t0``
            derives from it. ``None`` gives a chunk with ``t0 = None`` (no timeline).
        deadline_ms: how long the robot can wait for the answer, counted by the server from
            receipt. ``None``: the server's default for this policy.
        model: which served policy; ``None`` for the server's default.
        prefix: actions the robot will execute from ``obs_time`` on, one per ``dt``
            (``[P, action_dim]``), for policies that support real-time chunking.
        prefix_delay: how many of the prefix's first rows run before the answer can arrive
            (the estimated inference delay in steps; they are frozen); ``None``: all of them.
        urgency: how urgent it is (:class:`Urgency`, the scheduling key); ``None``: unknown.
        replaces: the id of a request of this session still queued that this one refreshes: it
            takes that one's place in the queue, and that one is answered ``superseded``; if that
            one is no longer queued, this one is answered ``replace_missed`` (docs/protocol.md).
    """

    type: Literal["infer"] = "infer"
    id: RequestId
    obs: dict[str, Any]
    obs_time: FiniteFloat | None = None
    deadline_ms: DeadlineMs | None = None
    model: ModelName | None = None
    prefix: np.ndarray | None = None
    prefix_delay: Annotated[int, Field(ge=0)] | None = None
    urgency: Urgency | None = None
    replaces: RequestId | None = None

    @model_validator(mode="after")
    def _not_itself(self) -> Infer:
        if self.replaces is not None and self.replaces == self.id:
            raise ValueError("an infer cannot replace itself")
        return self


class Cancel(_ClientMessage):
    """Cancel a request in flight; the server answers it with error ``cancelled`` if it was still pending."""

    type: Literal["cancel"] = "cancel"
    id: RequestId




# ---------------------------------------------------------------------------- server -> client


class Hello(_Message):
    """First message of a native session: who the server is and what it serves.

    Args:
        protocol: ``chunkline.v1``.
        server: server software and version.
        session: this session's id (for logs and support; not a secret).
        default_model: the policy used when ``infer.model`` is omitted.
        models: per policy, its metadata (observation spec, action dim, horizon, dt, fingerprint).
        text_models: text models this session may ``generate`` with.
        layouts: the array layouts the server reads in ``infer`` (``msgpack``: arrays inside
            the msgpack message; ``oob``: out of band, see :mod:`chunkline.client.wire.format`).
        planners: per planner this session may ``plan`` with, its metadata (the plan's JSON
            schema, skills, default deadline, validity).
        encodings: the array encodings this session agreed (``raw``, and of the compressed ones
            the client offered at the handshake those the server decodes); a field may use one
            of them that its model's spec also lists (:mod:`chunkline.client.wire.encodings`).
        robot_weight: this session's robot's service weight under the fleet batch strategy (its
            :data:`ROBOT_WEIGHT_HEADER` bounded by the tenant's policy, else its key's or its
            tenant's); ``None`` when the header asked for one that is not a weight (every
            ``infer`` is then refused ``invalid_message``).
    """

    type: Literal["hello"] = "hello"
    protocol: str = SUBPROTOCOL
    server: str
    session: str
    default_model: str
    models: dict[str, dict[str, Any]]
    text_models: list[str] = Field(default_factory=list)
    layouts: list[str] = Field(default_factory=lambda: ["msgpack"])
    planners: dict[str, dict[str, Any]] = Field(default_factory=dict)
    encodings: list[str] = Field(default_factory=lambda: ["raw"])
    robot_weight: float | None = None


class Chunk(_Message):
    """An action chunk answering ``infer`` ``id``; also what the clients return (:data:`ChunkReply`).

    The robot side holds a chunk in two shapes, for two jobs: this one is the wire message as
    received (actions as sent, ``t0`` possibly ``None``), with the receiving client's own
    measurements attached; :class:`chunkline.broker.ActionChunk` is the broker's validated plan
    on the robot clock (float32 copy, finite ``t0``, the broker's request id).

    Args:
        actions: ``[H, action_dim]`` float32 (read-only when decoded).
        t0: due time of ``actions[0]`` in the robot's clock (``None`` if ``obs_time`` was not sent).
        dt: seconds between consecutive actions.
        expires: robot-clock time after which no action of this chunk may run.
        model: the policy that produced it. fingerprint: that policy's fingerprint.
        late: the reply was ready only after the request's deadline (never presented as on time).
        timing: server-side durations in milliseconds (``decode_ms``, ``queue_ms``,
            ``batch_wait_ms``, ``infer_ms``, ``encode_ms``, ``server_ms``), ``batch_size`` and ``backlog``
            (requests still queued for the model when the reply's batch ended).

    The client's measurements (:attr:`client_timing`, :attr:`received_at`) are private
    attributes: never read from nor written to a message.
    """

    type: Literal["chunk"] = "chunk"
    id: RequestId
    actions: np.ndarray
    t0: float | None
    dt: float
    expires: float | None
    model: str
    fingerprint: str
    late: bool = False
    timing: dict[str, float]

    _client_timing: dict[str, float] = PrivateAttr(default_factory=dict)
    _received_at: float = PrivateAttr(default=math.nan)
    _encoding: str = PrivateAttr(default="raw")

    @property
    def client_timing(self) -> dict[str, float]:
        """The client's measurements: ``encode_ms`` (the message), ``send_ms``, ``round_trip_ms``
        (send start to reply received), ``decode_ms``, ``uplink_bytes``; with compression on,
        ``compress_ms`` (the fields, on the worker threads) and ``jpeg_quality`` (0: the camera
        fields went raw). Empty on a chunk no client received."""
        return self._client_timing

    @property
    def encoding(self) -> str:
        """How the observation's fields went up: ``raw``, or the encodings used (``jpeg:90``,
        ``jpeg:90+png``, ``jpeg:90+raw`` when a field went raw because compressing did not pay)."""
        return self._encoding

    @property
    def received_at(self) -> float:
        """The receiving client's clock (``time.monotonic()``) when the reply arrived; NaN if none."""
        return self._received_at

    def record_arrival(self, client_timing: dict[str, float], received_at: float, encoding: str = "raw") -> None:
        """Attach the receiving client's measurements (the client core calls this once)."""
        self._client_timing = client_timing
        self._received_at = received_at
        self._encoding = encoding

    def as_openpi(self) -> dict[str, Any]:
        """The openpi-style result map (``actions`` first axis is the chunk step)."""
        return {
            "actions": self.actions,
            "server_timing": dict(self.timing),
            "t0": self.t0,
            "dt": self.dt,
            "expires": self.expires,
            "fingerprint": self.fingerprint,
        }

    def __repr__(self) -> str:
        shape = "x".join(str(n) for n in getattr(self.actions, "shape", ()))
        return (f"Chunk(id={self.id!r}, actions={getattr(self.actions, 'dtype', '?')}[{shape}], t0={self.t0}, dt={self.dt}, "
                f"expires={self.expires}, model={self.model!r}, late={self.late})")

    __str__ = __repr__


#: What the clients return: the wire :class:`Chunk` with the client's measurements attached.
ChunkReply = Chunk


class Error(_Message):
    """A request (``id`` set) or the session (``id`` is ``None``) failed.

    Args:
        code: a stable :class:`ErrorCode` value.
        message: human-readable detail (never observation content).
        retry_after_ms: for ``overloaded`` and ``quota_exceeded``: when a retry may succeed.
    """

    type: Literal["error"] = "error"
    id: RequestId | None = None
    code: str
    message: str
    retry_after_ms: float | None = None


def _first_error(exc: ValidationError) -> str:
    err = exc.errors(include_url=False, include_input=False)[0]
    where = ".".join(str(p) for p in err["loc"]) or "message"
    return f"{where}: {err['msg']}"


def parse_client_message(obj: Any) -> Infer | Cancel | Generate | Plan:
    """Validate a decoded client message.

    Raises:
        ProtocolError: the message is not a valid ``infer`` or ``cancel``.
    """
    if not isinstance(obj, dict) or not isinstance(obj.get("type"), str):
        raise ProtocolError("a message must be a map with a string 'type'")
    try:
        return _client_adapter.validate_python(obj)
    except ValidationError as exc:
        raise ProtocolError(_first_error(exc)) from None


def parse_server_message(obj: Any) -> Hello | Chunk | Error | Token | Done | PlanReply:
    """Validate a decoded server message (client side).

    Raises:
        ProtocolError: the message is not a valid ``hello``, ``chunk`` or ``error``.
    """
    if not isinstance(obj, dict) or not isinstance(obj.get("type"), str):
        raise ProtocolError("a message must be a map with a string 'type'")
    try:
        return _server_adapter.validate_python(obj)
    except ValidationError as exc:
        raise ProtocolError(_first_error(exc)) from None


def error_message(code: ErrorCode, message: str, request_id: Any = None, retry_after_ms: float | None = None) -> dict[str, Any]:
    """The wire form of an ``error`` message (a plain map, ready to encode)."""
    out: dict[str, Any] = {"type": "error", "id": request_id, "code": code.value, "message": message}
    if retry_after_ms is not None:
        out["retry_after_ms"] = float(retry_after_ms)
    return out


# ---------------------------------------------------------------------------- text (generate / token / done)
# Appended for the text request class; the unions above are extended below, every earlier name
# keeps working.



class ChatTurn(_ClientMessage):
    """One chat message of a ``generate``.

    Args:
        role: ``system``, ``developer``, ``user``, ``assistant`` or ``tool``.
        content: its text.
    """

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str, Field(max_length=1 << 20)]


class Generate(_ClientMessage):
    """Ask a text model for a completion, streamed back as ``token`` messages and one ``done``.

    Give exactly one of ``prompt`` (plain completion) and ``messages`` (chat). A ``cancel`` with
    the same ``id`` stops it (its slot is freed at the engine's next step).

    Args:
        id: the client's id for this request, unique among its requests in flight.
        model: which text model; ``None`` for the server's default text model.
        prompt: the prompt of a plain completion.
        messages: the conversation of a chat completion.
        max_tokens: most tokens to generate (default: the model's).
        temperature: 0 is greedy; default 1.
        top_p: nucleus sampling mass; default 1.
        seed: sampling seed (same seed, same tokens, alone or batched with others).
        stop: up to 4 strings that end the generation (not included in the output).
        ignore_eos: generate through end-of-sequence tokens (load tests).
        deadline_ms: time-to-first-token budget, counted by the server from receipt.
    """

    type: Literal["generate"] = "generate"
    id: RequestId
    model: ModelName | None = None
    prompt: Annotated[str, Field(max_length=1 << 20)] | None = None
    messages: Annotated[list[ChatTurn], Field(min_length=1, max_length=256)] | None = None
    max_tokens: Annotated[int, Field(ge=1, le=1 << 20)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    seed: Annotated[int, Field(ge=-(1 << 63), lt=1 << 64)] | None = None
    stop: Annotated[list[Annotated[str, Field(max_length=64)]], Field(max_length=4)] | None = None
    ignore_eos: bool | None = None
    deadline_ms: DeadlineMs | None = None

    @model_validator(mode="after")
    def _one_input(self) -> Generate:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class Token(_Message):
    """Generated text for ``generate`` ``id`` (several tokens may be merged into one message).

    Args:
        text: new text (may be empty while a stop string or a split character is held back).
        index: how many tokens came before this message.
        tokens: how many tokens this message accounts for.
    """

    type: Literal["token"] = "token"
    id: RequestId
    text: str
    index: Annotated[int, Field(ge=0)]
    tokens: Annotated[int, Field(ge=0)]


class Done(_Message):
    """The end of ``generate`` ``id``.

    Args:
        model: the model that answered. fingerprint: its fingerprint.
        finish_reason: ``stop`` (stop token or string), ``length`` (max_tokens or context) or
            ``cancelled``.
        usage: ``prompt_tokens``, ``completion_tokens``, ``total_tokens``.
        late: the first token came after the request's deadline.
        timing: milliseconds: ``queue_ms``, ``ttft_ms`` (receipt to first token), ``tpot_ms``
            (mean time per output token after the first), ``server_ms``.
        translation_loss: fields an upstream engine did not honour exactly (``field``,
            ``action``, ``detail``), if any.
    """

    type: Literal["done"] = "done"
    id: RequestId
    model: str
    finish_reason: str
    usage: dict[str, int]
    fingerprint: str = ""
    late: bool = False
    timing: dict[str, float] = Field(default_factory=dict)
    translation_loss: list[dict[str, str]] | None = None


__all__ += ["ChatTurn", "Generate", "Token", "Done"]


# ---------------------------------------------------------------------------- planner (plan / plan_reply)
# Appended for the planner request class (docs/planner.md); the message unions follow it.

#: Longest instruction, subtask name and plan id a ``plan`` may carry.
MAX_INSTRUCTION_LENGTH = 4096
MAX_SUBTASK_LENGTH = 256


class PlanContext(_Message):
    """Where the robot is in its current plan, for the planner to continue or supersede it.

    Args:
        plan_id: the plan the robot is executing (the ``plan_id`` of a ``plan_reply``), if any.
        subtask: the subtask it is executing (for the embedded planner: ``t<id>`` of a target).
        progress: how far along that subtask it is, 0 to 1.
    """

    plan_id: Annotated[str, Field(min_length=1, max_length=MAX_ID_LENGTH)] | None = None
    subtask: Annotated[str, Field(max_length=MAX_SUBTASK_LENGTH)] | None = None
    progress: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] | None = None


class Plan(_Message):
    """Ask a planner for a plan: the next subtasks a local policy carries out.

    Args:
        id: the client's id, unique among its requests in flight (shared with ``infer`` and
            ``generate``).
        obs: what the planner needs of the observation (the planner's metadata names it).
        obs_time: when it was observed, robot clock, seconds; the reply's ``expires`` derives from it.
        instruction: the task in words (planners that read language use it).
        context: the robot's current plan and subtask.
        deadline_ms: how long the robot will wait, counted by the server from receipt (seconds
            are usual for planners; capped at one hour).
        planner: which served planner; ``None`` for the server's default planner.
    """

    type: Literal["plan"] = "plan"
    id: RequestId
    obs: dict[str, Any]
    obs_time: FiniteFloat | None = None
    instruction: Annotated[str, Field(max_length=MAX_INSTRUCTION_LENGTH)] = ""
    context: PlanContext = Field(default_factory=PlanContext)
    deadline_ms: DeadlineMs | None = None
    planner: ModelName | None = None


class PlanReply(_Message):
    """The plan answering ``plan`` ``id``.

    Args:
        plan_id: this plan's id, unique on the server; a later ``plan``'s context names it.
        planner: the planner that made it. fingerprint: that planner's fingerprint.
        plan: the plan document, valid against the planner's published JSON schema.
        supersedes: the ``plan_id`` this plan replaces (the request's ``context.plan_id``).
        valid_for: seconds of robot time the plan stays usable after ``obs_time``.
        expires: ``obs_time + valid_for`` on the robot clock (``None`` without ``obs_time``);
            no step of the plan may start after it.
        late: the plan was ready only after the request's deadline.
        timing: server-side milliseconds (``queue_ms``, ``plan_ms``, ``server_ms``) and the
            planner's ``attempts`` (2 when a repair was needed).
    """

    type: Literal["plan_reply"] = "plan_reply"
    id: RequestId
    plan_id: str
    planner: str
    fingerprint: str
    plan: dict[str, Any]
    supersedes: str | None = None
    valid_for: Annotated[float, Field(gt=0, allow_inf_nan=False)]
    expires: float | None = None
    late: bool = False
    timing: dict[str, float] = Field(default_factory=dict)


ClientMessage = Annotated[Infer | Cancel | Generate | Plan, Field(discriminator="type")]
_client_adapter: TypeAdapter[Infer | Cancel | Generate | Plan] = TypeAdapter(ClientMessage)
ServerMessage = Annotated[Hello | Chunk | Error | Token | Done | PlanReply, Field(discriminator="type")]
_server_adapter: TypeAdapter[Hello | Chunk | Error | Token | Done | PlanReply] = TypeAdapter(ServerMessage)
__all__ += ["PlanContext", "Plan", "PlanReply", "MAX_INSTRUCTION_LENGTH"]
