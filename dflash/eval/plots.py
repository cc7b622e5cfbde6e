"""Plots of an eval summary: per-position acceptance (survival curve of draft positions) and committed lengths."""

from __future__ import annotations

from typing import Any

from dflash.run_files import atomic_path


def plot_per_position(summary: dict[str, Any], path: str) -> str:
    """Write a PNG of per-position acceptance for every prompt set and "overall"; returns `path`.

    Uses the Agg canvas directly (no pyplot) so it never touches a display or the global backend.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.5), dpi=120)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    series = {**summary["prompt_sets"], "overall": summary["overall"]}
    for name, metrics in series.items():
        points = [(k, v) for k, v in enumerate(metrics["per_position"], start=1) if v is not None]
        if not points:
            continue
        tau = metrics["tau"]
        label = f"{name} (tau {tau:.2f})" if tau is not None else name
        style = {"color": "black", "linewidth": 2.5} if name == "overall" else {"marker": "o", "markersize": 3}
        axes.plot([k for k, _ in points], [v for _, v in points], label=label, **style)
    block_size = summary["block_size"]
    axes.set_xlim(0.5, block_size - 0.5)
    axes.set_ylim(-0.02, 1.02)
    axes.set_xticks(range(1, block_size))
    axes.set_xlabel("draft position k in the block")
    axes.set_ylabel("fraction of steps with draft k accepted")
    axes.set_title(per_position_title(summary))
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    return save_figure(figure, path)


def per_position_title(summary: dict[str, Any]) -> str:
    """The per-position plot's title: how the summary was measured (greedy replay, live at some temperature, and at
    T > 0 which drafts were verified)."""
    mode, temperature = summary.get("mode", "replay"), summary.get("temperature", 0.0)
    sampling = "greedy" if temperature == 0 else f"T={temperature}"
    if temperature:  # which drafts were verified (and at what temperature sampled ones were drawn)
        drafts = summary.get("draft_sampling", "sampled")  # the only rule before summaries recorded it
        sampling += f", {drafts} drafts"
        if summary.get("draft_temperature") is not None:
            sampling += f" at {summary['draft_temperature']}"
    if "estimate" in summary:  # replay at T > 0: expected acceptance, not a sampled decode
        sampling = f"estimate at {sampling}"
    return f"Acceptance per position, {mode} {sampling} (block size {summary['block_size']})"


def plot_committed_histogram(summary: dict[str, Any], path: str) -> str:
    """Write a PNG of the committed-length histogram (fraction of steps per length 1..B), one bar group per prompt
    set and "overall"; returns `path`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.5), dpi=120)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    series = {**summary["prompt_sets"], "overall": summary["overall"]}
    block_size = summary["block_size"]
    width = 0.8 / len(series)
    for i, (name, metrics) in enumerate(series.items()):
        counts = metrics["committed_histogram"][1:]
        total = sum(counts)
        if not total:
            continue
        offsets = [n + (i - (len(series) - 1) / 2) * width for n in range(1, block_size + 1)]
        axes.bar(offsets, [c / total for c in counts], width=width, label=name)
    axes.set_xticks(range(1, block_size + 1))
    axes.set_xlabel("tokens committed by a verify step (bonus included)")
    axes.set_ylabel("fraction of steps")
    axes.set_title(f"Committed lengths (block size {block_size})")
    axes.grid(alpha=0.3, axis="y")
    axes.legend(fontsize=8)
    return save_figure(figure, path)


def save_figure(figure, path: str) -> str:
    """Write `figure` as a PNG through a temporary file, so a reader never sees half an image; returns `path`."""
    figure.tight_layout()
    with atomic_path(path) as temp:
        figure.savefig(temp, format="png")
    return path
