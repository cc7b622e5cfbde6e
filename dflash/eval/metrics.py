"""Acceptance metrics of speculative decoding, from per-step records of a decode (replayed or live).

Definitions (docs/eval.md):
- committed[s]: tokens committed by verify step s, bonus included (1..B); the prefill token is not a step.
- accepted[s]: draft tokens of step s that were committed (0..B-1).
- drafted[s]: draft positions of step s that could have been committed (0..B-1): the block's size - 1 (B-1 but in
  blocks shortened near max_new_tokens), except on the last step of a sequence, the one that commits its stop token
  or its max_new_tokens-th token, where only drafts up to that token count. A step rejected before a stop token
  inside its block counts its whole block, as a live decoder does.
- tau = sum(committed) / number of steps = mean tokens per target verify forward (method.md §5).
- tau_prompt_mean = mean over prompts of each prompt's own tau (what the reference benchmark prints).
- acceptance_rate = sum(accepted) / sum(drafted), the "draft acceptance rate" of serving logs.
- per_position[k-1] = fraction of the steps that drafted position k in which draft k was accepted (nearly a survival
  curve: accepting draft k requires accepting drafts 1..k-1; but a step that drafted fewer positions is only in the
  denominators of those, so it can rise from k to k+1).

Where the evaluator's time goes is recorded by `PhaseTimer`: wall seconds per named phase, per prompt set.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class StepTrace:
    """Per-step records of one prompt's decode; all three lists have one entry per verify step."""

    committed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)

    def add(self, committed: int, accepted: int, drafted: int) -> None:
        self.committed.append(int(committed))
        self.accepted.append(int(accepted))
        self.drafted.append(int(drafted))

    @property
    def num_steps(self) -> int:
        return len(self.committed)

    def validate(self, block_size: int) -> None:
        if not len(self.committed) == len(self.accepted) == len(self.drafted):
            raise ValueError(
                f"trace lists differ in length: committed {len(self.committed)}, accepted {len(self.accepted)}, "
                f"drafted {len(self.drafted)}"
            )
        for step, (c, a, d) in enumerate(zip(self.committed, self.accepted, self.drafted)):
            if not (1 <= c <= block_size and 0 <= a <= d <= block_size - 1 and a <= c):
                raise ValueError(
                    f"step {step}: committed={c}, accepted={a}, drafted={d} is impossible for block_size "
                    f"{block_size} (need 1<=committed<=B, 0<=accepted<=drafted<=B-1, accepted<=committed)"
                )


def acceptance_metrics(traces: list[StepTrace], block_size: int) -> dict[str, Any]:
    """Pool the steps of `traces` (one per prompt) into the metrics defined in the module docstring."""
    for trace in traces:
        trace.validate(block_size)
    committed = [c for t in traces for c in t.committed]
    accepted = [a for t in traces for a in t.accepted]
    drafted = [d for t in traces for d in t.drafted]
    num_steps = len(committed)
    per_prompt_tau = [sum(t.committed) / t.num_steps for t in traces if t.num_steps]
    per_position = []
    for k in range(1, block_size):
        eligible = sum(1 for d in drafted if d >= k)
        hits = sum(1 for a in accepted if a >= k)
        per_position.append(hits / eligible if eligible else None)
    histogram = [0] * (block_size + 1)
    for c in committed:
        histogram[c] += 1
    return {
        "tau": sum(committed) / num_steps if num_steps else None,
        "tau_prompt_mean": sum(per_prompt_tau) / len(per_prompt_tau) if per_prompt_tau else None,
        "acceptance_rate": sum(accepted) / sum(drafted) if sum(drafted) else None,
        "per_position": per_position,
        "committed_histogram": histogram,
        "num_prompts": len(traces),
        "num_steps": num_steps,
        "num_tokens": sum(committed),
        "num_accepted": sum(accepted),
        "num_drafted": sum(drafted),
    }


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (wall times mean nothing otherwise); nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PhaseTimer:
    """Wall seconds per phase ("generate", "target_pass", ...), summed per prompt set and over all sets.

    `device`: on CUDA a phase starts and ends with a synchronize, so queued kernels are charged to the phase that
    launched them; keep phases coarse (per chunk, per prompt), except when profiling a loop step by step.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else None
        self.prompt_set: str | None = None
        self.per_set: dict[str, dict[str, float]] = {}
        self.totals: dict[str, float] = {}

    def _sync(self) -> None:
        if self.device is not None:
            synchronize(self.device)

    @contextmanager
    def for_prompt_set(self, name: str) -> Iterator[None]:
        """Charge the phases of the `with` body to prompt set `name`; the previous set is restored on the way out,
        also when the body raises."""
        previous, self.prompt_set = self.prompt_set, name
        try:
            yield
        finally:
            self.prompt_set = previous

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Charge the wall time of the `with` body to phase `name` (of the current prompt set, if one is set)."""
        self._sync()
        began = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.add(name, time.perf_counter() - began)

    def add(self, name: str, seconds: float) -> None:
        """Add `seconds` to phase `name` of the current prompt set and to the total."""
        self.totals[name] = self.totals.get(name, 0.0) + seconds
        if self.prompt_set is not None:
            phases = self.per_set.setdefault(self.prompt_set, {})
            phases[name] = phases.get(name, 0.0) + seconds

    def summary(self) -> dict[str, Any]:
        """{"seconds": {phase: s}, "total_seconds": s, "prompt_sets": {set: {phase: s}}}, rounded to ms."""
        def rounded(phases: dict[str, float]) -> dict[str, float]:
            return {name: round(seconds, 3) for name, seconds in phases.items()}

        return {"seconds": rounded(self.totals), "total_seconds": round(sum(self.totals.values()), 3),
                "prompt_sets": {name: rounded(phases) for name, phases in self.per_set.items()}}
