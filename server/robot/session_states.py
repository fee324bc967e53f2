"""Per-session policy state of one stateful policy, and the arguments a lane's batch takes."""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

from chunkline.policies.base import Policy
from chunkline.policies.prefix import ActionPrefix

__all__ = ["BatchArgs", "BatchItem", "SessionStates"]


class BatchItem(Protocol):
    """A request as a batch needs it."""

    @property
    def obs(self) -> dict[str, Any]: ...

    @property
    def session(self) -> str: ...

    @property
    def prefix(self) -> ActionPrefix | None: ...


class BatchArgs(NamedTuple):
    """What :func:`~.lanes.run_batch` takes (a NamedTuple: it is passed as ``*args``)."""

    policy: Policy
    observations: list[dict[str, Any]]
    states: list[Any] | None
    prefixes: list[ActionPrefix | None] | None


class SessionStates:
    """Each session's state for a stateful policy (a fresh one for a session not seen yet).

    A session's requests never share a batch (see the runner's compatibility rule), so a batch
    holds at most one state per session and storing its outcome cannot lose an update.

    Args:
        policy: the served policy.
    """

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self._states: dict[str, Any] = {}

    def __len__(self) -> int:
        return len(self._states)

    def batch_args(self, items: list[Any]) -> BatchArgs:
        """The arguments of a batch of these requests (:class:`BatchItem`): their observations, and
        their sessions' states and prefixes where the policy takes them."""
        policy = self.policy
        states = [self.state_of(i.session) for i in items] if policy.stateful else None
        prefixes = [i.prefix for i in items] if policy.accepts_prefix else None
        return BatchArgs(policy, [i.obs for i in items], states, prefixes)

    def state_of(self, session: str) -> Any:
        return self._states[session] if session in self._states else self.policy.new_session_state()

    def store(self, session: str, state: Any) -> None:
        """The state a batch returned for ``session``."""
        self._states[session] = state

    def release(self, session: str) -> None:
        """The session ended."""
        self._states.pop(session, None)
