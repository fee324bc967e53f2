"""Every error the policy layer raises, each a named class.

The server maps them onto wire error codes: :class:`PolicyNotFound` to ``unknown_model``,
:class:`PolicyOutputError` and any other failure inside a forward pass to ``policy_failed``.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "PolicyError",
    "PolicyNotFound",
    "PolicyLoadError",
    "PolicyConfigError",
    "WeightsFormatError",
    "UnregisteredProcessorStep",
    "PolicyOutputError",
    "InjectedPolicyFailure",
]


class PolicyError(Exception):
    """Base class of every error raised by ``chunkline.policies``."""


class PolicyNotFound(PolicyError, LookupError):
    """A policy reference names nothing the registry knows.

    Args:
        ref: the reference that was asked for.
        available: the names the registry does know (shown in the message).
    """

    def __init__(self, ref: str, available: Sequence[str]) -> None:
        self.ref = ref
        self.available = list(available)
        super().__init__(
            f"unknown policy {ref!r}; known names: {', '.join(self.available)} "
            "(or a path to an .npz from save_weights, or 'module:factory')"
        )


class PolicyLoadError(PolicyError):
    """A policy was found but could not be built: bad backend or device, import failure,
    a factory that raised or returned something that is not a policy."""


class UnregisteredProcessorStep(PolicyLoadError):
    """A LeRobot checkpoint's processor file names a step outside LeRobot's registry of processor
    steps (a class path, an unknown name), or a state file outside the checkpoint: refused before
    LeRobot reads the file, so no class a checkpoint names is ever imported.

    Args:
        file: the processor file (its name in the checkpoint).
        index: the step's position in the file's ``steps``.
        step: what the step names (its ``registry_name`` or ``class``), as written.
        reason: why it is refused.
    """

    def __init__(self, file: str, index: int, step: str, reason: str) -> None:
        self.file, self.index, self.step, self.reason = file, index, step, reason
        super().__init__(f"{file}: step {index} ({step!r}) refused: {reason}")


class PolicyConfigError(PolicyError, ValueError):
    """An embedded policy's architecture config is inconsistent or malformed."""


class WeightsFormatError(PolicyLoadError, ValueError):
    """A weights file is not a valid chunkline ``.npz`` (missing or malformed header, object
    arrays, missing or misshapen parameters)."""


class PolicyOutputError(PolicyError, ValueError):
    """A backend returned actions of the wrong shape or dtype.

    Non-finite values are *not* an output error: the robot-side safety filter handles NaN.
    """


class InjectedPolicyFailure(PolicyError, RuntimeError):
    """Raised on purpose by :class:`~chunkline.policies.embedded.noop.FailingPolicy`."""
