"""Robot-side safety layer: limits, the action filter, verified fallback behaviours and the watchdog.

Runs on the robot (numpy and the standard library only). Typical use goes through
:class:`chunkline.broker.Broker`, which owns a :class:`Watchdog`; the pieces are usable alone::

    limits = Limits(lower=[-1.0] * 7, upper=[1.0] * 7, max_velocity=2.0, max_acceleration=20.0, dt=0.02)
    dog = Watchdog(limits, initial_position=np.zeros(7))   # verifies the hold fallback
    command = dog.step(proposal, seq=1)                     # filtered, or the fallback's
"""

from .exceptions import (
    ActionShapeError,
    FallbackVerificationError,
    LimitsError,
    SafetyError,
    UnsafeStateError,
    WatchdogConfigError,
)
from .fallback import CallableBehaviour, FallbackBehaviour, HoldBehaviour, SafePoseBehaviour
from .filter import FilterMode, FilterResult, InterventionCounts, SafetyFilter, Verdict
from .limits import LimitKind, Limits, MotionState, Violation
from .verify import VerificationReport, default_horizon, verify_fallback, worst_case_states
from .watchdog import FallbackReason, Mode, Watchdog, WatchdogCounts

__all__ = [
    "ActionShapeError",
    "CallableBehaviour",
    "FallbackBehaviour",
    "FallbackReason",
    "FallbackVerificationError",
    "FilterMode",
    "FilterResult",
    "HoldBehaviour",
    "InterventionCounts",
    "LimitKind",
    "Limits",
    "LimitsError",
    "Mode",
    "MotionState",
    "SafePoseBehaviour",
    "SafetyError",
    "SafetyFilter",
    "UnsafeStateError",
    "Verdict",
    "VerificationReport",
    "Violation",
    "Watchdog",
    "WatchdogConfigError",
    "WatchdogCounts",
    "default_horizon",
    "verify_fallback",
    "worst_case_states",
]
