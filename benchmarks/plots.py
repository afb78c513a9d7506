"""PNG plots for the pages of docs/benchmarks/ (and docs/reliability.md): drawn off-screen, one function per figure."""

from __future__ import annotations

import statistics
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on a server
import matplotlib.pyplot as plt  # after choosing the backend


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def throughput_vs_adapters(series: Mapping[str, Mapping[int, Sequence[float]]], path: Path, subtitle: str) -> None:
    """Output tokens/s against the number of distinct adapters (0 = base model): median, min-max bars.
    A series with only the base point is drawn as a horizontal line."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    xs_all = sorted({x for points in series.values() for x in points})
    for label, points in series.items():
        xs = sorted(points)
        medians = [statistics.median(points[x]) for x in xs]
        if xs == [0] and len(xs_all) > 1:
            ax.axhline(medians[0], linestyle="--", linewidth=1, color="gray", label=f"{label} (base)")
            continue
        low = [m - min(points[x]) for m, x in zip(medians, xs, strict=True)]
        high = [max(points[x]) - m for m, x in zip(medians, xs, strict=True)]
        ax.errorbar(xs, medians, yerr=[low, high], marker="o", capsize=3, label=label)
    ax.set_xscale("symlog", linthresh=1)
    ax.set_xticks(xs_all, [("base" if x == 0 else str(x)) for x in xs_all])
    ax.set_xlabel("distinct adapters in the batch")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Throughput vs number of adapters\n{subtitle}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)


def goodput_vs_rate(series: Mapping[str, Mapping[float, float]], path: Path, subtitle: str) -> None:
    """Goodput (requests/s meeting the SLO) against the offered request rate, one line per system."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    top = max((r for points in series.values() for r in points), default=1.0)
    ax.plot([0, top], [0, top], linestyle=":", color="gray", linewidth=1, label="every request within the SLO")
    for label, points in series.items():
        rates = sorted(points)
        ax.plot(rates, [points[r] for r in rates], marker="o", label=label)
    ax.set_xlabel("offered rate (requests/s)")
    ax.set_ylabel("goodput (requests/s within the SLO)")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.set_title(f"Goodput vs request rate\n{subtitle}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)


def latency_cdfs(series: Mapping[str, Mapping[str, Sequence[float]]], path: Path, subtitle: str) -> None:
    """Empirical CDFs, one panel per metric (e.g. TTFT, TPOT), one line per system; seconds -> ms."""
    metrics = sorted({m for values in series.values() for m in values})
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 3.8), squeeze=False)
    for ax, metric in zip(axes[0], metrics, strict=True):
        for label, values in series.items():
            data = sorted(v * 1e3 for v in values.get(metric, []))
            if data:
                ax.step(data, [(i + 1) / len(data) for i in range(len(data))], where="post", label=label)
        ax.set_xlabel(f"{metric.upper()} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Latency distributions\n{subtitle}", fontsize=10)
    _save(fig, path)


def memory_over_time(samples: Sequence[tuple[float, float]], path: Path, subtitle: str) -> None:
    """Resident memory (MiB) against minutes since the start, from (seconds, bytes) samples."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot([t / 60 for t, _ in samples], [b / 2**20 for _, b in samples], linewidth=1.2)
    ax.set_xlabel("minutes")
    ax.set_ylabel("server RSS (MiB)")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.set_title(f"Server memory during the soak run\n{textwrap.fill(subtitle, 90)}", fontsize=9)
    ax.grid(alpha=0.3)
    _save(fig, path)


def bars_by_label(panels: Mapping[str, Mapping[str, float]], path: Path, subtitle: str) -> None:
    """One bar chart per panel title (its y label), the same labels on every x axis."""
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6))
    for ax, (title, values) in zip(axes, panels.items(), strict=True):
        ax.bar(list(values), list(values.values()), color="#4c72b0")
        ax.set_title(textwrap.fill(title, 32), fontsize=9)
        ax.tick_params(axis="x", labelsize=7, labelrotation=30)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(subtitle, fontsize=9)
    _save(fig, path)
