"""Robot-side configuration files: broker settings, safety limits and the fallback, validated.

The boundary where a human-written file (JSON, or TOML where ``tomllib`` exists) becomes the
broker's dataclasses: a ``[broker]`` table validates into ``BrokerConfig`` itself, ``[limits]`` and
``[fallback]`` into the safety layer's. Unknown keys are refused, so a typo never leaves a default
silently in place. docs/broker.md ("A settings file") has a complete example."""

from __future__ import annotations

import json
import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..safety.exceptions import SafetyError
from ..safety.fallback import FallbackBehaviour, HoldBehaviour, SafePoseBehaviour
from ..safety.limits import Limits
from .config import BrokerConfig
from .exceptions import BrokerConfigError

__all__ = ["BrokerSection", "LimitsSection", "FallbackSection", "RobotSettings", "load_settings"]

_Vec = float | list[float]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


#: The ``[broker]`` table: :class:`BrokerConfig` itself (its fields, defaults and checks).
BrokerSection = BrokerConfig


class LimitsSection(_Strict):
    """The ``[limits]`` table; ``dt`` defaults to the broker's control period."""

    lower: _Vec
    upper: _Vec
    max_velocity: _Vec
    max_acceleration: _Vec
    dt: float | None = Field(default=None, gt=0)


class FallbackSection(_Strict):
    """The ``[fallback]`` table: ``kind = "hold"`` (default) or ``"safe_pose"`` with ``pose``."""

    kind: Literal["hold", "safe_pose"] = "hold"
    pose: list[float] | None = None
    max_speed: _Vec | None = None


class RobotSettings(_Strict):
    """A whole robot-side configuration file."""

    broker: BrokerConfig = BrokerConfig()
    limits: LimitsSection | None = None
    fallback: FallbackSection = FallbackSection()

    def broker_config(self) -> BrokerConfig:
        """The :class:`BrokerConfig`."""
        return self.broker

    def build_limits(self) -> Limits | None:
        """The :class:`Limits` (``None`` when the file has no ``[limits]``).

        Raises:
            BrokerConfigError: the limits are invalid.
        """
        if self.limits is None:
            return None
        d = self.limits.model_dump()
        if d["dt"] is None:
            d["dt"] = self.broker.control_period_s
        try:
            return Limits(**d)
        except SafetyError as exc:
            raise BrokerConfigError(f"[limits]: {exc}") from exc

    def build_fallback(self, limits: Limits | None) -> FallbackBehaviour:
        """The fallback behaviour.

        Raises:
            BrokerConfigError: a safe pose without a pose or without limits, or an invalid pose.
        """
        fb = self.fallback
        if fb.kind == "hold":
            return HoldBehaviour(limits)
        if fb.pose is None or limits is None:
            raise BrokerConfigError("[fallback] kind = 'safe_pose' needs a pose and a [limits] table")
        try:
            return SafePoseBehaviour(limits, fb.pose, fb.max_speed)
        except SafetyError as exc:
            raise BrokerConfigError(f"[fallback]: {exc}") from exc


def _first_error(exc: ValidationError) -> str:
    err = exc.errors(include_url=False, include_input=False)[0]
    where = ".".join(str(p) for p in err["loc"]) or "file"
    return f"{where}: {err['msg']}"


def load_settings(source: str | os.PathLike[str] | dict[str, Any]) -> RobotSettings:
    """Validate a configuration given as a mapping or a ``.json`` / ``.toml`` file.

    Raises:
        BrokerConfigError: unreadable file, unknown key, or an invalid value (naming it).
    """
    if isinstance(source, dict):
        data = source
    else:
        path = os.fspath(source)
        try:
            if path.endswith(".toml"):
                try:
                    import tomllib
                except ImportError as exc:  # Python 3.10
                    raise BrokerConfigError("TOML needs Python 3.11+; use JSON") from exc
                with open(path, "rb") as fh:
                    data = tomllib.load(fh)
            else:
                with open(path, encoding="utf-8") as fh:
                    data = json.load(fh)
        except (OSError, ValueError) as exc:
            raise BrokerConfigError(f"cannot read {path}: {exc}") from exc
    try:
        return RobotSettings.model_validate(data)
    except ValidationError as exc:
        raise BrokerConfigError(_first_error(exc)) from None
