"""The block-sparse training mask as FlexAttention BlockMasks, built from the anchors without a dense grid.

Same rule as `objective.block_attention_masks` (method.md §4): keys are [context 0..C-1 ++ blocks]; a query of
block j (anchor a_j, offset k, position a_j + k) sees context c iff c < a_j, sees keys of its own block only
(all of them in full layers; offsets <= k in sliding layers), and in sliding layers only keys with
query_pos - key_pos < window.

A BlockMask has two parts. The tile lists say which (query tile, key tile) pairs can hold a visible key and which
are visible everywhere; they are computed here per tile from the smallest and largest anchor of each query tile,
so the cost is (query tiles x key tiles), never (queries x keys). Inside a partial tile the `mask_mod` decides per
element. The tile lists may over-include (the mask_mod then hides the extra keys) but must never leave out a tile
with a visible key nor call a tile full when it is not: tests check both against the dense mask.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

DEFAULT_TILE = 128  # the tile size the CUDA flex kernels are tuned for


def _mask_mod(anchors: torch.Tensor, context_len: int, block_size: int, window: int | None):
    last_block = anchors.shape[1] - 1
    # A tensor, not an int: the compiled kernel would specialise (recompile) on every new padded length.
    # Filled on the device: a tensor built from a host value is a host-to-device copy, which waits for the GPU.
    context_len = torch.full((), context_len, dtype=torch.long, device=anchors.device)

    def mask_mod(b, h, q_idx, kv_idx):
        # Clamped: kernels may evaluate the padding rows of the last query tile.
        block = (q_idx // block_size).clamp(max=last_block)
        offset = q_idx % block_size
        anchor = anchors[b, block]
        in_context = kv_idx < context_len
        key_in_block = (kv_idx - context_len).clamp(min=0)
        same_block = key_in_block // block_size == block
        key_offset = key_in_block % block_size
        if window is None:
            return (in_context & (kv_idx < anchor)) | (~in_context & same_block)
        query_pos = anchor + offset
        sees_context = in_context & (kv_idx < anchor) & (query_pos - kv_idx < window)
        distance = offset - key_offset
        sees_block = ~in_context & same_block & (distance >= 0) & (distance < window)
        return sees_context | sees_block

    return mask_mod


def _tile_lists(anchors: torch.Tensor, context_len: int, block_size: int, window: int | None,
                tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial [b, q_tiles, kv_tiles] bool, full [b, q_tiles, kv_tiles] bool) from per-tile anchor bounds."""
    batch, num_anchors = anchors.shape
    num_queries = num_anchors * block_size
    q_tiles = -(-num_queries // tile)
    kv_len = context_len + num_queries
    kv_tiles = -(-kv_len // tile)
    device = anchors.device

    # Smallest and largest anchor over the queries of each query tile.
    query_anchor = anchors.repeat_interleave(block_size, dim=1)  # [b, Q]
    # The padding rows of the last tile repeat the last real query's anchor, which moves neither bound.
    pad = query_anchor[:, -1:].expand(batch, q_tiles * tile - num_queries)
    per_tile = torch.cat([query_anchor, pad], dim=1).view(batch, q_tiles, tile)
    a_min = per_tile.amin(-1)[:, :, None]
    a_max = per_tile.amax(-1)[:, :, None]

    kv_start = torch.arange(kv_tiles, device=device) * tile
    kv_end = (kv_start + tile).clamp(max=kv_len)  # exclusive
    ctx_end = kv_end.clamp(max=context_len)  # exclusive end of the context keys in the tile
    has_context = (kv_start < context_len)[None, None]
    has_blocks = (kv_end > context_len)[None, None]

    # Context keys: visible somewhere iff some key < some anchor (and, sliding, within the window of some query).
    ctx_any = has_context & (kv_start[None, None] < a_max)
    ctx_all = has_context & ~has_blocks & (ctx_end[None, None] - 1 < a_min)
    if window is not None:
        ctx_any &= a_min - (ctx_end[None, None] - 1) < window
        ctx_all &= (a_max + block_size - 1) - kv_start[None, None] < window

    # Block keys: the keys of the blocks that the tile's queries belong to (a block may straddle two tiles).
    first_query = torch.arange(q_tiles, device=device)[:, None] * tile
    last_query = (first_query + tile).clamp(max=num_queries) - 1
    own_start = context_len + first_query // block_size * block_size
    own_end = context_len + (last_query // block_size + 1) * block_size  # exclusive
    own = (kv_start[None] < own_end) & (kv_end[None] > own_start)  # [q_tiles, kv_tiles]
    blk_any = has_blocks & own[None]

    full = ctx_all
    partial = (ctx_any | blk_any) & ~full
    return partial.expand(batch, -1, -1), full.expand(batch, -1, -1)


def _as_indices(present: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """BlockMask's (num_blocks [b, 1, q_tiles], indices [b, 1, q_tiles, kv_tiles]) with present tiles first."""
    counts = present.sum(-1, dtype=torch.int32)
    order = torch.argsort((~present).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts[:, None].contiguous(), order[:, None].contiguous()


def flex_block_masks(
    anchors: torch.Tensor,
    context_len: int,
    block_size: int,
    layer_types: list[str],
    sliding_window: int | None,
    tile: int = DEFAULT_TILE,
) -> dict[str, BlockMask]:
    """One BlockMask per layer type for queries [batch, N*B] and keys [context_len + N*B] (see module doc)."""
    anchors = anchors.long().contiguous()
    masks = {}
    for layer_type in sorted(set(layer_types)):
        if layer_type == "full_attention":
            window = None
        elif layer_type == "sliding_attention":
            if sliding_window is None:
                raise ValueError("a sliding_attention layer needs sliding_window, got None")
            window = sliding_window
        else:
            raise ValueError(f"unknown layer type {layer_type!r}")
        partial, full = _tile_lists(anchors, context_len, block_size, window, tile)
        kv_num, kv_idx = _as_indices(partial)
        full_num, full_idx = _as_indices(full)
        num_queries = anchors.shape[1] * block_size
        masks[layer_type] = BlockMask.from_kv_blocks(
            kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=tile,
            mask_mod=_mask_mod(anchors, context_len, block_size, window),
            seq_lengths=(num_queries, context_len + num_queries),
        )
    return masks
