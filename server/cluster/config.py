"""Fleet configuration: the replica template, counts, placement, scaling and rollout settings."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

from chunkline.server.cluster.autoscale import AutoscaleConfig
from chunkline.server.cluster.rollout import RolloutConfig
from chunkline.server.config import ServerConfig

__all__ = ["FleetConfig"]


class FleetConfig(BaseModel):
    """Everything ``chunkline cluster up`` can be told.

    Args:
        server: the template every replica is started from (policies, batching, lanes, limits);
            its port is ignored (each replica picks a free one) and its ledger replaced by the
            fleet's one ledger.
        replicas: how many replicas to start (and keep: a lost one is replaced).
        autoscale: scale between ``min_replicas`` and ``max_replicas`` from queue wait and
            deadline misses; ``None`` keeps ``replicas`` fixed.
        directory_host, directory_port: where the directory listens (robots dial it; port 0
            picks a free one).
        replica_cpus, replica_gpus: Ray resources each replica reserves (fractions allowed).
        ledger: the fleet's one usage ledger (SQLite, on the manager's node); ``None``: none.
        poll_interval_s: how often the manager reads replica state, pushes quota leases and
            decides on scaling.
        replica_timeout_s: a replica that does not answer its state poll for this long is
            treated as lost (its robots are placed elsewhere when they re-ask).
        default_rate_hz: a robot's request rate when it does not say (``?rate_hz=`` in its URI).
        placement_ttl_s: how long a placement token is valid (only for the redirected handshake).
        drain_grace_s: how long a drained replica waits for in-flight work before closing sessions.
        rollout: canary share, observation time and rollback thresholds.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    server: ServerConfig
    replicas: Annotated[int, Field(ge=1, le=256)] = 1
    autoscale: AutoscaleConfig | None = None
    directory_host: str = "127.0.0.1"
    directory_port: Annotated[int, Field(ge=0, le=65535)] = 8000
    replica_cpus: Annotated[float, Field(ge=0)] = 1.0
    replica_gpus: Annotated[float, Field(ge=0)] = 0.0
    ledger: Path | None = Path("chunkline-fleet-ledger.db")
    poll_interval_s: Annotated[float, Field(gt=0, le=60)] = 0.5
    replica_timeout_s: Annotated[float, Field(gt=0)] = 3.0
    default_rate_hz: Annotated[float, Field(gt=0)] = 10.0
    placement_ttl_s: Annotated[float, Field(gt=0, le=600)] = 30.0
    drain_grace_s: Annotated[float, Field(ge=0)] = 10.0
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)

    @model_validator(mode="after")
    def _counts(self) -> FleetConfig:
        a = self.autoscale
        if a is not None and not (a.min_replicas <= self.replicas <= a.max_replicas):
            raise ValueError(f"replicas={self.replicas} must lie within autoscale [{a.min_replicas}, {a.max_replicas}]")
        return self
