"""PNG plots of benchmark results (matplotlib, ``Agg`` backend: no display needed).

Each function takes plain data (summaries as dicts, latencies in seconds), writes one PNG and
returns its path. matplotlib is imported on first use, so importing this module is cheap.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "plot_latency_cdf",
    "plot_latency_vs_load",
    "plot_goodput_vs_load",
    "plot_resources_vs_load",
    "plot_stage_breakdown",
    "plot_service_curve",
    "plot_bars",
]


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)  # files only; never try to open a window
    import matplotlib.pyplot as plt

    return plt


def _plain_log_ticks(fig: Any) -> None:
    """Log-scaled axes labelled with plain numbers (60, 0.01), not matplotlib's 6x10^1."""
    from matplotlib.ticker import LogFormatter

    class Plain(LogFormatter):  # which ticks get a label stays matplotlib's choice; only the text changes
        def _num_to_string(self, x: float, vmin: float, vmax: float) -> str:
            return f"{x:g}"

    for ax in fig.axes:
        for axis, scale in ((ax.xaxis, ax.get_xscale()), (ax.yaxis, ax.get_yscale())):
            if scale in ("log", "symlog"):
                axis.set_major_formatter(Plain(labelOnlyBase=False))
                axis.set_minor_formatter(Plain(labelOnlyBase=False))


