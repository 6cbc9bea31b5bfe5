"""PNG plots beside the benchmarks' tables, written only when a script is given `--plot`.

matplotlib is imported on the first plot (the `bench` extra installs it), so a benchmark
without `--plot` never needs it. Every plot is a small, plain figure: lines for sweeps
(throughput against concurrency), grouped bars for side-by-side figures (RSS per mode).
"""

from __future__ import annotations

import argparse
import os

PLOTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plots")


def add_plot_flag(ap: argparse.ArgumentParser, name: str) -> None:
    """`--plot` writes benchmarks/plots/<name>.png; `--plot PATH` writes PATH."""
    ap.add_argument("--plot", nargs="?", const=os.path.join(PLOTS, f"{name}.png"), default=None,
                    metavar="PNG", help=f"also write a PNG plot (default path: plots/{name}.png)")


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib: pip install -e '.[bench]'") from e
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path: str, caption: str | None) -> str:
    if caption:
        fig.text(0.01, 0.01, caption, fontsize=7, color="0.35", ha="left", va="bottom")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")
    return path


def line_panels(path: str, title: str, xlabel: str,
                panels: list[tuple[str, dict[str, tuple[list[float], list[float]]]]],
                caption: str | None = None, log_x: bool = False) -> str:
    """One row of panels that share the x axis; each panel is (y label, {series: (xs, ys)})."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.0), squeeze=False)
    for ax, (ylabel, series) in zip(axes[0], panels):
        for label, (xs, ys) in series.items():
            ax.plot(xs, ys, marker="o" if len(xs) <= 32 else None, label=label)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if log_x:
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted({x for xs, _ in series.values() for x in xs}))
            ax.get_xaxis().set_major_formatter(plt.ScalarFormatter())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.04 if caption else 0, 1, 1))
    return _save(fig, path, caption)


def grouped_bars(path: str, title: str, ylabel: str, groups: list[str],
                 series: dict[str, list[float]], caption: str | None = None) -> str:
    """Bars per group (x), one colour per series; values printed on the bars."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(groups) * max(1, len(series))), 4.0))
    width = 0.8 / max(1, len(series))
    for i, (label, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        bars = ax.bar(xs, values, width, label=label)
        ax.bar_label(bars, fmt="{:.3g}", fontsize=7)
    ax.set_xticks(range(len(groups)), groups, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.04 if caption else 0, 1, 1))
    return _save(fig, path, caption)
