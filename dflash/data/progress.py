"""Progress of the data stage's generation: a bar that moves with the generated tokens, not per batch."""

from __future__ import annotations

import time
from collections.abc import Hashable

import torch
from tqdm.auto import tqdm
from transformers.generation.streamers import BaseStreamer

# The bar's own counts are token budgets, which mean little to a reader: the postfix says what finished.
BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}{postfix}]"
# The time left is shown once this share of the bar is done: the first tokens come with the engine's warm-up (the
# first batch's prefill, compilation, graph capture), and an estimate from them read 1:24:07 for the CPU demo's 84 s.
ESTIMATE_AFTER = 0.05
EARLY_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| [{elapsed}{postfix}]"


class GenerationProgress:
    """A tqdm bar over the token budgets of the answers to generate; its postfix shows the answers that ended and
    the generated tokens per second.

    An answer moves the bar by its tokens as they are generated (where the engine streams them, see
    `TokenStreamer`) and, when it ends, by the budget it left unused: the bar fills at the pace tokens are made
    and is full once every answer has ended, whatever their lengths. show=False: counts only, no bar.
    """

    def __init__(self, desc: str, noun: str, show: bool) -> None:
        self.noun = noun
        self.bar = tqdm(total=0, desc=desc, bar_format=EARLY_FORMAT) if show else None
        self.estimating = False  # the bar shows the time left (ESTIMATE_AFTER)
        self.budgets: dict[Hashable, int] = {}  # answers expected and not ended yet
        self.shown: dict[Hashable, int] = {}  # tokens on the bar of those answers
        self.expected = self.ended = self.tokens = 0
        self.started = time.perf_counter()

    def __enter__(self) -> GenerationProgress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def expect(self, budgets: dict[Hashable, int]) -> None:
        """More answers to wait for: {key: its token budget}."""
        self.budgets.update(budgets)
        self.expected += len(budgets)
        if self.bar is not None:
            self.bar.total += sum(budgets.values())
            self._move(0)

    def running(self, counts: dict[Hashable, int]) -> None:
        """Answers still being generated have `counts` tokens so far ({key: tokens}; unknown keys are ignored)."""
        moved = 0
        for key, count in counts.items():
            if key in self.budgets:
                count = min(count, self.budgets[key])
                moved += count - self.shown.get(key, 0)
                self.shown[key] = count
        self.tokens += moved
        self._move(moved)

    def end(self, key: Hashable, tokens: int) -> None:
        """The answer `key` ended with `tokens` tokens (0 when it failed)."""
        budget, shown = self.budgets.pop(key), self.shown.pop(key, 0)
        self.ended += 1
        self.tokens += tokens - shown
        self._move(budget - shown)

    def streamer(self, keys: list[Hashable], stop_ids: list[int]) -> TokenStreamer | None:
        """A streamer for model.generate over a batch whose rows answer `keys`; None when no bar is shown."""
        return TokenStreamer(self, keys, stop_ids) if self.bar is not None else None

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def _move(self, steps: int) -> None:
        if self.bar is None:
            return
        seconds = time.perf_counter() - self.started
        rate = self.tokens / seconds if seconds > 0 else 0.0
        self.bar.set_postfix_str(f"{self.ended}/{self.expected} {self.noun}, {rate:,.0f} tok/s", refresh=False)
        if not self.estimating and self.bar.total and self.bar.n + steps >= ESTIMATE_AFTER * self.bar.total:
            self.estimating, self.bar.bar_format = True, BAR_FORMAT
        self.bar.update(steps)


class TokenStreamer(BaseStreamer):
    """Hands the tokens model.generate makes, step by step, to a GenerationProgress: each row counts its tokens up
    to and including its first stop token (the rows of finished answers get padding afterwards)."""

    def __init__(self, progress: GenerationProgress, keys: list[Hashable], stop_ids: list[int]) -> None:
        self.progress, self.keys = progress, keys
        self.stop_ids = torch.tensor(stop_ids)
        self.counts = torch.zeros(len(keys), dtype=torch.long)
        self.running = torch.ones(len(keys), dtype=torch.bool)

    def put(self, value: torch.Tensor) -> None:
        if value.dim() > 1:  # generate hands over the prompts first
            return
        grew = self.running.nonzero().flatten().tolist()  # rows of ended answers get padding: not counted
        self.counts += self.running
        self.running &= ~torch.isin(value, self.stop_ids)
        counts = self.counts.tolist()
        self.progress.running({self.keys[row]: counts[row] for row in grew})

    def end(self) -> None:
        """Nothing to do: the caller ends each answer once it has its tokens."""
