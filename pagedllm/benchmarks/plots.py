"""PNG plots of the benchmarks: throughput against other engines, the memory picture, latency CDFs, embedding
throughput by batch size.

Figures are drawn on matplotlib's Agg canvas directly, without pyplot: no global figure state, no
display needed, and nothing to close afterwards. Sizes are fixed (no tight bounding box) so every
PNG of one kind has the same pixel size and the docs lay out the same way from run to run.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

DPI = 100
WIDE = (8.0, 4.5)  # inches: one panel
DOUBLE = (10.0, 4.0)  # inches: two panels side by side
FEATURED_PAGED = "paged-16"  # the engine's default block size


class MemoryResult(Protocol):
    """What the memory plots read of one allocator's replay (`pagedllm.benchmarks.memory`)."""

    allocator: str
    utilization: Sequence[float]
    concurrency: Sequence[int]

    @property
    def mean_utilization(self) -> float: ...


def plot_throughput(rows: list[dict], path: Path) -> None:
    """Output and total tok/s per engine, each bar annotated with its ratio to the first row (pagedllm)."""
    figure = _figure(WIDE)
    ax = figure.subplots()
    x = np.arange(len(rows))
    width = 0.38
    for offset, key, label in (
        (-width / 2, "output_tok_per_s", "output tok/s"),
        (width / 2, "total_tok_per_s", "total tok/s"),
    ):
        values = [row[key] for row in rows]
        bars = ax.bar(x + offset, values, width, label=label)
        ax.bar_label(bars, labels=[f"{v / values[0]:.2f}x" if values[0] else "" for v in values], fontsize=8)
    ax.set_xticks(x, [f"{row['engine']}\n{row['requests_per_s']:.2f} req/s" for row in rows])
    ax.set_ylabel("tokens / s")
    ax.set_title(f"Throughput (ratios to {rows[0]['engine']})")
    ax.legend()
    _save(figure, path)


def plot_memory(results: list[MemoryResult], out_dir: Path) -> list[Path]:
    """`memory_utilization.png` (η per step) and `memory_concurrency.png` (requests held per step): the
    paged allocator at the default block size against every contiguous one."""
    shown = [r for r in results if not r.allocator.startswith("paged-")] + [_featured_paged(results)]
    paths = [out_dir / "memory_utilization.png", out_dir / "memory_concurrency.png"]
    for path, series, ylabel in zip(
        paths, ("utilization", "concurrency"), ("η (slots holding state)", "requests held"), strict=True
    ):
        figure = _figure(WIDE)
        ax = figure.subplots()
        for result in shown:
            ax.plot(getattr(result, series), label=f"{result.allocator} (mean η {result.mean_utilization:.1%})")
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)  # from zero, so the gap between allocators reads at its true size
        ax.legend(fontsize=8)
        _save(figure, path)
    return paths


def plot_latency_cdfs(ttft_s: list[float], tpot_s: list[float], path: Path) -> None:
    """Empirical CDFs of time to first token and time per output token, in milliseconds."""
    figure = _figure(DOUBLE)
    left, right = figure.subplots(1, 2)
    _cdf(left, ttft_s, "time to first token (ms)")
    _cdf(right, tpot_s, "time per output token (ms)")
    _save(figure, path)


def _featured_paged(results: list[MemoryResult]) -> MemoryResult:
    paged = [r for r in results if r.allocator.startswith("paged-")]
    return next((r for r in paged if r.allocator == FEATURED_PAGED), paged[0])


def _cdf(ax: Axes, seconds: list[float], xlabel: str) -> None:
    ms = np.sort(np.asarray(seconds, dtype=float)) * 1000
    ax.step(ms, np.arange(1, len(ms) + 1) / max(len(ms), 1), where="post")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)


def _figure(size: tuple[float, float]) -> Figure:
    figure = Figure(figsize=size, dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _save(figure: Figure, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=DPI)


def plot_embed_throughput(
    batch_sizes: Sequence[int], sentences_per_s: dict[str, Sequence[float]], path: Path, title: str
) -> None:
    """Sentences/s against batch size (log scale, a tick at each size measured), one line per engine."""
    figure = _figure(WIDE)
    ax = figure.subplots()
    for engine, values in sentences_per_s.items():
        ax.plot(batch_sizes, values, marker="o", label=engine)
    ax.set_xscale("log", base=2)
    ax.set_xticks(batch_sizes, [str(size) for size in batch_sizes])
    ax.minorticks_off()
    ax.set_xlabel("batch size")
    ax.set_ylabel("sentences / s")
    ax.set_ylim(bottom=0)  # from zero, so the gap between engines reads at its true size
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    _save(figure, path)
