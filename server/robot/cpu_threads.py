"""How many intra-op threads torch runs each CPU policy's batches on, and setting them per thread.

torch's intra-op count is per calling thread (OpenMP's and MKL's per-thread settings; a thread's
first torch call takes the value last set by any thread), so every thread that runs a CPU policy
sets it itself: its lanes, and the loading thread before warm-up and timing. Each busy
lane holds its own OpenMP team, so the cores are shared among all CPU policies' lanes, less one
for the event loop; idle OpenMP workers spin, so more threads than cores cost CPU, not speed.
Lanes of policies on other devices get torch's own count back (a thread's first call would take
the CPU policies'). Rationale: docs/design/cpu_threads.md.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Mapping, Sequence

from chunkline.server.robot.config import PolicyConfig

__all__ = ["ThreadChoice", "choose_torch_threads", "on_cpu", "usable_cores", "set_torch_threads", "torch_thread_count",
           "torch_thread_setter", "policy_threads"]

#: the environment variable an operator exports to fix every OpenMP thread count
OMP_ENV = "OMP_NUM_THREADS"


@dataclasses.dataclass(frozen=True, slots=True)
class ThreadChoice:
    """A CPU policy's intra-op threads per lane, and why: ``config``, ``OMP_NUM_THREADS`` or ``auto``."""

    count: int
    source: str

    def describe(self) -> str:
        return f"{self.count} torch intra-op thread{'s' if self.count != 1 else ''} per lane ({self.source})"


def on_cpu(device: str) -> bool:
    """Whether a policy's ``device`` string names the CPU (``cpu``, ``cpu:0``)."""
    return device.strip().lower().partition(":")[0] == "cpu"


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity call on this platform
        return max(1, os.cpu_count() or 1)


def _env_threads(env: Mapping[str, str]) -> int | None:
    """``OMP_NUM_THREADS`` as OpenMP reads it (the first of a nested list), if a positive integer."""
    first = env.get(OMP_ENV, "").split(",")[0].strip()
    return int(first) if first.isdigit() and int(first) > 0 else None


def choose_torch_threads(configured: int | None, env: Mapping[str, str], cores: int, cpu_lanes: int) -> ThreadChoice:
    """The intra-op threads of one CPU policy's lanes.

    Args:
        configured: the policy's ``torch_threads`` setting (first choice).
        env: the process environment; an ``OMP_NUM_THREADS`` in it comes next.
        cores: usable cores (:func:`usable_cores`).
        cpu_lanes: lanes of every policy served on the CPU (each may run a batch at once).
    """
    if configured is not None:
        return ThreadChoice(max(1, configured), "config")
    from_env = _env_threads(env)
    if from_env is not None:
        return ThreadChoice(from_env, OMP_ENV)
    return ThreadChoice(max(1, (cores - 1) // max(1, cpu_lanes)),
                        f"auto: {cores} usable cores less one for the event loop, over {cpu_lanes} CPU lane{'s' if cpu_lanes != 1 else ''}")


def policy_threads(policies: Sequence[PolicyConfig], env: Mapping[str, str] | None = None,
                   cores: int | None = None) -> dict[str, ThreadChoice]:
    """Each CPU policy's :class:`ThreadChoice`, by model name (policies on other devices: none)."""
    cpu = [pc for pc in policies if on_cpu(pc.device)]
    lanes = sum(pc.lanes for pc in cpu)
    env = os.environ if env is None else env
    cores = usable_cores() if cores is None else cores
    return {pc.model_name: choose_torch_threads(pc.torch_threads, env, cores, lanes) for pc in cpu}


def torch_thread_count() -> int | None:
    """The calling thread's torch intra-op threads, if torch is loaded."""
    get = getattr(sys.modules.get("torch"), "get_num_threads", None)
    return None if get is None else int(get())


def set_torch_threads(count: int) -> bool:
    """Set the calling thread's torch intra-op threads to ``count`` if torch is loaded (a policy
    that uses torch has imported it by then; nothing imports it for this). Returns whether it was."""
    torch = sys.modules.get("torch")
    get, put = getattr(torch, "get_num_threads", None), getattr(torch, "set_num_threads", None)
    if get is None or put is None:  # no torch, or one still being imported by another thread
        return False
    # A thread's first torch call takes the count last set by any thread, overriding one set
    # before it: make that first call here, then set.
    get()
    put(count)
    return True


def torch_thread_setter(count: int) -> Callable[[], None]:
    """:func:`set_torch_threads` for ``count``, as a lane's ``init``."""

    def set_threads() -> None:
        set_torch_threads(count)

    return set_threads
