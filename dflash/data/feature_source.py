"""What the trainer reads its features from: the FeatureSource protocol, one for every capture mode.

A *sample* is row i of the token dataset with the target's features at the drafter's taps, a dict of tensors:
    "input_ids"    LongTensor [T]
    "loss_mask"    LongTensor [T]      1 on the response tokens the drafter learns
    "hidden"       Tensor [T, K*H]     the K taps side by side, in target_layer_ids order (bfloat16 or float32;
                                       fp8 stores are dequantised to bfloat16 on read)
    "target_final" Tensor [T, H]       only when the source makes it (colocated capture for the KL loss)
A micro-batch is its samples right-padded to the longest one (`collate`): zeros, loss_mask 0 on the padding.

The trainer asks for micro-batches in the order its BatchPlan fixes (dflash/data/batch_plan.py: every slot of
every global batch of every epoch, placeholders included), from the step it resumes at, and calls
`verify_features(leave=k)` after each optimizer step: the checks of the batches that step trained on, not of the k
it made ahead for the next step (train.prepare_ahead, dflash/train/step_batches.py: during a step's backward, and
dropped when the run ends first). A source may rely on that order (the online stream is produced in it and refuses
another: its `serves_ahead()` is False, so none are made ahead); a random-access source (the offline store,
colocated capture) serves any order.

Resume: a source is built for the run as it restarts, and the trainer's first request is the first micro-batch of
the step it resumes at. A random-access source needs nothing for that; a streaming source must begin its stream
there (online capture names the resumed step to the capture ranks before they capture). No sample may be lost or
served twice across a restart.

Verification: a source whose features are checked when they are made (colocated capture: finite, not constant)
may defer a check so the host never waits for the device mid-step; `verify_features` raises ValueError naming
the sample and tap. Sources checked as they are read (the store's shard hashes) have nothing pending.

The sources: FeatureStore (offline, dflash/extract/store.py), LinkedFeatureSource (online: micro-batches received
from the job's capture ranks, dflash/extract/linked_source.py), ColocatedFeatureSource (the target on the trainer's
device, dflash/extract/colocated.py); a list of samples in memory (tests, benchmarks) is one through
`as_feature_source`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

Sample = dict[str, torch.Tensor]


def collate(samples: Sequence[Sample], pin_memory: bool = False) -> Sample:
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


@runtime_checkable
class FeatureSource(Protocol):
    """Samples by dataset row, read as micro-batches (the module docstring has the contract).

    A source subclasses this protocol explicitly; `micro_batch` and `verify_features` have the defaults that fit a
    source of single samples checked as they are read.
    """

    def __len__(self) -> int:
        """The number of samples: the dataset's rows, which the BatchPlan deals out."""
        ...

    def __getitem__(self, index: int) -> Sample:
        """Sample `index`, checked."""
        ...

    def micro_batch(self, indices: Sequence[int], pin_memory: bool = False) -> Sample:
        """The samples `indices` right-padded as `collate` pads them. pin_memory: CPU tensors page-locked."""
        return collate([self[index] for index in indices], pin_memory)

    def serves_ahead(self) -> bool:
        """Whether the trainer may ask for the next step's micro-batches during the current step (StepBatches)."""
        return True

    def verify_features(self, leave: int = 0) -> None:
        """Raise ValueError for features handed out whose deferred check failed (none pending: nothing); the checks
        of the `leave` micro-batches handed out last stay pending."""

    def kept_apart(self, order: Sequence[int], kept: int | None = None) -> int:
        """How many samples at the front of the first epoch's `order` this source keeps for the later epochs, where a
        micro-batch of kept samples alone costs less than one of the others (BatchPlan.kept: the later epochs batch
        them apart): `kept` when given (what a resumed run's start chose: its plan follows it whatever the source
        keeps now), else as many as the source can keep; 0 where none are kept apart. Most sources cost the same for
        every sample: they choose 0."""
        return kept or 0


class SampleList(FeatureSource):
    """Samples held in memory (a list of sample dicts, or any sequence of them) as a FeatureSource."""

    def __init__(self, samples: Sequence[Sample]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Sample:
        return self.samples[index]


def as_feature_source(samples: FeatureSource | Sequence[Sample]) -> FeatureSource:
    """`samples` itself when it is a FeatureSource, else its samples as a SampleList."""
    return samples if isinstance(samples, FeatureSource) else SampleList(samples)
