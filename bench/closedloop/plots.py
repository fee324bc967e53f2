"""Plots of the closed-loop benchmark: success against delay, and one episode through an outage."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..plots import _plt, _save
from .metrics import EpisodeResult

__all__ = ["plot_success_vs_delay", "plot_outage_timeline", "STRATEGY_COLOURS"]

STRATEGY_COLOURS = {"sync": "tab:red", "index": "tab:orange", "chunkline": "tab:blue"}
_SOURCE_COLOURS = {"fallback": "tab:purple", "hold": "tab:gray", "resuming": "tab:cyan"}


def plot_success_vs_delay(rows: Sequence[Mapping[str, Any]], path: Path | str, *, title: str) -> Path:
    """Success rate, mean score and stale actions per episode against one-way delay, per strategy.

    Args:
        rows: aggregated rows with ``strategy``, ``delay_ms``, ``success_rate``, ``score_mean``,
            ``stale_per_episode``.
        path: the PNG to write.
        title: the figure's title.
    """
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        pts = sorted((r for r in rows if r["strategy"] == strategy), key=lambda r: r["delay_ms"])
        x = [r["delay_ms"] for r in pts]
        c = STRATEGY_COLOURS.get(strategy)
        axes[0].plot(x, [100 * r["success_rate"] for r in pts], "o-", color=c, label=strategy)
        axes[1].plot(x, [1000 * r["score_mean"] for r in pts], "o-", color=c, label=strategy)
        axes[2].plot(x, [r["stale_per_episode"] for r in pts], "o-", color=c, label=strategy)
    axes[0].set_ylabel("success (%)")
    axes[0].set_ylim(-5, 105)
    axes[1].set_ylabel("mean tracking error (mm)")
    axes[1].set_yscale("log")
    axes[2].set_ylabel("stale actions executed / episode")
    for ax in axes:
        ax.set_xlabel("one-way delay (ms)")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    return _save(fig, path)


def plot_outage_timeline(results: Sequence[EpisodeResult], outage: tuple[float, float] | None, path: Path | str, *,
                         title: str, tolerance_m: float | None = None) -> Path:
    """One episode per strategy through an outage: tracking error over time, with the ticks on
    the fallback or without a command shaded and the stale actions marked.

    Args:
        results: episodes with timelines (one per strategy).
        outage: ``(start, end)`` in episode seconds, or ``None``.
        path: the PNG to write.
        title: the figure's title.
        tolerance_m: the task's success tolerance (drawn as a line).
    """
    plt = _plt()
    fig, axes = plt.subplots(len(results), 1, figsize=(11, 2.4 * len(results)), sharex=True, squeeze=False)
    for ax, r in zip(axes[:, 0], results, strict=False):
        tl = r.timeline or {}
        t = np.asarray(tl.get("t", []), dtype=float)
        err = 1000 * np.asarray(tl.get("error", []), dtype=float)
        if outage is not None:
            ax.axvspan(outage[0], outage[1], color="tab:red", alpha=0.12, label="outage")
        src = np.asarray(tl.get("source", []))
        dt = r.period_s
        for name, colour in _SOURCE_COLOURS.items():
            mask = src == name
            for i in np.flatnonzero(mask):
                ax.axvspan(t[i], t[i] + dt, color=colour, alpha=0.25, lw=0)
            if mask.any():
                ax.plot([], [], color=colour, alpha=0.5, lw=6, label=name)
        ax.plot(t, err, color=STRATEGY_COLOURS.get(r.strategy, "k"), lw=1.2, label="error")
        stale = np.asarray(tl.get("stale", []), dtype=bool)
        if stale.any():
            ax.plot(t[stale], err[stale], "x", color="k", ms=3, label="stale action")
        viol = np.asarray(tl.get("violation", []), dtype=bool)
        if viol.any():
            ax.plot(t[viol], np.zeros(int(viol.sum())), "|", color="tab:red", ms=8, label="limit violation")
        if tolerance_m is not None:
            ax.axhline(1000 * tolerance_m, color="k", ls=":", lw=0.8)
        ax.set_ylabel(f"{r.strategy}\nerror (mm)")
        ax.set_yscale("symlog", linthresh=10)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper right", ncol=3)
    axes[-1, 0].set_xlabel("episode time (s)")
    fig.suptitle(title)
    return _save(fig, path)
