"""The capture of one shard's rows: forwards of at most a budget of tokens, checked, into the shard's tensors.

With `pack`, consecutive samples are laid end to end in runs (`packed_runs`), each run one
`TargetAdapter.capture_packed` forward with no padding at all; otherwise samples are sorted by length and grouped
into right-padded batches (`length_batches`) for `TargetAdapter.capture`. Every forward's features are checked
(one row per token, finite values, non-zero variance per tap and sample) and copied to their samples' places in
the shard; one sample in `check_every` is compared with a plain forward of it alone (feature_checks.py). A forward
that runs out of device memory is planned again at the halved budget (forward_budget.py), with the samples left.
The offline store (capture.py) and the online capture ranks (capture_sender.py) both capture through
`capture_rows`, so their features are the same.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow.compute as pc
import torch
from tqdm.auto import tqdm

from dflash.extract.feature_checks import (
    check_features, crosscheck_if_it_fits, packed_feature_flags, raise_on_bad_features,
)
from dflash.extract.forward_budget import ForwardBudget
from dflash.extract.fp8 import FP8_DTYPE, quantize_fp8
from dflash.host_copy import host_to_device
from dflash.models.targets.base import TargetAdapter

logger = logging.getLogger(__name__)

# (sample index in the shard, its features as the forward made them): the samples a forward leaves to crosscheck.
Checks = list[tuple[int, torch.Tensor]]


def length_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Group indices by length (longest first) so that batch size x longest length <= batch_tokens."""
    order = sorted(range(len(lengths)), key=lambda j: -lengths[j])
    batches: list[list[int]] = []
    for j in order:
        # Sorted by decreasing length: a batch's first index is its longest sample.
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= batch_tokens:
            batches[-1].append(j)
        else:
            batches.append([j])
    return batches


def packed_runs(lengths: np.ndarray, batch_tokens: int) -> list[tuple[int, int]]:
    """[(first, end)]: consecutive samples laid end to end, at most `batch_tokens` tokens per run (a longer sample
    runs alone). Dataset order is kept, so a run's features land in one contiguous slice of the shard."""
    runs, first, tokens = [], 0, 0
    for j, length in enumerate(lengths.tolist()):
        if j > first and tokens + length > batch_tokens:
            runs.append((first, j))
            first, tokens = j, 0
        tokens += length
    if first < len(lengths):
        runs.append((first, len(lengths)))
    return runs


def capture_rows(
    adapter: TargetAdapter,
    rows: Any,
    first_sample: int,
    layer_ids: list[int],
    budget: ForwardBudget,
    dtype: torch.dtype,
    check_every: int,
    progress: tqdm,
    pack: bool,
) -> dict[str, torch.Tensor]:
    """Capture one shard's rows (an Arrow table slice) -> ShardWriter.write_shard's tensors (hidden, input_ids,
    loss_mask, offsets, and scales for fp8), in forwards of at most `budget.tokens` tokens. Sample
    `first_sample + j` is crosschecked when divisible by `check_every` (0: never). pack: samples laid end to end
    (capture_packed) instead of padded batches."""
    shard = ShardRows.of(adapter, rows, first_sample, layer_ids, dtype, check_every)
    # A target packed capture cannot serve (packing_problem) takes padded batches, which keep to batch_tokens
    # (its packed fallback would pad a whole run of samples to the longest one).
    if pack and adapter.packing_problem() is None:
        _capture_packed(shard, budget, progress)
    else:
        _capture_padded(shard, budget, progress)
    return shard.arrays()


