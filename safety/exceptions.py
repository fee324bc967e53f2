"""Every error the safety layer raises, each a named class.

The safety layer runs on the robot: these errors are raised at configuration and start-up
time (bad limits, a fallback that fails verification, a state outside the limits), never
from the per-tick path, which answers with verdicts and counters instead.
"""

from __future__ import annotations

__all__ = [
    "SafetyError",
    "LimitsError",
    "UnsafeStateError",
    "FallbackVerificationError",
    "ActionShapeError",
    "WatchdogConfigError",
]


class SafetyError(Exception):
    """Base class of every safety-layer error."""


class LimitsError(SafetyError, ValueError):
    """A limits specification is invalid (bounds crossed, a limit not positive or not finite, ...)."""


class UnsafeStateError(SafetyError, ValueError):
    """A motion state handed to the safety layer breaks the limits (e.g. an initial position out of bounds)."""


class WatchdogConfigError(SafetyError, ValueError):
    """A watchdog setting is invalid (e.g. ``resume_steps < 1``)."""


class ActionShapeError(SafetyError, ValueError):
    """An action does not have the width the limits describe."""


class FallbackVerificationError(SafetyError):
    """A fallback behaviour broke a limit (or failed to settle) when simulated at start-up.

    Args:
        behaviour: the behaviour's name.
        detail: which start state, which step and which limit.
    """

    def __init__(self, behaviour: str, detail: str) -> None:
        super().__init__(f"fallback {behaviour!r} refused: {detail}")
        self.behaviour = behaviour
        self.detail = detail
