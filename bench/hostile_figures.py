"""The figures of :mod:`.hostile`: the bystander's round trips per condition, their p99 ratio with
a bootstrap interval, the slowest requests' share of server time, and ``--trace``'s file."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import statistics
from pathlib import Path

import numpy as np

__all__ = ["Answered", "SERVER_STAGES", "ServerUse", "report", "write_trace"]

SERVER_STAGES = ("decode_ms", "queue_ms", "batch_wait_ms", "infer_ms")


@dataclasses.dataclass(frozen=True, slots=True)
class Answered:
    """One answered request: when it was sent (``time.monotonic``, the clock ``perf`` records on
    with ``-k CLOCK_MONOTONIC``), its round trip, and the times the server accounts for (from
    taking the message to the answer: decode, queue, batch wait, inference)."""

    sent_at: float
    round_trip_ms: float
    stages: dict[str, float]


@dataclasses.dataclass(slots=True)
class ServerUse:
    """What the server used in one condition's blocks, a value per block: CPU (cores, its worker
    processes included), its event loop's thread's CPU (cores), the software-interrupt time of
    the server's CPUs (cores), bytes read per second (sockets included), and its main process's
    resident memory (MiB): the peak during the block and the level once the server settled after it."""

    cpu: list[float] = dataclasses.field(default_factory=list)
    loop_cpu: list[float] = dataclasses.field(default_factory=list)
    softirq: list[float] = dataclasses.field(default_factory=list)
    read: list[float] = dataclasses.field(default_factory=list)
    rss_peak: list[float] = dataclasses.field(default_factory=list)
    rss_after: list[float] = dataclasses.field(default_factory=list)


def _stats(samples: list[float]) -> tuple[float, float]:
    return statistics.median(samples), float(np.percentile(samples, 99))


def _p99_ratio_interval(idle: list[float], attack: list[float], draws: int = 2000) -> tuple[float, float]:
    """A 95% bootstrap interval of the p99 ratio (attack over idle), each side resampled."""
    rng = np.random.default_rng(0)
    a, b = np.asarray(idle), np.asarray(attack)
    ratios = [np.percentile(rng.choice(b, len(b)), 99) / np.percentile(rng.choice(a, len(a)), 99) for _ in range(draws)]
    low, high = np.percentile(ratios, [2.5, 97.5])
    return float(low), float(high)


def report(args: argparse.Namespace, placement: str, samples: dict[str, list[float]],
            answered: dict[str, list[Answered]], failures: dict[str, collections.Counter[str]],
            use: dict[str, ServerUse], opened: list[float]) -> None:
    """One placement's figures: the round trip per condition and their ratios, the slowest
    requests' share of server time, failures, and the server's CPU, bytes read and memory."""
    idle, attack = _stats(samples["idle"]), _stats(samples["attack"])
    low, high = _p99_ratio_interval(samples["idle"], samples["attack"])
    print(f"placement {placement}")
    print(f"  bystander robot ({args.bystander}) round trip (ms), attack {args.attack}, "
          f"{len(samples['idle'])} idle / {len(samples['attack'])} "
          f"under attack, A B x {args.rounds}: idle median {idle[0]:.2f} p99 {idle[1]:.2f}; "
          f"attack median {attack[0]:.2f} p99 {attack[1]:.2f}; "
          f"ratio median {attack[0] / idle[0]:.2f} p99 {attack[1] / idle[1]:.2f} (95% bootstrap interval {low:.2f}-{high:.2f})")
    for condition, done in answered.items():
        tail = sorted(done, key=lambda a: a.round_trip_ms)[-max(1, len(done) // 100):]
        if tail:
            stages = ", ".join(f"{k.removesuffix('_ms')} {statistics.median(a.stages[k] for a in tail):.2f}" for k in SERVER_STAGES)
            print(f"  slowest 1% answered ({condition}): round trip median {statistics.median(a.round_trip_ms for a in tail):.2f} ms, "
                  f"of which the server's stages {statistics.median(sum(a.stages.values()) for a in tail):.2f} ms ({stages})")
    for condition, counted in failures.items():
        if counted:
            print(f"  failed requests ({condition}): " + ", ".join(f"{kind} x{n}" for kind, n in counted.most_common()))
    idle_use, attack_use = use["idle"], use["attack"]
    if idle_use.cpu and attack_use.cpu:
        print(f"  server CPU (cores, its worker processes included): idle {statistics.mean(idle_use.cpu):.2f}, "
              f"attack {statistics.mean(attack_use.cpu):.2f}; server reads (MB/s, sockets included): "
              f"idle {statistics.mean(idle_use.read) / 1e6:.1f}, attack {statistics.mean(attack_use.read) / 1e6:.1f}")
    if idle_use.loop_cpu and attack_use.loop_cpu:
        # Work on the loop's thread delays every robot's turn; CPU time hardly moves with other jobs on the machine.
        print(f"  server event loop thread CPU (cores): idle {statistics.mean(idle_use.loop_cpu):.3f}, "
              f"attack {statistics.mean(attack_use.loop_cpu):.3f}")
    if idle_use.softirq and attack_use.softirq:
        print(f"  software interrupts on the server's CPUs (cores): idle {statistics.mean(idle_use.softirq):.3f}, "
              f"attack {statistics.mean(attack_use.softirq):.3f}")
    if idle_use.rss_peak and attack_use.rss_peak:
        print(f"  server memory (resident MiB, main process): idle peak {max(idle_use.rss_peak):.0f}, attack peak "
              f"{max(attack_use.rss_peak):.0f}, settled after each attack {', '.join(f'{m:.0f}' for m in attack_use.rss_after)}")
    if opened and any(opened) and idle_use.cpu and attack_use.cpu:
        # CPU time, unlike the round trip's tail, hardly moves with other jobs on the machine.
        extra = statistics.mean(attack_use.cpu) - statistics.mean(idle_use.cpu)
        print(f"  attacker connections opened (per s): {statistics.mean(opened):.0f}; server CPU per connection opened "
              f"(attack minus idle): {extra / statistics.mean(opened) * 1e6:.0f} us")


def write_trace(path: Path, answered: dict[tuple[str, str], list[Answered]],
                 spans: list[tuple[str, str, float, float]]) -> None:
    """``--trace``: each block's span, then every answered request, in time order."""
    lines = [f"block\t{placement}\t{condition}\t{start:.6f}\t{end:.6f}" for placement, condition, start, end in spans]
    rows = sorted(((a.sent_at, placement, condition, a) for (placement, condition), done in answered.items() for a in done),
                  key=lambda row: row[0])
    lines += [f"request\t{placement}\t{condition}\t{at:.6f}\t{a.round_trip_ms:.3f}\t{sum(a.stages.values()):.3f}"
              for at, placement, condition, a in rows]
    path.write_text("\n".join(lines) + "\n")
