"""The training driver shared by the reach task's learned policies (``train_bc``, ``train_flow``):
demonstrations from the scripted expert, a fit, the weights file, and a closed-loop evaluation.

Two sources of demonstrations, both labelled by the expert: perturbed expert episodes
(:func:`collect_demos`: chunks run late, commands held, noise; the chunk continuing the running
plan with some rows frozen) and the requests chunkline's broker actually sends at delays of
0-20 control steps in the discrete-event loop (:func:`collect_served`: stale observations, the
running plan as prefix, requests in flight across a target jump, some chunks ramped off the
expert's path). Every draw is seeded: the same arguments build the same weights.
``--eval`` / ``--eval-only`` run the policy through the broker at 0 and 200 ms one way.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from chunkline.policies.base import Policy
from chunkline.policies.embedded.tasks import REACH_ACCEL_FIELD, TASK_HORIZON, ReachPlanner
from chunkline.policies.prefix import PrefixBatch
from chunkline.policies.registry import load_policy

from ..report import Column, format_table
from .des import LocalServer, run_des_episode
from .rtc_suite import RtcPlan, broker_config_for, delay_conditions, summarise
from .tasks import make_task

__all__ = ["Demos", "collect_demos", "collect_served", "join_demos", "SERVED_STEPS", "Trainer", "evaluate", "main",
           "EVAL_DELAYS_MS", "MAX_FROZEN"]

#: the evaluation's one-way delays.
EVAL_DELAYS_MS = (0.0, 200.0)
#: the most frozen rows a demonstration's prefix has (a round trip of 0.7 s: d = 16 and jitter).
MAX_FROZEN = 36


@dataclasses.dataclass(frozen=True, slots=True)
class Demos:
    """What the demonstrations recorded, one row per sample.

    Args:
        states: ``[N, 8]``.
        accel: ``[N, 2]`` the target's acceleration (``target_accel``).
        chunks: ``[N, H, 2]`` the expert's chunk for the state alone.
        prefix: ``[N, H, 2]`` the plan running then, from this tick on (its last row repeated
            past its end; ``prefix_mask`` says which rows it had).
        prefix_mask: ``[N, H]``.
        delay: ``[N]`` the frozen rows (0: no prefix).
        rtc_chunks: ``[N, H, 2]`` the expert's chunk continuing ``prefix[:delay]``
            (``chunks`` where ``delay`` is 0).
    """

    states: np.ndarray
    accel: np.ndarray
    chunks: np.ndarray
    prefix: np.ndarray
    prefix_mask: np.ndarray
    delay: np.ndarray
    rtc_chunks: np.ndarray


def collect_demos(episodes: int, seed: int = 0, every: int = 3, jump_share: float = 0.0) -> Demos:
    """States, accelerations and the expert's chunks (plain and continuing the running plan)
    from perturbed expert episodes.

    Args:
        episodes: episodes to run.
        seed: the first episode's seed (seeds count up; the benchmark uses seeds from 0, the
            demonstrations from 10000 on, so training never sees an evaluation episode).
        every: record every ``every``-th tick.
        jump_share: the share of episodes run on ``reach-jump`` (the target jumps: the states
            where the arm is far from it and turns to meet it head on).
    """
    tasks = {"reach": make_task("reach"), "reach-jump": make_task("reach-jump")}
    planner = ReachPlanner()
    rng = np.random.default_rng(seed)
    cols: dict[str, list[Any]] = {k: [] for k in ("states", "accel", "chunks", "prefix", "prefix_mask", "delay", "rtc_chunks")}
    horizon = planner.horizon
    jumps = 0
    for ep in range(episodes):
        # Spread evenly: episode ep is a jump episode when it brings the count to its share.
        jump = math.floor((ep + 1) * jump_share) > jumps
        jumps += jump
        task = tasks["reach-jump" if jump else "reach"]
        task.reset(10_000 + seed + ep)
        chunk = None
        k = 0
        lag = 0
        hold = 0
        noise = float(rng.choice([0.0, 0.02, 0.05]))
        tick = 0
        while not task.done:  # bounded: one pass per control tick of the episode
            state = task.state()
            accel = task.extra_fields()[REACH_ACCEL_FIELD]
            if tick % every == 0:
                cols["states"].append(state)
                cols["accel"].append(accel)
                plain = planner.plan(state, accel=accel)
                cols["chunks"].append(plain)
                prefix, mask, delay = _running_prefix(chunk, k, horizon, rng)
                cols["prefix"].append(prefix)
                cols["prefix_mask"].append(mask)
                cols["delay"].append(delay)
                cols["rtc_chunks"].append(planner.plan(state, prefix, delay, accel=accel) if delay else plain)
            if chunk is None or k >= 10 + lag:
                chunk = planner.plan(state, accel=accel) if tick % every else cols["chunks"][-1]
                lag = int(rng.integers(0, 31)) if rng.random() < 0.4 else 0
                k = 0
                hold = int(rng.integers(1, 8)) if rng.random() < 0.15 else 0
            if hold > 0:
                hold -= 1
                task.step(None)
            else:
                cmd = chunk[min(k, chunk.shape[0] - 1)] + noise * rng.standard_normal(2)
                k += 1
                task.step(cmd)
            tick += 1
    for t in tasks.values():
        t.close()
    out = {k: np.stack(v) for k, v in cols.items()}
    return Demos(**{k: v if v.dtype.kind in "bi" else v.astype(np.float32) for k, v in out.items()})


#: the one-way delays (control steps) the served demonstrations cycle through.
SERVED_STEPS = tuple(range(0, 21))
#: a served chunk's ramp off the expert's (rad at its last row), drawn per episode.
SERVED_NOISE = (0.0, 0.0, 0.05, 0.1)


class _RampedServer(LocalServer):
    """A local server whose answers leave the policy's past the frozen rows by a linear ramp
    to a random offset (the robot then visits states the expert alone never reaches)."""

    def __init__(self, policy: Policy, record: Callable[[Any, Any, np.ndarray], None], rng: np.random.Generator) -> None:
        super().__init__(policy, record)
        self.rng = rng
        self.noise = 0.0

    def infer(self, observation: Any, prefix: np.ndarray | None = None, prefix_delay: int | None = None,
              obs_time: float | None = None) -> np.ndarray:
        chunk = super().infer(observation, prefix, prefix_delay, obs_time)
        if self.noise <= 0.0:
            return chunk
        h = chunk.shape[0]
        start = min(h, max(0, int(prefix_delay or 0))) if prefix is not None else 0
        ramp = np.clip((np.arange(h) - start + 1) / max(1, h - start), 0.0, 1.0)[:, None]
        return (chunk + ramp * self.noise * self.rng.standard_normal(chunk.shape[1])).astype(np.float32)


def collect_served(episodes: int, seed: int = 0, jump_share: float = 0.5) -> Demos:
    """The requests chunkline's broker (``rtc`` mode) sends the reach expert in the
    discrete-event simulation, and the expert's answers as the targets.

    Args:
        episodes: episodes to run, their one-way delays cycling through :data:`SERVED_STEPS`.
        seed: the first episode's seed is ``20000 + seed`` (apart from the benchmark's seeds
            and :func:`collect_demos`'s).
        jump_share: the share of episodes on ``reach-jump``.
    """
    tasks = {name: make_task(name, camera="synthetic") for name in ("reach", "reach-jump")}
    planner = ReachPlanner()
    rng = np.random.default_rng(seed + 1)
    cols: dict[str, list[Any]] = {k: [] for k in ("states", "accel", "chunks", "prefix", "prefix_mask", "delay", "rtc_chunks")}
    horizon = planner.horizon

    def record(batch: Any, prefix: PrefixBatch | None, actions: np.ndarray) -> None:
        state = np.asarray(batch["state"][0], dtype=np.float64)
        accel = np.asarray(batch[REACH_ACCEL_FIELD][0], dtype=np.float64)
        cols["states"].append(state)
        cols["accel"].append(accel)
        cols["chunks"].append(planner.plan(state, accel=accel))
        if prefix is None:
            cols["prefix"].append(np.zeros((horizon, 2)))
            cols["prefix_mask"].append(np.zeros(horizon, bool))
            cols["delay"].append(0)
        else:
            cols["prefix"].append(prefix.actions[0])
            cols["prefix_mask"].append(prefix.mask[0])
            cols["delay"].append(int(prefix.delay[0]))
        cols["rtc_chunks"].append(actions[0])

    server = _RampedServer(load_policy("reach-expert"), record, rng)
    jumps = 0
    try:
        for ep in range(episodes):
            jump = math.floor((ep + 1) * jump_share) > jumps
            jumps += jump
            task = tasks["reach-jump" if jump else "reach"]
            steps = SERVED_STEPS[ep % len(SERVED_STEPS)]
            server.noise = float(rng.choice(SERVED_NOISE))
            cfg = broker_config_for("rtc", task.period, task.horizon)
            run_des_episode(task, "chunkline", server, delay_conditions(RtcPlan(), 1000.0 * steps * task.period),
                            seed=20_000 + seed + ep, broker_config=cfg, infer_s=0.002)
    finally:
        for t in tasks.values():
            t.close()
    out = {k: np.stack(v) for k, v in cols.items()}
    return Demos(**{k: v if v.dtype.kind in "bi" else v.astype(np.float32) for k, v in out.items()})


def join_demos(parts: Sequence[Demos]) -> Demos:
    """The samples of every part, in order."""
    return Demos(**{f.name: np.concatenate([getattr(d, f.name) for d in parts]) for f in dataclasses.fields(Demos)})


def _running_prefix(chunk: np.ndarray | None, k: int, horizon: int,
                    rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, int]:
    """The plan running at row ``k`` of ``chunk`` as a prefix on a new chunk's grid (rows from
    ``k`` on, the last repeated past its end), its mask and a random frozen count (0 in a
    quarter of the samples, and where the plan has no rows left)."""
    prefix = np.zeros((horizon, 2), np.float32)
    mask = np.zeros(horizon, bool)
    if chunk is None or k >= chunk.shape[0]:
        return prefix, mask, 0
    rest = chunk[k:k + horizon]
    prefix[: rest.shape[0]] = rest
    prefix[rest.shape[0]:] = rest[-1]
    mask[: rest.shape[0]] = True
    delay = 0 if rng.random() < 0.25 else int(rng.integers(1, min(MAX_FROZEN, rest.shape[0]) + 1))
    return prefix, mask, delay


@dataclasses.dataclass(frozen=True)
class Trainer:
    """One learned policy's part of the driver.

    Args:
        prog: the command's name (``python -m ...``).
        description: the ``--help`` text.
        default_out: where the shipped weights are.
        epochs: the default number of passes.
        hidden: the default hidden width.
        fit: ``(demos, args) -> weights`` (``args``: the parsed command line).
        save: ``(weights, path)``: write the file.
        load: ``path -> policy`` for the evaluation.
        summary: ``weights -> text`` (parameters and the fit's figures) for the last line.
        check: ``path -> text``, run with the evaluation (``None``: nothing more), e.g. the
            flow policy's backends compared.
        episodes: the default number of demonstration episodes.
        jump_share: the default share of them on ``reach-jump``.
        served_episodes: the default number of served demonstration episodes
            (:func:`collect_served`, half on ``reach-jump``).
    """

    prog: str
    description: str
    default_out: str
    epochs: int
    hidden: int
    fit: Callable[[Demos, argparse.Namespace], Any]
    save: Callable[[Any, Path], None]
    load: Callable[[Path], Policy]
    summary: Callable[[Any], str]
    check: Callable[[Path], str] | None = None
    episodes: int = 120
    jump_share: float = 0.0
    served_episodes: int = 0


def evaluate(policy: Policy, seeds: Sequence[int], *, delays_ms: Sequence[float] = EVAL_DELAYS_MS,
             log: Any = None) -> list[dict[str, Any]]:
    """Closed-loop figures of ``policy`` on ``reach``: one row per (delay, merge mode).

    Args:
        policy: a reach policy.
        seeds: episode seeds.
        delays_ms: one-way delays.
        log: a stream for progress lines, or ``None``.
    """
    modes = ("replace", "rtc") if policy.accepts_prefix else ("replace",)
    task = make_task("reach", camera="synthetic")
    server = LocalServer(policy)
    rows = []
    try:
        for delay in delays_ms:
            cond = delay_conditions(RtcPlan(), delay)
            for mode in modes:
                cfg = broker_config_for(mode, task.period, task.horizon)
                results = [run_des_episode(task, "chunkline", server, cond, seed=s, broker_config=cfg, infer_s=0.002)
                           for s in seeds]
                row = {"delay_ms": float(delay), "merge": mode, **summarise(results, task.tolerance_m)}
                rows.append(row)
                if log is not None:
                    print(f"{delay:g} ms {mode}: {100 * row['success_rate']:.0f}% {row['error_mm']:.1f} mm", file=log, flush=True)
    finally:
        task.close()
    return rows


def eval_table(rows: Sequence[dict[str, Any]], title: str) -> str:
    """The evaluation's rows as a table."""
    cols = [Column("delay ms", "delay_ms", ".0f"), Column("merge", "merge", align="<"),
            Column("success %", lambda r: 100 * r["success_rate"], ".0f"), Column("error mm", "error_mm", ".1f"),
            Column("interv/ep", "interventions_per_episode", ".1f"), Column("viol/ep", "violations_per_episode", ".1f"),
            Column("diverging", "diverging", "d"), Column("switch step rad", "switch_jump_rad", ".3f"),
            Column("switch acc jump", "switch_accel_jump", ".1f")]
    return format_table(rows, cols, title=title)


def main(trainer: Trainer, argv: list[str] | None = None) -> int:
    """Parse the command line; collect, train and save (unless ``--eval-only``); evaluate when
    asked. Prints a summary (and the evaluation's table) on stdout, progress on stderr."""
    p = argparse.ArgumentParser(prog=trainer.prog, description=trainer.description)
    p.add_argument("--episodes", type=int, default=trainer.episodes, help="demonstration episodes")
    p.add_argument("--epochs", type=int, default=trainer.epochs)
    p.add_argument("--hidden", type=int, default=trainer.hidden, help="hidden layers' width")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--served-episodes", type=int, default=trainer.served_episodes,
                   help="served demonstration episodes (the expert answering the broker under delay)")
    p.add_argument("--jump-share", type=float, default=trainer.jump_share, help="share of demonstration episodes on reach-jump")
    p.add_argument("--out", type=Path, default=Path(trainer.default_out), help="the weights file (read by --eval-only)")
    p.add_argument("--eval", action="store_true", help="evaluate in closed loop after training")
    p.add_argument("--eval-only", action="store_true", help="evaluate the file at --out; no training")
    p.add_argument("--eval-seeds", type=int, default=5, help="episodes per evaluation point")
    p.add_argument("--reference", action="append", default=[], metavar="POLICY",
                   help="also evaluate this registered policy (e.g. reach-expert, reach-bc), under the same conditions")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (training and evaluation); these networks are small: one is fastest on a shared "
                        "machine (measured: 20 epochs of train_flow in 47 s on two threads, 150 in 29 s on one, on a "
                        "loaded 2-core machine)")
    args = p.parse_args(argv)
    if importlib.util.find_spec("torch") is not None:  # training needs it; evaluation may not
        import torch

        torch.set_num_threads(max(1, args.threads))
    if not args.eval_only:
        t = time.perf_counter()
        demos = collect_demos(args.episodes, args.seed, jump_share=args.jump_share)
        print(f"collected {len(demos.states)} samples from {args.episodes} episodes in {time.perf_counter() - t:.1f} s", file=sys.stderr)
        if args.served_episodes > 0:
            t = time.perf_counter()
            served = collect_served(args.served_episodes, args.seed)
            print(f"collected {len(served.states)} served samples from {args.served_episodes} episodes in "
                  f"{time.perf_counter() - t:.1f} s", file=sys.stderr)
            demos = join_demos([demos, served])
        t = time.perf_counter()
        weights = trainer.fit(demos, args)
        trainer.save(weights, args.out)
        size = args.out.stat().st_size
        print(f"trained in {time.perf_counter() - t:.1f} s (episodes {args.episodes}, horizon {TASK_HORIZON}): "
              f"{trainer.summary(weights)}, {size / 1024:.0f} kB -> {args.out}")
    if args.eval or args.eval_only:
        policy = trainer.load(args.out)
        t = time.perf_counter()
        rows = evaluate(policy, range(args.eval_seeds), log=sys.stderr)
        print(eval_table(rows, f"{policy.name} ({args.out.name}) on reach, {args.eval_seeds} seeds per point, "
                               f"{time.perf_counter() - t:.0f} s"))
        for ref in args.reference:
            other = load_policy(ref)
            print(eval_table(evaluate(other, range(args.eval_seeds)), f"{other.name} (reference), {args.eval_seeds} seeds per point"))
        if trainer.check is not None:
            print(trainer.check(args.out))
    return 0
