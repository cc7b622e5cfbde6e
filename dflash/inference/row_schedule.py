"""Which prompt decodes in which row of a static batch, and when: the refill schedule of the static decoding engine.

A batch that runs until its longest answer ends wastes the rows whose answers ended early (about a third of the
decode row-steps for SmolLM2's ShareGPT answers: mean ~252 tokens, cap 384). With refill, rows freed by finished
prompts take the next pending prompts while the others keep decoding, so the number of decode steps approaches
total tokens / rows. The schedule only does host bookkeeping: the device work (prefill into rows, decode steps,
reading the finished flags and tokens) goes through a RowDecoder, so the schedule is tested without a model.

Host knowledge is exact without syncing the device: a row admitted at step a with a prompt of P tokens and a budget
of B new tokens writes its key/value column P + (s - a) at step s, and stops advancing at column P + B - 1. That
bounds the attention span a decode step needs (the columns of every occupied row), so short prompts attend over a
short span.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol


class RowDecoder(Protocol):
    """The device side of a static batch of `rows` rows."""

    rows: int

    def admit(self, rows: list[int], prompts: list[int]) -> None:
        """Prefill prompts (indices into the run's prompt list) into the given free rows; choose their first token."""

    def decode(self, steps: int, span: int) -> None:
        """Run `steps` decode steps for every row, attending over the first `span` cache columns."""

    def finished(self) -> list[bool]:
        """Per row: has its prompt stopped (stop token or budget)? Rows without a prompt read True."""

    def harvest(self, rows: list[int]) -> list[list[int]]:
        """The new tokens of the prompts in these (finished) rows."""


@dataclass
class ScheduleStats:
    """What one run cost: decode steps of all rows against the tokens they kept."""

    prompts: int = 0
    rows: int = 0
    decode_steps: int = 0
    admissions: int = 0  # prefill calls (groups of rows refilled at once)
    tokens: int = 0  # kept tokens, the first token of each prompt (chosen by its prefill) included
    # The prompts in rows (admitted, not yet harvested): after a decoder error, the ones it may concern.
    in_rows: list[int] = field(default_factory=list)

    @property
    def utilisation(self) -> float:
        """Share of the decode row-steps that produced a kept token (the first tokens come from prefill)."""
        return (self.tokens - self.prompts) / max(1, self.rows * self.decode_steps)

    def as_dict(self) -> dict:
        return {"prompts": self.prompts, "rows": self.rows, "decode_steps": self.decode_steps,
                "admissions": self.admissions, "tokens": self.tokens, "utilisation": round(self.utilisation, 4)}


def round_up(n: int, quantum: int) -> int:
    """The smallest multiple of quantum that is >= n."""
    return -(-n // quantum) * quantum


def run_schedule(decoder: RowDecoder, lengths: list[int], budgets: list[int], *, refill: bool, check_every: int,
                 admit_min: int, span_quantum: int, max_span: int,
                 stats: ScheduleStats | None = None) -> Iterator[tuple[int, list[int]]]:
    """Decode every prompt (prompt lengths and new-token budgets given) through `decoder`, yielding (prompt index,
    new tokens) as prompts finish; `stats` (when given) is updated as the run goes.

    Prompts are admitted longest first (the span follows the longest occupied row, so long prompts go together).
    refill=True: free rows take pending prompts as soon as at least min(admit_min, pending) rows are free (one
    prefill call serves them all). refill=False: a new group is admitted only when every row is free (plain
    batches). The finished flags are read every `check_every` decode steps (a device sync on CUDA).
    """
    if len(lengths) != len(budgets):
        raise ValueError(f"{len(lengths)} prompt lengths but {len(budgets)} budgets")
    if check_every < 1 or admit_min < 1:
        raise ValueError(f"check_every and admit_min must be >= 1, got {check_every}, {admit_min}")
    rows = decoder.rows
    pending = deque(sorted(range(len(lengths)), key=lambda i: -lengths[i]))
    occupant: list[int | None] = [None] * rows
    admitted_at = [0] * rows
    stats = stats if stats is not None else ScheduleStats()
    stats.prompts, stats.rows = len(lengths), rows
    step = 0
    while True:
        free = [r for r in range(rows) if occupant[r] is None]
        # All rows free always admits: an admit_min above the row count must not leave prompts undecoded.
        ready = len(free) == rows or (refill and len(free) >= min(admit_min, len(pending)))
        if pending and ready:
            take = [pending.popleft() for _ in range(min(len(free), len(pending)))]
            for r, i in zip(free, take):
                occupant[r], admitted_at[r] = i, step
            stats.in_rows = [i for i in occupant if i is not None]
            decoder.admit(free[: len(take)], take)
            stats.admissions += 1
        occupied = [r for r in range(rows) if occupant[r] is not None]
        if not occupied:
            return
        # The last step of the window writes column <= P + (step + check_every - 1 - a), capped at P + B - 1.
        last = max(min(lengths[occupant[r]] + step + check_every - 1 - admitted_at[r],
                       lengths[occupant[r]] + budgets[occupant[r]] - 1) for r in occupied)
        decoder.decode(check_every, min(max_span, round_up(last + 1, span_quantum)))
        step += check_every
        stats.decode_steps += check_every
        flags = decoder.finished()
        done = [r for r in occupied if flags[r]]
        if done:
            prompts = [occupant[r] for r in done]
            harvested = decoder.harvest(done)
            for r in done:
                occupant[r] = None
            stats.in_rows = [i for i in occupant if i is not None]
            for i, tokens in zip(prompts, harvested):
                stats.tokens += len(tokens)
                yield i, tokens
