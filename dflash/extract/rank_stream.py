"""What travels from capture ranks to trainer ranks (capture=online over the job's process group): micro-batch
units in the BatchPlan's order, each a small header and then its tensors.

A *unit* is one micro-batch of one trainer rank: unit u = (global step s, micro-step m, trainer rank r) with
u = (s * grad_accum + m) * trainers + r, so units go in the order training consumes them. Capture rank c (of C)
makes the units u with u % C == c, in increasing u; trainer rank r receives the units u with u % trainers == r,
in increasing u, each from capture rank u % C.

A unit's header is one int64 tensor of fixed length (both sides know it from the micro batch size):
    [u, tokens, width, dtype code, scale columns, index_0 .. index_{B-1}, length_0 .. length_{B-1}]
then come its tensors: `tokens` int32 [2, tokens] (input_ids and loss_mask of the samples laid end to end),
`hidden` [tokens, width] (float32, bfloat16, or fp8 sent as its bytes) and, for fp8 only, `scales` float32
[tokens, scale columns].
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from dflash.data.batch_plan import BatchPlan
from dflash.data.feature_source import Sample
from dflash.extract.fp8 import FP8_DTYPE
from dflash.extract.sample_format import decode

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, FP8_DTYPE: 2}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
_FIXED = 5  # u, tokens, width, dtype code, scale columns


@dataclass(frozen=True)
class UnitStream:
    """Every micro-batch of `epochs` passes of `plan` (placeholders included) as numbered units."""

    plan: BatchPlan
    epochs: int

    @property
    def trainers(self) -> int:
        return self.plan.world_size

    @property
    def units_per_step(self) -> int:
        return self.plan.grad_accum * self.plan.world_size

    @property
    def num_units(self) -> int:
        return self.epochs * self.plan.steps_per_epoch * self.units_per_step

    def first_unit(self, step: int) -> int:
        """The first unit of global step `step` (where a run resumed at that step starts)."""
        return step * self.units_per_step

    def indices(self, u: int) -> list[int]:
        """The sample indices of unit u, as BatchPlan.micro_batches deals them (placeholders included)."""
        if not 0 <= u < self.num_units:
            raise IndexError(f"unit {u} out of range for a stream of {self.num_units} micro-batches")
        step, rest = divmod(u, self.units_per_step)
        micro, rank = divmod(rest, self.trainers)
        epoch, in_epoch = divmod(step, self.plan.steps_per_epoch)
        return [index for index, _ in _micro_batches(self.plan, epoch, in_epoch, rank)[micro]]

    def trainer_of(self, u: int) -> int:
        return u % self.trainers

    def trainer_units(self, rank: int, first_step: int) -> range:
        """Trainer rank `rank`'s units from global step `first_step` on, in order."""
        return range(self.first_unit(first_step) + rank, self.num_units, self.trainers)

    def capture_units(self, capture: int, captures: int, first_step: int) -> range:
        """Capture rank `capture`'s (of `captures`) units from global step `first_step` on, in order."""
        start = self.first_unit(first_step)
        return range(start + (capture - start) % captures, self.num_units, captures)


@lru_cache(maxsize=8)
def _micro_batches(plan: BatchPlan, epoch: int, step: int, rank: int) -> list[list[tuple[int, bool]]]:
    return plan.micro_batches(epoch, step, rank)


def header_length(micro_batch_size: int) -> int:
    return _FIXED + 2 * micro_batch_size


def encode_unit(u: int, indices: list[int], samples: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    """[header, tokens, hidden(, scales)] of unit u from its samples' stored tensors (sample_format.sample_tensors:
    hidden, input_ids, loss_mask and scales for fp8), in the order of `indices`."""
    hidden = torch.cat([s["hidden"] for s in samples])
    lengths = [int(s["input_ids"].shape[0]) for s in samples]
    ids = torch.cat([s["input_ids"] for s in samples]).to(torch.int32)
    mask = torch.cat([s["loss_mask"] for s in samples]).to(torch.int32)
    scales = torch.cat([s["scales"] for s in samples]) if "scales" in samples[0] else None
    header = torch.tensor([u, hidden.shape[0], hidden.shape[1], DTYPE_CODES[hidden.dtype],
                           0 if scales is None else scales.shape[1], *indices, *lengths], dtype=torch.int64)
    payload = [header, torch.stack([ids, mask]), hidden.view(torch.uint8) if hidden.dtype == FP8_DTYPE else hidden]
    return payload + ([scales.contiguous()] if scales is not None else [])


@dataclass(frozen=True)
class UnitHeader:
    unit: int
    tokens: int
    width: int
    dtype: torch.dtype
    scale_columns: int
    indices: list[int]
    lengths: list[int]

    @classmethod
    def parse(cls, header: torch.Tensor) -> UnitHeader:
        values = header.tolist()
        size = (len(values) - _FIXED) // 2
        return cls(values[0], values[1], values[2], CODE_DTYPES[values[3]], values[4], values[_FIXED:_FIXED + size],
                   values[_FIXED + size:])

    def empty_tensors(self, device: torch.device) -> list[torch.Tensor]:
        """The buffers its tensors are received into, in the order they are sent."""
        hidden_dtype = torch.uint8 if self.dtype == FP8_DTYPE else self.dtype
        tensors = [torch.empty(2, self.tokens, dtype=torch.int32, device=device),
                   torch.empty(self.tokens, self.width, dtype=hidden_dtype, device=device)]
        if self.scale_columns:
            tensors.append(torch.empty(self.tokens, self.scale_columns, dtype=torch.float32, device=device))
        return tensors

    def samples(self, tensors: list[torch.Tensor]) -> list[Sample]:
        """The unit's samples from its received tensors (fp8 dequantised to bfloat16, as every source gives it)."""
        tokens, hidden = tensors[0], tensors[1]
        if self.dtype == FP8_DTYPE:
            hidden = hidden.view(FP8_DTYPE)
        scales = tensors[2] if self.scale_columns else None
        samples, start = [], 0
        for length in self.lengths:
            end = start + length
            samples.append(decode(tokens[0, start:end], tokens[1, start:end], hidden[start:end],
                                  None if scales is None else scales[start:end]))
            start = end
        return samples
