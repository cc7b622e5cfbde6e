"""Evaluate a drafter against its target: greedy acceptance per prompt set, by exact replay (replay.py).

Summary schema (summary.json, schema_version 1):
    {"schema_version": 1, "block_size": B, "max_new_tokens": N,
     "prompt_sets": {name: metrics}, "overall": metrics}
where metrics = acceptance_metrics(...) (tau, tau_prompt_mean, acceptance_rate, per_position,
committed_histogram, num_prompts, num_steps, num_tokens, num_accepted, num_drafted) plus greedy_mismatches.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from dflash.eval.metrics import acceptance_metrics
from dflash.eval.plots import plot_per_position
from dflash.eval.replay import replay
from dflash.models.drafter import DFlashDraftModel

SCHEMA_VERSION = 1


def check_compatible(drafter: DFlashDraftModel, adapter) -> None:
    """Raise ValueError when the drafter was not built for this target (hidden size, taps, mask id)."""
    config = drafter.config
    if config.hidden_size != adapter.hidden_size:
        raise ValueError(f"drafter hidden_size {config.hidden_size} != target hidden_size {adapter.hidden_size}")
    if config.num_target_layers != adapter.num_layers:
        raise ValueError(
            f"drafter was built for a target with {config.num_target_layers} layers, this target has "
            f"{adapter.num_layers}"
        )
    if not 0 <= config.mask_token_id < adapter.vocab_size:
        raise ValueError(
            f"drafter mask_token_id {config.mask_token_id} is outside the target vocabulary ({adapter.vocab_size})"
        )


def evaluate(
    drafter: DFlashDraftModel,
    adapter,
    prompt_sets: dict[str, list[list[int]]],
    *,
    max_new_tokens: int,
    batch_size: int = 8,
    show_progress: bool = True,
) -> dict[str, Any]:
    """Greedy (T=0) acceptance of `drafter` on each prompt set (token ids of chat-templated prompts)."""
    if not prompt_sets:
        raise ValueError("prompt_sets is empty")
    check_compatible(drafter, adapter)
    drafter.eval()
    block_size = drafter.config.block_size
    bar = None
    if show_progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(len(p) for p in prompt_sets.values()), desc="eval", unit="prompt")
    per_set: dict[str, Any] = {}
    all_traces, all_mismatches = [], 0
    try:
        for name, prompts in prompt_sets.items():
            if bar is not None:
                bar.set_postfix_str(name)
            with torch.inference_mode():
                results = replay(
                    drafter, adapter, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size,
                    progress=bar.update if bar is not None else None,
                )
            traces = [r.trace for r in results]
            mismatches = sum(r.greedy_mismatches for r in results)
            per_set[name] = {**acceptance_metrics(traces, block_size), "greedy_mismatches": mismatches}
            all_traces += traces
            all_mismatches += mismatches
    finally:
        if bar is not None:
            bar.close()
    overall = {**acceptance_metrics(all_traces, block_size), "greedy_mismatches": all_mismatches}
    return {
        "schema_version": SCHEMA_VERSION,
        "block_size": block_size,
        "max_new_tokens": max_new_tokens,
        "prompt_sets": per_set,
        "overall": overall,
    }


def write_summary(summary: dict[str, Any], out_dir: str) -> str:
    """Write out_dir/summary.json (atomically) and out_dir/per_position.png; returns the JSON path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "summary.json")
    temp = path + ".tmp"
    with open(temp, "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    os.replace(temp, path)
    plot_per_position(summary, os.path.join(out_dir, "per_position.png"))
    return path


def format_table(summary: dict[str, Any]) -> str:
    """A small console table: tau and draft acceptance rate per prompt set and overall."""

    def number(value: float | None, digits: int) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    rows = [(name, m) for name, m in summary["prompt_sets"].items()] + [("overall", summary["overall"])]
    width = max(12, *(len(name) for name, _ in rows))
    header = f"{'prompt set':<{width}}  {'tau':>6}  {'acc.rate':>8}  {'prompts':>7}  {'steps':>7}  {'tokens':>7}"
    lines = [f"greedy acceptance, block size {summary['block_size']} (tau = tokens per target forward)", header,
             "-" * len(header)]
    for name, m in rows:
        lines.append(
            f"{name:<{width}}  {number(m['tau'], 2):>6}  {number(m['acceptance_rate'], 3):>8}  "
            f"{m['num_prompts']:>7}  {m['num_steps']:>7}  {m['num_tokens']:>7}"
        )
    return "\n".join(lines)
