"""Timing passes: how long a batch of each size takes, on example observations (worker threads only).

Start-up times batch 1 (and any ``warm_batch_sizes``) with :func:`measure_service_guarded`; the
runner times the larger sizes in quiet spells with :func:`timing_pass` on a lane. On a GPU a
timing pass also samples the device memory (:class:`~.sizing.MemorySample`) for the memory guard.
Neither torch nor jax is imported here: a framework the policy has not loaded is not in use.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from chunkline.policies.base import Policy, example_observation, stack_observations
from chunkline.server.robot.sizing import MemorySample

__all__ = ["measure_service", "measure_service_guarded", "timing_pass", "TimingOutcome", "out_of_memory",
           "release_device_memory"]


def measure_service(policy: Policy, sizes: tuple[int, ...], budget_s: float = 1.0) -> dict[int, float]:
    """Median time of a forward pass per batch size, to seed admission before real traffic.

    Up to three passes per size within ``budget_s``; a slow policy gets a single pass at batch 1
    (admission then extrapolates proportionally, the cautious direction)."""
    rng = np.random.default_rng(0)
    out: dict[int, float] = {}
    spent = 0.0
    for size in sizes:
        batch = stack_observations(policy.spec, [example_observation(policy.spec, rng) for _ in range(size)])
        times: list[float] = []
        while len(times) < 3 and (not times or spent < budget_s):
            t = time.perf_counter()
            policy.infer_batch(batch)
            times.append(time.perf_counter() - t)
            spent += times[-1]
        out[size] = float(np.median(times))
        if spent >= budget_s:
            break
    return out


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says the device ran out of memory (torch's ``OutOfMemoryError``, jax's
    ``RESOURCE_EXHAUSTED``, a plain ``MemoryError``), without importing either framework."""
    return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError" or "out of memory" in str(exc).lower() \
        or "RESOURCE_EXHAUSTED" in str(exc)


def _imported_torch() -> Any:
    """torch if some code has imported it completely, else ``None``.

    Never imports it. A module another thread is still importing (the server loads its text
    models while the robot lanes already run) sits in ``sys.modules`` half-built, without
    ``torch.cuda``: it counts as absent (a policy on a GPU imported torch before its warm-up)."""
    torch = sys.modules.get("torch")
    if torch is None or getattr(getattr(torch, "__spec__", None), "_initializing", False):
        return None
    return torch if hasattr(torch, "cuda") else None


def release_device_memory() -> None:
    """Hand torch's cached blocks back after an out-of-memory (the next, smaller pass needs them)."""
    torch = _imported_torch()
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _cuda() -> Any:
    """torch's CUDA module when the policy has put something on a GPU (else no memory to guard)."""
    torch = _imported_torch()
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda


@dataclasses.dataclass(frozen=True)
class TimingOutcome:
    """One timed size: the median pass (seconds) and, on a GPU, its memory."""

    size: int
    seconds: float
    memory: MemorySample | None


def timing_pass(policy: Policy, size: int, budget_s: float = 0.0) -> TimingOutcome:
    """Time ``size`` (:func:`measure_service`: one pass, more while under ``budget_s``), sampling the
    device memory on a GPU: what was allocated before, the peak, and what the process can hold.

    Raises:
        whatever the policy raises (an out-of-memory among them: see :func:`out_of_memory`).
    """
    cuda = _cuda()
    try:
        if cuda is None:
            return TimingOutcome(size, measure_service(policy, (size,), budget_s)[size], None)
        cuda.reset_peak_memory_stats()
        base = int(cuda.memory_allocated())
        seconds = measure_service(policy, (size,), budget_s)[size]
    except Exception as exc:
        if out_of_memory(exc):
            release_device_memory()  # for the smaller batches served from now on
        raise
    free, _total = cuda.mem_get_info()
    memory = MemorySample(base=base, peak=int(cuda.max_memory_allocated()), limit=int(free) + int(cuda.memory_reserved()))
    return TimingOutcome(size, seconds, memory)


def measure_service_guarded(policy: Policy, sizes: tuple[int, ...], on_size: Callable[[TimingOutcome], None] | None = None,
                            budget_s: float = 1.0) -> tuple[list[TimingOutcome], int]:
    """:func:`timing_pass` one size at a time, smallest first, stopping at the first size that
    runs out of memory.

    Returns:
        the sizes timed, and the largest size known to fit (the size before the one that ran
        out; ``sys.maxsize`` when none did).
    """
    out: list[TimingOutcome] = []
    for size in sizes:
        try:
            out.append(timing_pass(policy, size, budget_s))
        except Exception as exc:
            if not out or not out_of_memory(exc):
                raise  # batch 1 must run, and any other failure is a broken policy
            return out, out[-1].size
        if on_size is not None:
            on_size(out[-1])
    return out, sys.maxsize
