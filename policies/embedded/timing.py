"""Measure embedded policies' forward-pass time per backend and batch size.

``python -m chunkline.policies.embedded.timing [--policies loadtest loadtest-compute]
[--backends torch jax numpy] [--batches 1 4 16] [--repeats 30]`` prints one line per
(policy, backend, batch): median and p90 milliseconds and items per second.
A measurement tool, so it reads the wall clock; nothing in the serving path does.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np

from ..base import Policy, example_observation, stack_observations

__all__ = ["Timing", "time_policy", "main"]


@dataclasses.dataclass(frozen=True)
class Timing:
    """Forward-pass times of one policy at one batch size.

    Args:
        policy: the policy's name. backend: the backend. batch: ``B``.
        median_ms: median time of one :meth:`Policy.infer_batch`. p90_ms: its 90th percentile.
    """

    policy: str
    backend: str
    batch: int
    median_ms: float
    p90_ms: float

    @property
    def items_per_s(self) -> float:
        return self.batch / (self.median_ms / 1000.0)


def time_policy(
    policy: Policy,
    batch: int,
    *,
    repeats: int = 30,
    backend: str = "?",
    clock: Callable[[], float] = time.perf_counter,
    seed: int = 0,
) -> Timing:
    """Time ``repeats`` forward passes of ``policy`` on a random batch of ``batch`` items
    (after two untimed passes).

    Args:
        policy: a warmed-up policy.
        batch: ``B``.
        repeats: timed passes.
        backend: label for the result.
        clock: seconds, monotonic.
        seed: seed of the random observations.
    """
    rng = np.random.default_rng(seed)
    obs = stack_observations(policy.spec, [example_observation(policy.spec, rng) for _ in range(batch)])
    for _ in range(2):
        policy.infer_batch(obs)
    times = []
    for _ in range(repeats):
        start = clock()
        policy.infer_batch(obs)
        times.append((clock() - start) * 1000.0)
    times.sort()
    return Timing(policy.name, backend, batch, statistics.median(times), times[min(len(times) - 1, int(0.9 * len(times)))])


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point (see the module docstring).

    Args:
        argv: arguments, ``sys.argv[1:]`` by default.
    """
    from .build import build_embedded
    from .weights import default_weights

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", nargs="+", default=["loadtest", "loadtest-compute"])
    parser.add_argument("--backends", nargs="+", default=["torch", "jax", "numpy"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    for kind in args.policies:
        weights = default_weights(kind)
        for backend in args.backends:
            policy = build_embedded(weights, backend=backend, batch_sizes=sorted(set(args.batches)))
            policy.warmup()
            for batch in args.batches:
                t = time_policy(policy, batch, repeats=args.repeats, backend=backend)
                print(f"{kind:18s} {backend:6s} B={batch:<3d} median {t.median_ms:8.2f} ms  p90 {t.p90_ms:8.2f} ms  "
                      f"{t.items_per_s:8.1f} items/s", flush=True)
            policy.close()


if __name__ == "__main__":
    main()
