"""Decode attention over each row's own keys in a static KV cache: flex_attention with a block mask per step.

The regeneration engine (dflash/inference/static_decode.py) decodes 1,024 rows at once, each at its own column.
With SDPA and an additive mask every row reads the cache up to the step's span, the longest row's column: on an
H200 at SmolLM2's shape that is 0.47 ms per layer whether rows hold 100 keys or 1,280, and attention is most of the
step. flex_attention reads only the KV blocks a row's BlockMask lists: the blocks wholly inside the row's keys
without a mask, the one or two blocks the range cuts through the mask (bench/decode_attention.py: half the time
per layer at rows of mixed lengths, docs/results/2026-12-05-decode-attention-h200/). One CUDA graph then serves
every span, since the shapes no longer change with it. Sliding windows are a range that starts later; soft-capped
logits (Gemma 2) a score_mod. It sits beside static_attention.py, the masked SDPA attention it replaces.

On CUDA the attention runs compiled (Triton's flex-decoding kernel); on the CPU it runs eager (the reference
implementation, which materialises the scores: a correctness path for tests, not a fast one).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from dflash.config.schema import DECODE_ATTENTIONS
from dflash.inductor_settings import raise_recompile_limit

# KV block of the BlockMask: a row reads at most one block past its column. 64 beat 128 at rows of mixed lengths.
FLEX_BLOCK = 64
# Compiled graphs of the flex wrapper (one per rows x cache length x dtype x soft cap): a regeneration retried
# prompt by prompt makes one per rounded length, a bench sweeps batch sizes.
RECOMPILE_LIMIT = 64


def resolve_attention(attention: str, layout) -> str:
    """"sdpa" or "flex" for a requested decode attention: "auto" is flex on a CUDA target, else sdpa."""
    if attention not in DECODE_ATTENTIONS:
        raise ValueError(f"attention must be one of {DECODE_ATTENTIONS}, got {attention!r}")
    if attention == "auto":
        return "flex" if layout.device.type == "cuda" else "sdpa"
    return attention


def _row_flex_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, score_mod: Callable | None,
                        block_mask: BlockMask, scale: float) -> torch.Tensor:
    return flex_attention(q, keys, values, score_mod=score_mod, block_mask=block_mask, scale=scale)


@functools.cache
def _flex(device_type: str) -> Callable:
    """flex attention for the device: compiled on CUDA, eager elsewhere. The compiled function has its own code
    object, so its compiled graphs (one per shape and score_mod) count against their own recompile limit, which is
    raised; fullgraph makes reaching it an error rather than a silent fall back to the unfused eager kernel."""
    if device_type != "cuda":
        return _row_flex_attention
    raise_recompile_limit(RECOMPILE_LIMIT)
    return torch.compile(_row_flex_attention, dynamic=False, fullgraph=True)


def _soft_cap(cap: float) -> Callable:
    def capped(score, b, h, q, kv):
        return torch.tanh(score / cap) * cap
    return capped


class RowPrefixAttention:
    """Attention of one query token per row (its query heads folded per KV head, [rows, kv, groups, D]) over the
    keys a row's query sees in a cache [rows, kv, length, D] whose rows sit at different columns: columns
    0..column[row], or in a layer with sliding window w the last w of them (column - w < p <= column); the logits
    soft-capped (softcap * tanh(logit / softcap)) when the target has an attention soft cap.

    One BlockMask per window, made here over preallocated block lists; `update(column)` rewrites the lists in place
    for a step (device ops only, no host sync: it lives in the CUDA graph of the step, and a compiled step sees the
    same objects at every call); `__call__` attends with the mask of the layer's window."""

    def __init__(self, rows: int, kv_heads: int, groups: int, length: int, device: torch.device,
                 windows: tuple[int | None, ...] = (None,), softcap: float | None = None,
                 block: int = FLEX_BLOCK) -> None:
        if length % block:
            raise ValueError(f"cache length {length} is not a multiple of the flex block {block}")
        self.rows, self.length, self.block = rows, length, block
        self.softcap = softcap
        self.score_mod = None if softcap is None else _soft_cap(softcap)
        self.attend = _flex(device.type)
        blocks = length // block
        # Keys visible to each row (column + 1), and per window the first one: the mask functions read them.
        self.visible = torch.ones(rows, device=device, dtype=torch.long)
        self.order = torch.arange(blocks, device=device, dtype=torch.int32).expand(rows, 1, 1, blocks).contiguous()
        self.lists: dict[int | None, tuple[torch.Tensor, ...]] = {}
        self.block_masks: dict[int | None, BlockMask] = {}
        for window in windows:
            first = torch.zeros(rows, device=device, dtype=torch.long)
            counts = [torch.zeros(rows, 1, 1, device=device, dtype=torch.int32) for _ in range(2)]
            indices = [torch.zeros(rows, 1, 1, blocks, device=device, dtype=torch.int32) for _ in range(2)]
            self.lists[window] = (first, counts[0], indices[0], counts[1], indices[1])
            self.block_masks[window] = BlockMask.from_kv_blocks(
                counts[0], indices[0], counts[1], indices[1], BLOCK_SIZE=block, mask_mod=self._mask_mod(first),
                seq_lengths=(groups, length), compute_q_blocks=False)

    def _mask_mod(self, first: torch.Tensor) -> Callable:
        def visible(b, h, q, kv):
            return (kv < self.visible[b]) & (kv >= first[b])
        return visible

    def update(self, column: torch.Tensor) -> None:
        """The block masks of a step whose rows write their new key at `column` [rows] and attend up to it."""
        torch.add(column, 1, out=self.visible)
        for window, (first, partial, partial_order, full, full_order) in self.lists.items():
            if window is not None:
                torch.clamp(self.visible - window, min=0, out=first)
            self._write_lists(first, partial, partial_order, full, full_order)

    def _write_lists(self, first: torch.Tensor, partial: torch.Tensor, partial_order: torch.Tensor,
                     full: torch.Tensor, full_order: torch.Tensor) -> None:
        # Keys [first, visible) of each row: the blocks wholly inside are read without the mask; the block holding
        # `first` and the one holding the last key are read through it when the range cuts them (one block when
        # both cuts fall in the same block). Entries past a row's counts are never read, but stay valid indices.
        block, rows, last_block = self.block, self.rows, self.length // self.block - 1
        low = torch.div(first + block - 1, block, rounding_mode="floor")       # first whole block
        high = torch.div(self.visible, block, rounding_mode="floor")           # one past the last whole block
        full.copy_((high - low).clamp_(min=0).view(rows, 1, 1))
        head_cut = first % block != 0
        tail_cut = (self.visible % block != 0) & ~(head_cut & (first // block == high))
        partial.copy_((head_cut.int() + tail_cut.int()).view(rows, 1, 1))
        # A row's partial blocks in order: the head block (when cut), then the tail block (when cut).
        head = torch.where(head_cut, first // block, high).view(rows, 1, 1, 1)
        partial_order.copy_(torch.where(self.order == 0, head, high.view(rows, 1, 1, 1)).clamp_(max=last_block))
        full_order.copy_((self.order + low.view(rows, 1, 1, 1)).clamp_(max=last_block))

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
                 window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """q [rows, kv, groups, D] over keys and values [rows, kv, length, D] -> [rows, kv, groups, D]; `window`
        and `softcap` are the layer's (the soft cap must be the one this attention was made with)."""
        if softcap != self.softcap:
            raise ValueError(f"a layer passed the attention soft cap {softcap}; this attention was made for "
                             f"{self.softcap}")
        return self.attend(q, keys, values, self.score_mod, self.block_masks[window], scaling)