def _save(fig: Any, path: Path | str) -> Path:
    path = Path(path)
    _plain_log_ticks(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


def _finite(values: Sequence[float]) -> np.ndarray:
    a = np.asarray([v for v in values if v is not None], dtype=float)
    return a[np.isfinite(a)]


def _nan(v: Any) -> float:
    return math.nan if v is None else float(v)


def plot_latency_cdf(series: Mapping[str, Sequence[float]], path: Path | str, *, title: str = "latency CDF",
                     deadline_ms: float | None = None, xlabel: str = "latency (ms)") -> Path:
    """Empirical CDF of each series (seconds), log-scaled tail view.

    Args:
        series: label to latencies in seconds.
        path: the PNG to write.
        title: the plot's title.
        deadline_ms: draw the deadline as a vertical line.
        xlabel: the x axis label.
    """
    plt = _plt()
    fig, (ax, tail) = plt.subplots(1, 2, figsize=(11, 4))
    for label, values in series.items():
        ms = np.sort(_finite(values)) * 1000.0
        if ms.size == 0:
            continue
        p = np.arange(1, ms.size + 1) / ms.size
        ax.plot(ms, p, label=f"{label} (n={ms.size})")
        # Tail: the fraction at least this slow, on a log axis (p99 and p99.9 apart); it ends at
        # the maximum, 1/n, marked.
        (line,) = tail.plot(ms, 1.0 - p + 1.0 / ms.size, label=label)
        tail.plot(ms[-1:], [1.0 / ms.size], "v", color=line.get_color(), markersize=5)
        tail.annotate(f"max {ms[-1]:.1f}", (ms[-1], 1.0 / ms.size), textcoords="offset points", xytext=(-4, 6),
                      ha="right", fontsize=7, color=line.get_color())
    for a in (ax, tail):
        if deadline_ms is not None:
            a.axvline(deadline_ms, color="red", linestyle="--", linewidth=1, label="deadline")
        a.set_xlabel(xlabel)
        a.grid(True, alpha=0.3)
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    tail.set_yscale("log")
    tail.set_ylabel("fraction at least this slow")
    tail.set_title("tail")
    ax.legend(fontsize=8)
    return _save(fig, path)


def _by_label(steps: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    out: dict[str, list[Mapping[str, Any]]] = {}
    for s in steps:
        out.setdefault(str(s["label"]), []).append(s)
    for rows in out.values():
        rows.sort(key=lambda s: _nan(s["offered_rate"]))
    return out


def plot_latency_vs_load(steps: Sequence[Mapping[str, Any]], path: Path | str, *,
                         deadline_ms: float | None = None) -> Path:
    """p50 and p99 latency of completed requests against offered load, one colour per configuration:
    client-side (the load generator's scheduled send to the reply) and, where the steps carry it,
    server-side (``server_ms``: the frame's arrival to the reply written) p50.

    Args:
        steps: step summaries (``StepSummary.as_dict()``; latencies in seconds).
        path: the PNG to write.
        deadline_ms: draw the deadline.
    """
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, rows in _by_label(steps).items():
        x = [_nan(s["offered_rate"]) for s in rows]
        color = None
        for q, style in (("p50", "-o"), ("p99", "--s")):
            y = [_nan(s["latency"][q]) * 1000.0 for s in rows]
            (line,) = ax.plot(x, y, style, label=f"{label} client-side {q}", markersize=4, color=color)
            color = line.get_color()  # one colour per configuration
        server = [_nan((s.get("server_latency") or {}).get("p50")) * 1000.0 for s in rows]
        if np.isfinite(server).any():
            ax.plot(x, server, ":^", label=f"{label} server-side p50", markersize=4, color=color)
    if deadline_ms is not None:
        ax.axhline(deadline_ms, color="red", linestyle=":", linewidth=1, label="deadline")
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_yscale("log")
    ax.set_title("latency vs offered load (client-side: scheduled send to reply)")
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_goodput_vs_load(steps: Sequence[Mapping[str, Any]], path: Path | str) -> Path:
    """Goodput (in-deadline chunks/s) and refusals against offered load, with the ideal ``y = x``.

    Args:
        steps: step summaries (``StepSummary.as_dict()``).
        path: the PNG to write.
    """
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    top = 0.0
    for label, rows in _by_label(steps).items():
        x = [_nan(s["offered_rate"]) for s in rows]
        (line,) = ax.plot(x, [_nan(s["goodput"]) for s in rows], "-o", markersize=4, label=f"{label} goodput")
        refused = [sum((s.get("refused") or {}).values()) / _nan(s["duration"]) for s in rows]
        ax.plot(x, refused, ":x", markersize=4, label=f"{label} refused/s", color=line.get_color())
        top = max([top, *x])
    ax.plot([0, top], [0, top], color="grey", linewidth=0.8, label="ideal")
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("requests/s")
    ax.set_title("goodput vs offered load")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_resources_vs_load(steps: Sequence[Mapping[str, Any]], path: Path | str) -> Path:
    """Server CPU, peak memory and mean batch size against offered load.

    Args:
        steps: step summaries (``StepSummary.as_dict()``).
        path: the PNG to write.
    """
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for label, rows in _by_label(steps).items():
        x = [_nan(s["offered_rate"]) for s in rows]
        for ax, key in zip(axes, ("server_cpu_percent", "server_rss_mb", "mean_batch_size"), strict=False):
            ax.plot(x, [_nan(s.get(key)) for s in rows], "-o", markersize=4, label=label)
    for ax, title in zip(axes, ("server CPU (% of one core)", "server memory (MiB, peak)", "mean batch size"), strict=False):
        ax.set_title(title)
        ax.set_xlabel("offered load (requests/s)")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    return _save(fig, path)


def plot_stage_breakdown(stages: Mapping[str, Mapping[str, Mapping[str, float]]], path: Path | str, *,
                         order: Sequence[str] | None = None) -> Path:
    """Stacked bars of per-stage p50 and mean (ms), one bar per configuration, and per-stage p99.

    Args:
        stages: label to stage to ``{"p50", "p95", "p99", "mean"}`` in milliseconds.
        path: the PNG to write.
        order: stage order (bottom to top); default: as in the first label.
    """
    plt = _plt()
    labels = list(stages)
    names = list(order) if order is not None else list(next(iter(stages.values()), {}))
    names = [n for n in names if any(n in stages[lab] for lab in labels)]
    fig, (ax, ax99) = plt.subplots(1, 2, figsize=(12, 4.8))
    cmap = plt.get_cmap("tab20")
    bars = [(lab, stat) for lab in labels for stat in ("p50", "mean")]
    x = np.arange(len(bars))
    bottom = np.zeros(len(bars))
    for i, name in enumerate(names):
        # A stage whose p50 is negative (clock granularity, overlapping estimates) stacks as 0.
        h = np.array([max(0.0, _nan(stages[lab].get(name, {}).get(stat))) if name in stages[lab] else 0.0
                      for lab, stat in bars])
        h = np.nan_to_num(h)
        ax.bar(x, h, bottom=bottom, color=cmap(i % 20), label=name)
        bottom += h
    ax.set_xticks(x, [f"{lab}\n{stat}" for lab, stat in bars], fontsize=8)
    ax.set_ylabel("ms")
    ax.set_title("where the time goes (stacked per stage)")
    handles, names_ = ax.get_legend_handles_labels()
    # Legend top to bottom in the order the segments stack, top to bottom.
    ax.legend(handles[::-1], names_[::-1], fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    width = 0.8 / max(1, len(labels))
    y = np.arange(len(names))
    for j, lab in enumerate(labels):
        v = [_nan(stages[lab].get(n, {}).get("p99")) for n in names]
        ax99.barh(y + j * width, np.nan_to_num(v), height=width, label=lab)
    ax99.set_yticks(y + width * (len(labels) - 1) / 2, names, fontsize=8)
    ax99.invert_yaxis()
    ax99.set_xscale("symlog", linthresh=0.1)
    ax99.set_xlabel("p99 (ms)")
    ax99.set_title("p99 per stage")
    ax99.grid(True, alpha=0.3, axis="x")
    ax99.legend(fontsize=8)
    return _save(fig, path)


def plot_service_curve(points: Sequence[Mapping[str, Any]], path: Path | str, *, chosen: int | None = None,
                       deadline_ms: float | None = None) -> Path:
    """Batch service time and throughput against batch size.

    Args:
        points: ``{"batch_size", "seconds"}`` (median per batch), optionally ``"p90"``.
        path: the PNG to write.
        chosen: mark this batch size.
        deadline_ms: draw half the deadline on the service-time axis (the batch limit the
            planner uses).
    """
    plt = _plt()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    b = np.array([p["batch_size"] for p in points], dtype=float)
    s = np.array([_nan(p["seconds"]) for p in points]) * 1000.0
    ax.plot(b, s, "-o", label="median")
    if all("p90" in p for p in points):
        ax.plot(b, np.array([_nan(p["p90"]) for p in points]) * 1000.0, ":", label="p90")
    if deadline_ms is not None:
        ax.axhline(deadline_ms / 2, color="red", linestyle="--", linewidth=1, label="deadline / 2")
    ax.set_xlabel("batch size")
    ax.set_ylabel("service time per batch (ms)")
    ax.set_title("service curve")
    ax2.plot(b, b / (s / 1000.0), "-o")
    ax2.set_xlabel("batch size")
    ax2.set_ylabel("requests/s per replica (at 100% busy)")
    ax2.set_title("throughput")
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        a.grid(True, alpha=0.3)
        if chosen is not None:
            a.axvline(chosen, color="green", linestyle=":", linewidth=1, label=f"chosen b={chosen}")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_bars(values: Mapping[str, Mapping[str, float]], path: Path | str, *, title: str, ylabel: str,
              scale: float = 1.0) -> Path:
    """Grouped bars: one group per outer key, one bar per inner key (e.g. p50/p99).

    Args:
        values: group to series to value.
        path: the PNG to write.
        title: the plot's title.
        ylabel: the y axis label.
        scale: multiply values by this (seconds to ms: 1000).
    """
    plt = _plt()
    groups = list(values)
    series = list(dict.fromkeys(k for g in groups for k in values[g]))
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(groups)), 4))
    width = 0.8 / max(1, len(series))
    x = np.arange(len(groups))
    for i, name in enumerate(series):
        ax.bar(x + i * width, [_nan(values[g].get(name)) * scale for g in groups], width, label=name)
    ax.set_xticks(x + width * (len(series) - 1) / 2, groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    return _save(fig, path)
