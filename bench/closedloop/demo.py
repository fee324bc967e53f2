"""The closed-loop part of ``make demo``: a simulated robot on the reach task (MuJoCo), driven
in real time through chunkline's broker by the remote scripted expert, over a fault proxy that
adds network delay; the synchronous (openpi-style) loop runs the same episode for comparison.
Prints one line per strategy and saves a timeline plot."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ..faultproxy import FaultProxy
from ..serverproc import ServerProcess
from .des import Conditions
from .plots import plot_outage_timeline

__all__ = ["closed_loop_available", "run_closed_loop_demo"]


def closed_loop_available() -> bool:
    """Whether gymnasium and MuJoCo are installed (``pip install 'chunkline[sim]'``)."""
    return importlib.util.find_spec("gymnasium") is not None and importlib.util.find_spec("mujoco") is not None


def run_closed_loop_demo(out_dir: Path | str = Path("results") / "demo", *, delay_ms: float = 60.0,
                         episode_s: float = 5.0, seed: int = 0) -> int:
    """Run the demo episode with chunkline's broker and with the synchronous loop.

    Args:
        out_dir: where the plot goes.
        delay_ms: one-way network delay the proxy adds.
        episode_s: episode length (real time).
        seed: the episode's seed.

    Returns:
        0 when chunkline's run succeeded and broke no limit, else 1.
    """
    from .realtime import run_realtime_episode
    from .tasks import make_task

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    task = make_task("reach", episode_s=episode_s)
    cond = Conditions(delay_ms / 1000.0, label=f"delay {delay_ms:g} ms")
    print(f"\nclosed loop: MuJoCo Reacher tracking a moving target, policy 'reach-expert' served remotely, "
          f"{delay_ms:g} ms one-way delay (fault proxy), {episode_s:g} s per run")
    results = []
    with ServerProcess(["--policy", "reach-expert"]) as server, FaultProxy(server.port, max_seconds=300) as proxy:
        for strategy in ("chunkline", "sync"):
            r = run_realtime_episode(task, strategy, proxy, cond, seed=seed, keep_timeline=True)
            results.append(r)
            verdict = "SUCCESS" if r.success else "failed "
            print(f"  {strategy:9s} {verdict}  tracking error {1000 * r.score:6.1f} mm (success: < {1000 * task.tolerance_m:g} mm "
                  f"{100 * task.required_fraction:g}% of the time)  stale actions {r.stale_actions:4d}  "
                  f"limit violations {r.violation_ticks:3d}  chunks {r.chunks}")
    task.close()
    path = plot_outage_timeline(results, None, out / "closed_loop_reach.png",
                                title=f"reach over a {delay_ms:g} ms link: chunkline broker vs synchronous loop",
                                tolerance_m=task.tolerance_m)
    print(f"  plot: {path}")
    best = results[0]
    return 0 if best.success and best.violation_ticks == 0 else 1
