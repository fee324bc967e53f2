"""Settings of one served policy (the robot request class's part of the server configuration)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Annotated, Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from pydantic import BaseModel, ConfigDict, Field, model_validator

from chunkline.server.core.admission import AdmissionConfig
from chunkline.server.robot.batching import BatchPolicy
from chunkline.server.robot.fleet import FleetConfig

__all__ = ["PolicyConfig", "parse_policy_arg", "policies_from_flags"]

#: What a policy argument may be: a TOML value (strings, numbers, booleans, arrays, tables).
PolicyArg = str | int | float | bool | list[Any] | dict[str, Any]



class PolicyConfig(BaseModel):
    """One served policy.

    Args:
        ref: what to load: an embedded name, an ``.npz`` path, ``module:factory`` or ``lerobot:PATH``.
        name: the model name clients ask for (defaults to ``ref``).
        args: keyword arguments of the factory or the LeRobot loader (``fps = 30``, a checkpoint
            path, a device map, ...); ``[policies.args]`` in the TOML, ``--policy-arg key=value``.
        spec: for an openpi-style object, what it accepts and returns (``[policies.spec]``; see
            :mod:`chunkline.policies.spec_doc`).
        warm_batch_sizes: batch sizes timed before serving (the first must be 1). Timing more at
            start costs start-up time (every size's pass before the first robot is served) and,
            for a large model on a GPU, memory: a size that does not fit stops the timing and
            caps ``max_batch_size`` below it.
        background_timing: once serving, time the larger batch sizes (powers of two up to
            ``max_batch_size``) on example observations in quiet spells (no request for 0.5 s,
            or for longer than the pass takes); on a GPU each pass's peak memory caps the sizes
            predicted not to fit. Either way a backlog grows the batch size one size at a time,
            its first batch its first measurement; a size that runs out of memory or hangs caps
            ``max_batch_size`` below it.
        device: ``cpu``, ``cuda``, ``cuda:1``, ...
        backend: ``torch``, ``jax`` or ``numpy`` for embedded policies; ``None`` picks one.
        default_deadline_ms: deadline for requests that carry none; ``None`` uses the policy's own.
        max_queue: most requests waiting for this policy; more are refused with ``overloaded``.
        max_batch_size: most robots' observations in one forward pass (1: one at a time).
        max_batch_wait_ms: longest a request waits on an idle lane for others to join its batch
            (never past what its deadline allows, and not at all when arrivals are too rare).
        lanes: execution threads for this policy (batches that run at the same time).
        torch_threads: on the CPU, torch's intra-op threads per lane; ``None``: ``OMP_NUM_THREADS``
            if exported, else the usable cores less one, shared by all CPU policies' lanes (see
            :mod:`chunkline.server.robot.cpu_threads`). Other devices: not set.
        hang_timeout_s: a batch running this long (and 10x its predicted time) is declared hung:
            its requests fail, its lane thread is replaced, ``/readyz`` reports not ready until
            the stuck call returns.
        batch_strategy: who picks each batch among the queued requests: ``admission`` (tenants'
            fair share, then earliest deadline, batches as full as the batching rule allows) or
            ``fleet`` (for fleets of robots: the batch and its size worth the most weighted
            executed time per GPU-second, from the requests' urgency and robots' weights; see
            :mod:`chunkline.server.robot.fleet`). Admission refuses and drops work the same either way.
        fleet_age_bound_ms: the ``fleet`` strategy's action-age objective: the age (a row's tick
            less its observation's time) it keeps its robots' rows within, weighed against executed
            time (``docs/design/fleet-age.md``); ``None``: ages are not weighed.
    """

    ref: str
    name: str | None = None
    args: dict[str, PolicyArg] = Field(default_factory=dict)
    spec: dict[str, Any] | None = None
    warm_batch_sizes: tuple[Annotated[int, Field(ge=1)], ...] = (1,)
    background_timing: bool = True
    device: str = "cpu"
    backend: str | None = None
    default_deadline_ms: Annotated[float, Field(gt=0)] | None = None
    max_queue: Annotated[int, Field(ge=1)] = 256
    max_batch_size: Annotated[int, Field(ge=1, le=1024)] = 16
    max_batch_wait_ms: Annotated[float, Field(ge=0, le=1000)] = 2.0
    lanes: Annotated[int, Field(ge=1, le=64)] = 1
    torch_threads: Annotated[int, Field(ge=1, le=256)] | None = None
    hang_timeout_s: Annotated[float, Field(gt=0)] = 30.0
    batch_strategy: Literal["admission", "fleet"] = "admission"
    fleet_age_bound_ms: Annotated[float, Field(gt=0, le=3_600_000)] | None = 600.0

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="after")
    def _warm_from_one(self) -> PolicyConfig:
        if not self.warm_batch_sizes or self.warm_batch_sizes[0] != 1 or list(self.warm_batch_sizes) != sorted(set(self.warm_batch_sizes)):
            raise ValueError("warm_batch_sizes must start at 1 and increase")
        return self

    @property
    def model_name(self) -> str:
        return self.name or self.ref

    def admission_config(self) -> AdmissionConfig:
        """Admission's settings for this policy."""
        return AdmissionConfig(max_queue=self.max_queue, max_batch_size=self.max_batch_size, workers=self.lanes)

    def batch_policy(self) -> BatchPolicy:
        return BatchPolicy(max_batch_size=self.max_batch_size, max_batch_wait=self.max_batch_wait_ms / 1000.0)

    def fleet_config(self) -> FleetConfig:
        """The ``fleet`` strategy's settings for this policy."""
        bound = self.fleet_age_bound_ms
        return FleetConfig(age_bound_s=None if bound is None else bound / 1000.0)


def parse_policy_arg(text: str) -> tuple[str, PolicyArg]:
    """``key=value`` from ``--policy-arg``: the value read as a TOML value (``30``, ``0.5``, ``true``,
    ``[1, 2]``, ``"text"``), else taken as the plain string (``path=/ckpt/act``).

    Raises:
        ValueError: no ``=`` or an empty key.
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key.isidentifier():
        raise ValueError(f"--policy-arg wants KEY=VALUE with KEY a Python identifier, got {text!r}")
    try:
        value: PolicyArg = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key, value


def policies_from_flags(flags: Sequence[tuple[str, str]]) -> list[PolicyConfig]:
    """Policies from ``--policy REF``, ``--policy-arg KEY=VALUE`` and ``--name NAME`` in the order
    given: an argument or a name belongs to the ``--policy`` before it.

    Raises:
        ValueError: an argument or a name before any ``--policy``, or a policy named twice.
    """
    docs: list[dict[str, Any]] = []
    for flag, value in flags:
        if flag == "policy":
            docs.append({"ref": value, "args": {}})
        elif not docs:
            raise ValueError(f"--{flag.replace('_', '-')} {value!r} comes before any --policy it could belong to")
        elif flag == "name":
            if "name" in docs[-1]:
                raise ValueError(f"--policy {docs[-1]['ref']!r} is given two names")
            docs[-1]["name"] = value
        else:
            key, arg = parse_policy_arg(value)
            docs[-1]["args"][key] = arg
    return [PolicyConfig.model_validate(doc) for doc in docs]
