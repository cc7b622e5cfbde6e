"""The training curve of a run as a PNG: loss, and the acceptance length (estimated and held-out) per step."""

from __future__ import annotations

import os

from dflash.eval.plots import save_figure
from dflash.train.metrics_log import read_records


def plot_training_curve(metrics_path: str, png_path: str) -> str:
    """Left: training loss per step. Right: tau per step, the held-out replay where evaluated (heldout/tau) and the
    estimate from the training accuracies (accept_len_est). Returns png_path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = read_records(metrics_path)
    if not records:
        raise ValueError(f"{metrics_path} holds no training records")
    figure = Figure(figsize=(11, 4), dpi=120)
    FigureCanvasAgg(figure)
    loss_axes, tau_axes = figure.subplots(1, 2)
    steps = [r["step"] for r in records]
    loss_axes.plot(steps, [r["loss"] for r in records], linewidth=0.8)
    loss_axes.set_xlabel("optimizer step")
    loss_axes.set_ylabel("weighted block cross-entropy")
    loss_axes.set_yscale("log")  # the first steps of a fresh drafter sit an order of magnitude above the rest
    loss_axes.set_title("training loss")
    estimated = [(r["step"], r["accept_len_est"]) for r in records if "accept_len_est" in r]
    if estimated:
        tau_axes.plot(*zip(*estimated), linewidth=0.8, alpha=0.6, label="estimate from training accuracy")
    held = [(r["step"], r["heldout/tau"]) for r in records if "heldout/tau" in r]
    if held:
        tau_axes.plot(*zip(*held), marker="o", color="black", label="held-out replay (T=0)")
    tau_axes.set_xlabel("optimizer step")
    tau_axes.set_ylabel("tau (tokens per target forward)")
    tau_axes.set_title("acceptance length")
    tau_axes.legend(fontsize=8)
    for axes in (loss_axes, tau_axes):
        axes.grid(alpha=0.3)
    os.makedirs(os.path.dirname(os.path.abspath(png_path)), exist_ok=True)
    return save_figure(figure, png_path)
