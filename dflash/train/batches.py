"""How a micro-batch of the plan's samples (dflash/data/batch_plan.py) is read from its FeatureSource and prepared
for a step.

Anchors are drawn from a generator seeded by (seed, epoch, sample), independent of placement.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dflash.data.feature_source import FeatureSource, Sample, as_feature_source
from dflash.train.objective import block_targets, loss_rows, sample_anchors


def anchor_generator(seed: int, epoch: int, sample_index: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + epoch) * 1_000_033 + sample_index)


# Anchor slots are trimmed to a multiple of this (x block size 16 = 512 query rows: whole 128-row flex tiles), so
# the step sees few distinct shapes.
ANCHOR_QUANTUM = 32


def trim_anchor_padding(anchors: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop the anchor slots that no sequence of the micro-batch uses (rounded up to ANCHOR_QUANTUM).

    A sequence with fewer valid positions than num_anchors pads its slots at the end (sample_anchors), and a padded
    block costs a full block of query rows in every layer for a loss weight of 0. Blocks never see each other, so
    dropping slots that are padding in every row leaves every real block's output and loss as they were. With the
    recipe's 256 anchors about a quarter of the slots are padding (short answers); how many a micro-batch can drop
    depends on its longest answer.
    """
    slots = anchors.shape[1]
    keep = min(slots, -(-max(int(valid.sum(dim=1).max()), 1) // ANCHOR_QUANTUM) * ANCHOR_QUANTUM)
    return anchors[:, :keep], valid[:, :keep]


def prepare_micro_batch(
    source: FeatureSource | Sequence[Sample], slots: list[tuple[int, bool]], *, epoch: int, seed: int,
    num_anchors: int, block_size: int, gamma: float, pin_memory: bool = False,
) -> dict[str, torch.Tensor]:
    """The source's padded micro-batch plus anchors, labels and loss weights (zeroed for placeholder samples).

    A source whose samples hold "target_final" (colocated capture with final_hidden=True) passes it on, padded, for
    the KL loss; train_step gathers its rows per block position. pin_memory (only when training on CUDA): every
    CPU tensor of the batch is page-locked, so train_step's copies to the GPU are asynchronous (batch_to_device).
    """
    indices = [index for index, _ in slots]
    batch = as_feature_source(source).micro_batch(indices, pin_memory)
    generators = [anchor_generator(seed, epoch, index) for index, _ in slots]
    anchors, valid = sample_anchors(batch["loss_mask"], num_anchors, generators)
    anchors, valid = trim_anchor_padding(anchors, valid)
    valid &= torch.tensor([is_real for _, is_real in slots])[:, None]
    labels, weights = block_targets(batch["input_ids"], batch["loss_mask"], anchors, valid, block_size, gamma)
    # The loss rows are found here, on the host: found on the GPU they would make the host wait for it mid-step.
    small = {"anchors": anchors, "labels": labels, "weights": weights, "loss_rows": loss_rows(weights)}
    # Small (kilobytes), but a copy from pageable memory makes the host wait for the GPU stream to drain.
    batch.update({k: v.pin_memory() if pin_memory and v.device.type == "cpu" else v for k, v in small.items()})
    return batch


def batch_to_device(batch: dict[str, torch.Tensor], device: torch.device,
                    hidden_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of a micro-batch on `device` (hidden in `hidden_dtype`), copied without waiting for the GPU.

    From pinned memory (prepare_micro_batch(pin_memory=True)) each copy is an asynchronous DMA queued on the
    stream, so the host goes on launching the forward; a dtype change is then made on the GPU (moving and casting
    in one call would convert on the host into pageable memory first). On CPU nothing moves.
    """
    moved = {key: value.to(device, non_blocking=True) for key, value in batch.items() if key != "hidden"}
    moved["hidden"] = batch["hidden"].to(device, non_blocking=True).to(hidden_dtype)
    return moved
