"""Which samples each rank trains on at each step (BatchPlan), and the per-sample keys it can group them by.

A global batch is micro_batch_size x world_size x grad_accum samples of one seeded epoch permutation. Its samples
are dealt to (micro-step, rank) slots by a fixed rule, so a run with 1 process x 2 accumulation steps and a run with
2 processes x 1 step see exactly the same global batches. The last global batch of an epoch is filled with
placeholder copies whose loss weight is zero, so every rank runs the same number of steps and nothing is counted
twice.

With group_by_length > 0 each global batch holds samples of similar length, so little of it is padding: the
epoch permutation is cut into runs of group_by_length global batches, each run is sorted by length, and the
full global batches are then shuffled so that short and long batches alternate through the epoch.

With `kept` > 0 (colocated capture keeping part of an epoch's features in host memory, feature_memory.py), the
first `kept` samples of the first epoch's order form the kept class, and every later epoch cuts its batches from
each class apart (within each run of group_by_length batches, or the whole epoch), so a micro-batch is all kept,
which skips the target's forward, or all captured, rather than about half of each, which runs the forward anyway.
The first epoch's order, and every order of a plan with `kept` 0, are unchanged by it.

The trainer and the online capture ranks both follow one plan, so it lives below both of them.
"""

from __future__ import annotations

import functools
import hashlib
from array import array
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dflash.config.schema import GROUP_KEYS, TrainSettings
from dflash.data.sample_sizes import sample_anchor_positions, sample_lengths


@dataclass(frozen=True)
class BatchPlan:
    num_samples: int
    micro_batch_size: int
    world_size: int
    grad_accum: int
    seed: int
    group_by_length: int = 0
    # The first samples of epoch 0's order that later epochs batch apart from the others (0: none).
    kept: int = 0
    # Token count per sample, needed by group_by_length. Compared and hashed through its digest (a plan is a cache
    # key in the online stream, and hashing a long tuple on every lookup would be slow).
    lengths: tuple[int, ...] | None = field(default=None, compare=False, repr=False)
    lengths_digest: str = field(default="", init=False)

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError("the training set is empty: no sample to train on")
        if self.group_by_length < 0:
            raise ValueError(f"group_by_length must be >= 0, got {self.group_by_length}")
        if not 0 <= self.kept <= self.num_samples:
            raise ValueError(f"kept must be 0..{self.num_samples} samples, got {self.kept}")
        if self.group_by_length and (self.lengths is None or len(self.lengths) != self.num_samples):
            raise ValueError(f"group_by_length={self.group_by_length} needs the length of each of the "
                             f"{self.num_samples} samples, got {None if self.lengths is None else len(self.lengths)}")
        if self.lengths is not None:
            digest = hashlib.sha256(",".join(map(str, self.lengths)).encode()).hexdigest()
            object.__setattr__(self, "lengths_digest", digest)

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.world_size * self.grad_accum

    @property
    def steps_per_epoch(self) -> int:
        return -(-self.num_samples // self.global_batch_size)

    def epoch_order(self, epoch: int) -> list[int]:
        """Every sample index once, in the order epoch `epoch` deals them (a copy of the plan's cached order)."""
        return list(self._order(epoch))

    # Each (plan, epoch)'s order is computed once: a trainer asks for it every step and a capture rank for every unit
    # (its micro-batches of all trainer ranks), tens of milliseconds each time at 200k samples. Two entries: a capture
    # rank's stream crosses from one epoch into the next. 8 bytes a sample (an int64 array, not a list of Python
    # ints), as every rank of a job holds them.
    @functools.lru_cache(maxsize=2)  # noqa: B019 (two plans at most are kept alive by it)
    def _order(self, epoch: int) -> array:
        """Epoch `epoch`'s order: the seeded permutation, length-grouped when group_by_length is set, its batches
        cut from the kept class and the others apart after the first epoch when `kept` is set."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = torch.randperm(self.num_samples, generator=generator).tolist()
        apart = epoch > 0 and 0 < self.kept < self.num_samples
        if not self.group_by_length and not apart:
            return array("q", order)
        size = self.global_batch_size
        run = self.group_by_length * size if self.group_by_length else len(order)
        lengths = self.lengths if self.group_by_length else None
        members = self.kept_class if apart else None

        def key(index: int) -> tuple[bool, int]:  # sorted() is stable: without lengths, each class keeps its order
            return (members is not None and not members[index]), (-lengths[index] if lengths is not None else 0)

        grouped = []
        for start in range(0, len(order), run):
            grouped += sorted(order[start : start + run], key=key)
        full = len(grouped) // size
        # The partial last batch stays last: micro_batches fills it with placeholders.
        batches = [grouped[b * size : (b + 1) * size] for b in torch.randperm(full, generator=generator).tolist()]
        return array("q", [i for batch in batches for i in batch] + grouped[full * size :])

    @functools.cached_property
    def kept_class(self) -> bytearray:
        """Per sample, 1 when it is among the first `kept` of epoch 0's order."""
        members = bytearray(self.num_samples)
        for index in self._order(0)[: self.kept]:
            members[index] = 1
        return members

    def micro_batches(self, epoch: int, step: int, rank: int) -> list[list[tuple[int, bool]]]:
        """For this rank and optimizer step: grad_accum lists of (sample index, is_real) pairs."""
        order = self._order(epoch)
        start = step * self.global_batch_size
        chunk = order[start : start + self.global_batch_size]
        slots = [(index, True) for index in chunk]
        slots += [(order[i % self.num_samples], False) for i in range(self.global_batch_size - len(chunk))]
        per_micro = self.micro_batch_size * self.world_size
        result = []
        for micro in range(self.grad_accum):
            group = slots[micro * per_micro : (micro + 1) * per_micro]
            result.append(group[rank * self.micro_batch_size : (rank + 1) * self.micro_batch_size])
        return result


def grouping_keys(dataset: Any, group_by: str, num_anchors: int, block_size: int) -> np.ndarray:
    """What train.group_by_length sorts samples by (train.group_by).

    "tokens": the token count, so a batch pads its context little. "work": tokens + block_size x the anchors the
    sample trains (min(valid anchor positions, num_anchors)), the rows a training step spends on it; batches of
    similar work also drop most padded anchor slots (batches.trim_anchor_padding), which dominate when num_anchors
    is near the answer length.
    """
    if group_by not in GROUP_KEYS:
        raise ValueError(f"train.group_by must be one of {list(GROUP_KEYS)}, got {group_by!r}")
    lengths = sample_lengths(dataset)
    if group_by == "tokens":
        return lengths
    return lengths + block_size * np.minimum(sample_anchor_positions(dataset), num_anchors)


def plan_lengths(dataset: Any, train: TrainSettings, block_size: int) -> tuple[int, ...] | None:
    """Every sample's grouping key (train.group_by) when train.group_by_length groups the batches, else None: the
    `lengths` of the plan every rank builds (loop.plan_batches), trainers and capture ranks alike."""
    if not train.group_by_length:
        return None
    return tuple(grouping_keys(dataset, train.group_by, train.num_anchors, block_size).tolist())