@dataclass
class ShardRows:
    """One shard's samples, their tokens laid end to end (sample j is flat_ids[offsets[j]:offsets[j + 1]]), and the
    tensors their features fill in the stored dtype: `hidden` [tokens, taps x width], `scales` [tokens, taps] for
    fp8 (else None)."""

    adapter: TargetAdapter
    sample_ids: list[str]
    first_sample: int  # what check_every counts sample 0 as: its dataset index (offline), its capture order (online)
    layer_ids: list[int]
    check_every: int
    flat_ids: torch.Tensor
    flat_mask: torch.Tensor
    lengths: np.ndarray
    offsets: torch.Tensor
    hidden: torch.Tensor
    scales: torch.Tensor | None

    @classmethod
    def of(cls, adapter: TargetAdapter, rows: Any, first_sample: int, layer_ids: list[int], dtype: torch.dtype,
           check_every: int) -> "ShardRows":
        """The shard of `rows` (an Arrow table slice with id, input_ids, loss_mask), its features not made yet."""
        sample_ids = [str(i) for i in rows["id"].to_pylist()]
        lengths = _checked_lengths(rows, sample_ids)
        flat_ids = pc.list_flatten(rows["input_ids"]).to_numpy(zero_copy_only=False).astype(np.int64)
        flat_mask = pc.list_flatten(rows["loss_mask"]).to_numpy(zero_copy_only=False).astype(np.uint8)
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        offsets[1:] = torch.from_numpy(np.cumsum(lengths))
        num_tokens = int(offsets[-1])
        hidden = torch.empty(num_tokens, len(layer_ids) * adapter.hidden_size, dtype=dtype)
        scales = torch.empty(num_tokens, len(layer_ids), dtype=torch.float32) if dtype == FP8_DTYPE else None
        return cls(adapter, sample_ids, first_sample, layer_ids, check_every, torch.from_numpy(flat_ids),
                   torch.from_numpy(flat_mask), lengths, offsets, hidden, scales)

    def checked(self, j: int) -> bool:
        """Whether sample j is compared with a plain forward of it alone."""
        return bool(self.check_every) and (self.first_sample + j) % self.check_every == 0

    def tokens_of(self, j: int) -> torch.Tensor:
        return self.flat_ids[self.offsets[j]:self.offsets[j + 1]]

    def padded_batch(self, batch: list[int], checks: Checks) -> None:
        """One right-padded forward of the samples `batch`, checked, into hidden; the features of each sample to
        crosscheck into `checks`, copied, for `crosscheck` once the batch's own are freed."""
        adapter, lengths = self.adapter, self.lengths
        batch_lengths = [int(lengths[j]) for j in batch]
        input_ids = torch.full((len(batch), max(batch_lengths)), adapter.tokenizer.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros(input_ids.shape, dtype=torch.long)
        for row, j in enumerate(batch):
            input_ids[row, :lengths[j]] = self.tokens_of(j)
            attention_mask[row, :lengths[j]] = 1
        features = adapter.capture(input_ids.to(adapter.device), attention_mask.to(adapter.device), self.layer_ids)
        check_features(features, batch_lengths, [self.sample_ids[j] for j in batch], self.layer_ids)
        for row, j in enumerate(batch):
            # Compared before the cast to the stored dtype: the check is about the capture path, not rounding.
            if self.checked(j):
                checks.append((j, features[row, :lengths[j]].clone()))
        self._store_padded(features, batch)

    def _store_padded(self, features: torch.Tensor, batch: list[int]) -> None:
        """Copy a padded batch's features [b, T, K*H] (row r: sample batch[r]) into hidden without the padding, in
        the stored dtype (fp8: quantised, the scales into `scales`)."""
        offsets, lengths = self.offsets, self.lengths
        if self.scales is not None:
            q, batch_scales = quantize_fp8(features.flatten(0, 1), len(self.layer_ids))
            features = q.view(features.shape).cpu()
            batch_scales = batch_scales.view(*features.shape[:2], -1).cpu()
            for row, j in enumerate(batch):
                self.scales[offsets[j]:offsets[j + 1]] = batch_scales[row, :lengths[j]]
        else:
            features = features.to(self.hidden.dtype).cpu()
        for row, j in enumerate(batch):
            self.hidden[offsets[j]:offsets[j + 1]] = features[row, :lengths[j]]

    def packed_run(self, first: int, end: int, checks: Checks) -> None:
        """One packed forward of the samples first..end-1, checked, into hidden[start:stop]; the features of each
        sample to crosscheck into `checks`, copied, for `crosscheck` once the run's own are freed."""
        offsets = self.offsets
        start, stop = int(offsets[first]), int(offsets[end])
        run_lengths = self.lengths[first:end].tolist()
        features = self.adapter.capture_packed(host_to_device(self.flat_ids[start:stop], self.adapter.device),
                                               run_lengths, self.layer_ids)
        flags = packed_feature_flags(features, run_lengths, self.layer_ids)
        raise_on_bad_features(flags.cpu(), self.sample_ids[first:end], self.layer_ids)
        for j in range(first, end):
            if self.checked(j):
                # The first sample of a run has nothing before it to leak from: its run's last sample is checked.
                k = end - 1 if j == first else j
                checks.append((k, features[int(offsets[k]) - start:int(offsets[k + 1]) - start].clone()))
        if self.scales is not None:
            q, run_scales = quantize_fp8(features, len(self.layer_ids))
            self.hidden[start:stop] = q.cpu()
            self.scales[start:stop] = run_scales.cpu()
        else:
            self.hidden[start:stop] = features.to(self.hidden.dtype).cpu()

    def crosscheck(self, checks: Checks) -> None:
        """Each (sample, features) of `checks` compared with a plain forward of the sample (crosscheck_if_it_fits)."""
        for j, features in checks:
            crosscheck_if_it_fits(self.adapter, self.tokens_of(j).tolist(), features, self.layer_ids,
                                  self.sample_ids[j])

    def arrays(self) -> dict[str, torch.Tensor]:
        """ShardWriter.write_shard's tensors."""
        arrays = {"hidden": self.hidden, "input_ids": self.flat_ids, "loss_mask": self.flat_mask,
                  "offsets": self.offsets}
        if self.scales is not None:
            arrays["scales"] = self.scales
        return arrays


def _checked_lengths(rows: Any, sample_ids: list[str]) -> np.ndarray:
    """Each row's token count; ValueError for a row without tokens or with a loss mask of another length."""
    lengths = pc.list_value_length(rows["input_ids"]).to_numpy(zero_copy_only=False).astype(np.int64)
    mask_lengths = pc.list_value_length(rows["loss_mask"]).to_numpy(zero_copy_only=False).astype(np.int64)
    for j in range(len(sample_ids)):
        if lengths[j] != mask_lengths[j]:
            raise ValueError(
                f"sample {sample_ids[j]!r}: {lengths[j]} input_ids but {mask_lengths[j]} loss_mask entries"
            )
        if lengths[j] == 0:
            raise ValueError(f"sample {sample_ids[j]!r} has no tokens")
    return lengths


def _capture_padded(shard: ShardRows, budget: ForwardBudget, progress: tqdm) -> None:
    """capture_rows' padded path: samples sorted by length into right-padded batches (length_batches), each through
    TargetAdapter.capture. A batch that runs out of memory is planned again, with the samples left, at the smaller
    budget."""
    lengths, left = shard.lengths, list(range(len(shard.lengths)))
    while left:
        planned = left
        for batch in length_batches([int(lengths[j]) for j in planned], budget.tokens):
            batch = [planned[k] for k in batch]
            checks: Checks = []
            tokens = len(batch) * int(max(lengths[j] for j in batch))
            alone = shard.sample_ids[batch[0]] if len(batch) == 1 else None
            if not budget.fits(functools.partial(shard.padded_batch, batch, checks), tokens, alone):
                break
            shard.crosscheck(checks)
            done = set(batch)
            left = [j for j in left if j not in done]
            progress.update(int(sum(lengths[j] for j in batch)))


def _capture_packed(shard: ShardRows, budget: ForwardBudget, progress: tqdm) -> None:
    """capture_rows' packed path: each run of samples goes through TargetAdapter.capture_packed (no padding at
    all) and its features fill hidden[start:stop] directly. A run that runs out of memory is planned again, with
    the samples after it, at the smaller budget."""
    done = 0
    while done < len(shard.lengths):
        base = done
        for first, end in packed_runs(shard.lengths[base:], budget.tokens):
            first, end = first + base, end + base
            checks: Checks = []
            tokens = int(shard.offsets[end] - shard.offsets[first])
            alone = shard.sample_ids[first] if end - first == 1 else None
            if not budget.fits(functools.partial(shard.packed_run, first, end, checks), tokens, alone):
                break
            shard.crosscheck(checks)
            done = end
            progress.update(tokens)
