"""Decode attention over each row's own prefix of a static KV cache: flex_attention with a block mask per step.

The regeneration engine (static_decode.py) decodes 1,024 rows at once, each at its own column. With SDPA and an
additive mask every row reads the cache up to the step's span, the longest row's column: on an H200 at SmolLM2's
shape that is 0.47 ms per layer whether rows hold 100 keys or 1,280, and attention is most of the step. flex_attention
reads only the KV blocks a row's BlockMask lists: the blocks wholly inside the row's keys without a mask, the one or
two blocks the range cuts through the mask (bench/decode_attention.py: half the time per layer at rows of mixed
lengths, docs/results/2026-12-05-decode-attention-h200/). One CUDA graph then serves every span, since the shapes
no longer change with it. Sliding windows are a range that starts later; soft-capped logits (Gemma 2) a score_mod.

On CUDA the attention runs compiled (Triton's flex-decoding kernel); on the CPU it runs eager (the reference
implementation, which materialises the scores: a correctness path for tests, not a fast one).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from dflash.config.schema import DECODE_ATTENTIONS
# KV block of the BlockMask: a row reads at most one block past its column. 64 beat 128 at rows of mixed lengths.
FLEX_BLOCK = 64


def resolve_attention(attention: str, layout) -> str:
    """"sdpa" or "flex" for a requested decode attention: "auto" is flex on a CUDA target, else sdpa."""
    if attention not in DECODE_ATTENTIONS:
        raise ValueError(f"attention must be one of {DECODE_ATTENTIONS}, got {attention!r}")
    if attention == "auto":
        return "flex" if layout.device.type == "cuda" else "sdpa"
    return attention


@functools.cache
def _flex(device_type: str) -> Callable:
    if device_type == "cuda":
        return torch.compile(flex_attention, dynamic=False)
    return flex_attention


class RowPrefixAttention:
    """Attention of one query token per row (its query heads folded per KV head, [rows, kv, groups, D]) over the
    keys a row's query sees in a cache [rows, kv, length, D] whose rows sit at different columns: columns
    0..column[row], or in a layer with sliding window w the last w of them (column - w < p <= column), the logits
    soft-capped (cap * tanh(logit / cap)) where the layer passes a cap.

    `update(column)` writes the step's block masks, one per window in `windows` (device ops only, no host sync, so
    it can live in a CUDA graph); `__call__` attends with the mask of the layer's window."""

    def __init__(self, rows: int, kv_heads: int, groups: int, length: int, device: torch.device,
                 windows: tuple[int | None, ...] = (None,), block: int = FLEX_BLOCK) -> None:
        if length % block:
            raise ValueError(f"cache length {length} is not a multiple of the flex block {block}")
        self.rows, self.groups, self.length, self.block = rows, groups, length, block
        self.attend = _flex(device.type)
        # Keys visible to each row (column + 1), and the first one per window: the mask functions read them, so
        # one function per window serves every step.
        self.visible = torch.ones(rows, device=device, dtype=torch.long)
        self.first = {window: torch.zeros(rows, device=device, dtype=torch.long) for window in windows}
        self.mask_mods = {window: self._mask_mod(self.first[window]) for window in windows}
        self.order = torch.arange(length // block, device=device, dtype=torch.int32).expand(rows, 1, 1, -1).contiguous()
        self.block_masks: dict[int | None, BlockMask] = {}
        self.score_mods: dict[float, Callable] = {}

    def _mask_mod(self, first: torch.Tensor) -> Callable:
        def visible(b, h, q, kv):
            return (kv < self.visible[b]) & (kv >= first[b])
        return visible

    def update(self, column: torch.Tensor) -> None:
        """The block masks of a step whose rows write their new key at `column` [rows] and attend up to it."""
        torch.add(column, 1, out=self.visible)
        for window, first in self.first.items():
            if window is not None:
                torch.clamp(self.visible - window, min=0, out=first)
            self.block_masks[window] = self._block_mask(first, self.mask_mods[window])

    def _block_mask(self, first: torch.Tensor, mask_mod: Callable) -> BlockMask:
        # Keys [first, visible) of each row: the blocks wholly inside are read without the mask; the block holding
        # `first` and the one holding the last key are read through it when the range cuts them (one block when
        # both cuts fall in the same block).
        block, rows, last_block = self.block, self.rows, self.length // self.block - 1
        low = torch.div(first + block - 1, block, rounding_mode="floor")       # first whole block
        high = torch.div(self.visible, block, rounding_mode="floor")           # one past the last whole block
        full = (high - low).clamp_(min=0).to(torch.int32).view(rows, 1, 1)
        head_cut = first % block != 0
        tail_cut = (self.visible % block != 0) & ~(head_cut & (first // block == high))
        partial = (head_cut.to(torch.int32) + tail_cut.to(torch.int32)).view(rows, 1, 1)
        # A row's partial blocks in order: the head block (when cut), then the tail block (when cut).
        head = torch.where(head_cut, first // block, high).to(torch.int32)
        partial_order = torch.where(self.order == 0, head.view(rows, 1, 1, 1), high.to(torch.int32).view(rows, 1, 1, 1))
        full_order = (self.order + low.to(torch.int32).view(rows, 1, 1, 1)).clamp_(max=last_block)
        return BlockMask.from_kv_blocks(partial, partial_order.clamp_(max=last_block), full, full_order,
                                        BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(self.groups, self.length),
                                        compute_q_blocks=False)

    def _score_mod(self, softcap: float) -> Callable:
        if softcap not in self.score_mods:
            def capped(score, b, h, q, kv):
                return torch.tanh(score / softcap) * softcap
            self.score_mods[softcap] = capped
        return self.score_mods[softcap]

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
                 window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """q [rows, kv, groups, D] over keys and values [rows, kv, length, D] -> [rows, kv, groups, D]."""
        score_mod = None if softcap is None else self._score_mod(softcap)
        return self.attend(q, keys, values, score_mod=score_mod, block_mask=self.block_masks[window], scale=scaling)
