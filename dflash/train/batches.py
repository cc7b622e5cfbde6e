"""Which samples each rank trains on at each step, and how a micro-batch is padded and prepared.

A global batch is micro_batch_size x world_size x grad_accum samples of one seeded epoch permutation. Its samples
are dealt to (micro-step, rank) slots by a fixed rule, so a run with 1 process x 2 accumulation steps and a run with
2 processes x 1 step see exactly the same global batches. The last global batch of an epoch is filled with
placeholder copies whose loss weight is zero, so every rank runs the same number of steps and nothing is counted
twice. Anchors are drawn from a generator seeded by (seed, epoch, sample), independent of placement.

With group_by_length > 0 each global batch holds samples of similar length, so little of it is padding: the
epoch permutation is cut into runs of group_by_length global batches, each run is sorted by length, and the
full global batches are then shuffled so that short and long batches alternate through the epoch.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from dflash.train.objective import block_targets, loss_rows, sample_anchors


@dataclass(frozen=True)
class BatchPlan:
    num_samples: int
    micro_batch_size: int
    world_size: int
    grad_accum: int
    seed: int
    group_by_length: int = 0
    # Token count per sample, needed by group_by_length. Compared and hashed through its digest (a plan is a cache
    # key in the online stream, and hashing a long tuple on every lookup would be slow).
    lengths: tuple[int, ...] | None = field(default=None, compare=False, repr=False)
    lengths_digest: str = field(default="", init=False)

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError("the training set is empty: no sample to train on")
        if self.group_by_length < 0:
            raise ValueError(f"group_by_length must be >= 0, got {self.group_by_length}")
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
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = torch.randperm(self.num_samples, generator=generator).tolist()
        if not self.group_by_length:
            return order
        size, run = self.global_batch_size, self.group_by_length * self.global_batch_size
        lengths = self.lengths
        grouped = []
        for start in range(0, len(order), run):
            grouped += sorted(order[start : start + run], key=lambda i: -lengths[i])
        full = len(grouped) // size
        # The partial last batch stays last: micro_batches fills it with placeholders.
        batches = [grouped[b * size : (b + 1) * size] for b in torch.randperm(full, generator=generator).tolist()]
        return [i for batch in batches for i in batch] + grouped[full * size :]

    def micro_batches(self, epoch: int, step: int, rank: int) -> list[list[tuple[int, bool]]]:
        """For this rank and optimizer step: grad_accum lists of (sample index, is_real) pairs."""
        order = self.epoch_order(epoch)
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


def collate(samples: list[dict[str, torch.Tensor]], pin_memory: bool = False) -> dict[str, torch.Tensor]:
    """Right-pad input_ids / loss_mask / hidden (and target_final when the samples have it) to the longest sample.

    Padding has loss_mask 0. The hidden states stay on the device they come from (a colocated target's GPU, or the
    CPU). pin_memory (CUDA only): the padded CPU tensors are allocated in page-locked memory, so the copy to the
    GPU is one asynchronous DMA instead of a staged pageable copy, and costs no second host copy.
    """
    longest = max(s["input_ids"].shape[0] for s in samples)
    batch = len(samples)
    input_ids = torch.zeros(batch, longest, dtype=torch.long, pin_memory=pin_memory)
    loss_mask = torch.zeros(batch, longest, dtype=torch.long, pin_memory=pin_memory)
    padded = {"input_ids": input_ids, "loss_mask": loss_mask}
    for key in ["hidden"] + (["target_final"] if "target_final" in samples[0] else []):
        first = samples[0][key]
        padded[key] = torch.zeros(batch, longest, first.shape[-1], dtype=first.dtype, device=first.device,
                                  pin_memory=pin_memory and first.device.type == "cpu")
    for row, sample in enumerate(samples):
        length = sample["input_ids"].shape[0]
        for key, tensor in padded.items():
            tensor[row, :length] = sample[key]
    return padded


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
    store, slots: list[tuple[int, bool]], *, epoch: int, seed: int, num_anchors: int, block_size: int, gamma: float,
    pin_memory: bool = False,
) -> dict[str, torch.Tensor]:
    """Collated tensors plus anchors, labels and loss weights (zeroed for placeholder samples).

    A store whose samples hold "target_final" (colocated capture with final_hidden=True) passes it on, padded, for
    the KL loss; train_step gathers its rows per block position.

    A store with `get_batch` (colocated capture) hands out the micro-batch already padded: one target forward.
    pin_memory (only when training on CUDA): every CPU tensor of the batch is page-locked, so train_step's copies
    to the GPU are asynchronous (batch_to_device).
    """
    indices = [index for index, _ in slots]
    get_batch = getattr(store, "get_batch", None)
    if get_batch is not None:
        batch, _ = get_batch(indices, pin_memory)
    else:
        batch = collate([store[index] for index in indices], pin_memory)
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
