"""Colocated capture: each trainer rank runs the frozen target itself, one forward per micro-batch.

For a target small enough to share the trainer's GPU (SmolLM2-135M: 0.3 GB in bf16, a forward costs a fraction of
the drafter's step) this is the cheapest way to give every epoch fresh features: nothing is written to disk or sent
between processes. The features are exactly what offline capture would store: the same `TargetAdapter.capture`
over right-padded rows, the same self-check of every batch, the same cast to the feature dtype.
Larger targets belong on their own GPUs: capture.mode=online.

With `final_hidden=True` the forward also runs the rest of the decoder (never the LM head) and each sample gets
"target_final" [T, H], the target's final normed hidden state in its own dtype: the drafter's KL loss makes the
target's next-token distributions from it chunk by chunk (train.kl_weight), so no [T, vocab] logits are kept.
"""

from __future__ import annotations

from typing import Any

import torch

from dflash.extract.capture import check_features
from dflash.extract.store import store_dtype
from dflash.models.targets.base import TargetAdapter


class ColocatedFeatureSource:
    """Samples {"input_ids", "loss_mask", "hidden"} (+ "target_final" when final_hidden) of a token dataset, the
    features computed on access.

    `get_many` captures several samples in one padded target forward; the hidden states stay on the target's
    device. Indexing one sample works too (one forward each).
    """

    def __init__(self, adapter: TargetAdapter, dataset: Any, layer_ids: list[int], dtype: str = "bfloat16",
                 final_hidden: bool = False) -> None:
        self.dtype = store_dtype(dtype)
        if self.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"colocated capture keeps features in bfloat16 or float32, not {dtype!r}: fp8 only "
                             "saves disk, and colocated features never touch the disk")
        self.adapter = adapter
        self.layer_ids = adapter.check_layer_ids(list(layer_ids))
        self.dataset = dataset
        self.final_hidden = final_hidden
        self.tokens_captured = 0

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.get_many([index])[0]

    def get_many(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        rows = self.dataset[list(indices)]
        ids = [list(row) for row in rows["input_ids"]]
        masks = [list(row) for row in rows["loss_mask"]]
        lengths = [len(row) for row in ids]
        for j, (row_ids, row_mask) in enumerate(zip(ids, masks)):
            if not row_ids or len(row_ids) != len(row_mask):
                raise ValueError(f"sample {rows['id'][j]!r}: {len(row_ids)} input_ids, {len(row_mask)} loss_mask "
                                 "entries (need the same, non-zero count)")
        width = max(lengths)
        pad_id = self.adapter.tokenizer.pad_token_id
        input_ids = torch.full((len(ids), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(ids), width), dtype=torch.long)
        for row, row_ids in enumerate(ids):
            input_ids[row, : lengths[row]] = torch.tensor(row_ids, dtype=torch.long)
            attention_mask[row, : lengths[row]] = 1
        device = self.adapter.device
        inputs = (input_ids.to(device), attention_mask.to(device), self.layer_ids)
        final = None
        if self.final_hidden:
            features, final = self.adapter.capture_with_final(*inputs)
        else:
            features = self.adapter.capture(*inputs)
        sample_ids = [str(i) for i in rows["id"]]
        check_features(features, lengths, sample_ids, self.layer_ids)
        if final is not None:  # the KL target: a non-finite state would only surface as a NaN loss
            check_features(final, lengths, sample_ids, ["final norm"])
        features = features.to(self.dtype)
        self.tokens_captured += sum(lengths)
        samples = []
        for row, length in enumerate(lengths):
            sample = {"input_ids": input_ids[row, :length], "loss_mask": torch.tensor(masks[row], dtype=torch.long),
                      "hidden": features[row, :length]}
            if final is not None:
                sample["target_final"] = final[row, :length]
            samples.append(sample)
        return samples
