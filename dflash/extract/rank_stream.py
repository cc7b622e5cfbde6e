"""What travels from capture ranks to trainer ranks (capture=online over the job's process group): micro-batch
units in the BatchPlan's order, each a small header and then its tensors.

A *unit* is one micro-batch of one trainer rank: unit u = (global step s, micro-step m, trainer rank r) with
u = (s * grad_accum + m) * trainers + r, so units go in the order training consumes them. Trainer rank r receives
the units u with u % trainers == r, in increasing u. Capture ranks serve groups of consecutive trainer ranks (all
of them, or a node's: rank_link.py); a group's units, numbered in order, go round-robin over its capture ranks
(`maker`), each of which makes its share in increasing u. One group of every trainer rank: capture rank c (of C)
makes the units u with u % C == c.

A unit's header is one int64 tensor of fixed length (both sides know it from the micro batch size):
    [u, tokens, width, dtype code, scale columns, index_0 .. index_{B-1}, length_0 .. length_{B-1}]
then come its tensors: `tokens` int32 [2, tokens] (input_ids and loss_mask of the samples laid end to end), each
sample's `hidden` [length, width] (float32, bfloat16, or fp8 sent as its bytes; one message each, so the trainer
receives it straight into its row of the padded micro-batch) and, for fp8 only, `scales` float32
[tokens, scale columns].
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from dflash.data.batch_plan import BatchPlan
from dflash.data.feature_source import Sample, collate
from dflash.extract.fp8 import FP8_DTYPE
from dflash.extract.sample_format import decode, sample_tensors

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
        return [index for index, _ in self.plan.micro_batches(epoch, in_epoch, rank)[micro]]

    def trainer_of(self, u: int) -> int:
        return u % self.trainers

    def trainer_units(self, rank: int, first_step: int) -> range:
        """Trainer rank `rank`'s units from global step `first_step` on, in order."""
        return range(self.first_unit(first_step) + rank, self.num_units, self.trainers)

    def maker(self, u: int, captures: int, trainers: range | None = None) -> int:
        """Which of the `captures` capture ranks serving the consecutive trainer ranks `trainers` (default: every
        trainer rank) makes unit u of one of them: the group's units go round-robin over its capture ranks in
        order. One group of every trainer rank: u % captures."""
        trainers = range(self.trainers) if trainers is None else trainers
        micro, rank = divmod(u, self.trainers)
        return (micro * len(trainers) + rank - trainers.start) % captures

    def capture_units(self, capture: int, captures: int, first_step: int,
                      trainers: range | None = None) -> Iterator[int]:
        """The units capture rank `capture` (of the `captures` serving `trainers`, as `maker`) makes from global
        step `first_step` on, in order."""
        trainers = range(self.trainers) if trainers is None else trainers
        # v numbers the group's units in order: micro-step by micro-step, its trainer ranks in order.
        start, end = (self.first_unit(first_step) // self.trainers * len(trainers),
                      self.num_units // self.trainers * len(trainers))
        for v in range(start + (capture - start) % captures, end, captures):
            micro, rank = divmod(v, len(trainers))
            yield micro * self.trainers + trainers.start + rank


def header_length(micro_batch_size: int) -> int:
    return _FIXED + 2 * micro_batch_size


def encode_unit(u: int, indices: list[int], samples: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    """[header, tokens, hidden of each sample(, scales)] of unit u from its samples' stored tensors
    (sample_format.sample_tensors: hidden, input_ids, loss_mask and scales for fp8), in the order of `indices`."""
    hidden = [s["hidden"].view(torch.uint8) if s["hidden"].dtype == FP8_DTYPE else s["hidden"] for s in samples]
    lengths = [int(s["input_ids"].shape[0]) for s in samples]
    ids = torch.cat([s["input_ids"] for s in samples]).to(torch.int32)
    mask = torch.cat([s["loss_mask"] for s in samples]).to(torch.int32)
    scales = torch.cat([s["scales"] for s in samples]) if "scales" in samples[0] else None
    header = torch.tensor([u, sum(lengths), hidden[0].shape[1], DTYPE_CODES[samples[0]["hidden"].dtype],
                           0 if scales is None else scales.shape[1], *indices, *lengths], dtype=torch.int64)
    return [header, torch.stack([ids, mask]), *hidden] + ([scales.contiguous()] if scales is not None else [])


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

    def receive(self, recv: Callable[[torch.Tensor], None], device: torch.device, pin_memory: bool = False,
                keep: Callable[[int, dict[str, torch.Tensor]], None] | None = None) -> Sample:
        """The unit's micro-batch, padded as `collate` pads it, its tensors received in the order they are sent by
        `recv(buffer)`: each sample's features straight into its row of the padded batch (fp8: received, then
        dequantised to bfloat16 and padded, as every source gives it). pin_memory: CPU tensors page-locked.
        keep(index, tensors), when given, gets each sample's stored tensors (sample_format.sample_tensors, on the
        CPU) as they came, fp8 still fp8."""
        tokens = torch.empty(2, self.tokens, dtype=torch.int32, device=device)
        recv(tokens)
        starts = [sum(self.lengths[:j]) for j in range(len(self.lengths))]
        if self.dtype == FP8_DTYPE:
            hidden = [torch.empty(n, self.width, dtype=torch.uint8, device=device) for n in self.lengths]
            for buffer in hidden:
                recv(buffer)
            scales = torch.empty(self.tokens, self.scale_columns, dtype=torch.float32, device=device)
            recv(scales)
            rows = [(h.view(FP8_DTYPE), scales[a:a + n]) for a, n, h in zip(starts, self.lengths, hidden, strict=True)]
            self._keep(keep, tokens, starts, rows)
            samples = [decode(tokens[0, a:a + n], tokens[1, a:a + n], h, row_scales)
                       for a, n, (h, row_scales) in zip(starts, self.lengths, rows, strict=True)]
            return collate(samples, pin_memory)
        batch, longest = len(self.lengths), max(self.lengths)
        padded = torch.empty(batch, longest, self.width, dtype=self.dtype, device=device,
                             pin_memory=pin_memory and device.type == "cpu")
        ids = torch.zeros(batch, longest, dtype=torch.long, pin_memory=pin_memory)
        mask = torch.zeros(batch, longest, dtype=torch.long, pin_memory=pin_memory)
        tokens = tokens.cpu()
        for row, (start, length) in enumerate(zip(starts, self.lengths, strict=True)):
            recv(padded[row, :length])  # a row's first `length` positions are contiguous
            padded[row, length:] = 0
            ids[row, :length], mask[row, :length] = tokens[0, start:start + length], tokens[1, start:start + length]
        self._keep(keep, tokens, starts, [(padded[row, :n], None) for row, n in enumerate(self.lengths)])
        return {"input_ids": ids, "loss_mask": mask, "hidden": padded}

    def _keep(self, keep: Callable[[int, dict[str, torch.Tensor]], None] | None, tokens: torch.Tensor,
              starts: list[int], rows: list[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        if keep is None:
            return
        tokens = tokens.cpu()
        for index, start, length, (hidden, scales) in zip(self.indices, starts, self.lengths, rows, strict=True):
            keep(index, sample_tensors(hidden.cpu(), tokens[0, start:start + length], tokens[1, start:start + length],
                                       torch.tensor([0, length]), None if scales is None else scales.cpu(),
                                       what=f"sample {index} of micro-batch {self.unit}"))
