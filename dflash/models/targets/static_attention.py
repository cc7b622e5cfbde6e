"""The attention of the static engines (static_decode.py, static_target.py) over their KV caches: the additive masks
of a forward, one per distinct sliding window of the target's layers, and the attention itself (SDPA, or HF eager's
order of operations for soft-capped logits).

A key at position p is visible to the query at position q iff p <= q and, in a layer with sliding window w,
q - w < p: transformers' sliding-window masks (`sliding_window_overlay`: kv_idx > q_idx - w). The engines keep
every layer's cache full length and mask, so a window is only a mask; the masks are built once per forward, before
the layers, so a dense target without windows builds the one causal mask it always did.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def visibility_masks(columns: torch.Tensor, positions: torch.Tensor, windows: tuple[int | None, ...],
                     dtype: torch.dtype) -> dict[int | None, torch.Tensor]:
    """Per window in `windows` (None: full attention), the additive mask [*positions.shape, len(columns)] of queries
    at `positions` over the keys of cache `columns` (column c holds position c): 0 where visible, -inf elsewhere."""
    query = positions[..., None]
    causal = columns <= query
    masks = {}
    for window in windows:
        visible = causal if window is None else causal & (columns > query - window)
        masks[window] = torch.zeros(visible.shape, device=visible.device, dtype=dtype).masked_fill_(
            ~visible, float("-inf"))
    return masks


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scaling: float,
              softcap: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scaling + mask) v over the last two axes; `mask` None is the causal mask of a forward from
    position 0. With `softcap`, the logits are capped (softcap * tanh(logits / softcap)) before the mask, in HF
    eager attention's order (SDPA has no cap); that needs an explicit mask."""
    if softcap is None:
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
    if mask is None:
        raise ValueError("soft-capped attention needs an explicit mask")
    logits = torch.matmul(q, k.transpose(-1, -2)) * scaling
    logits = torch.tanh(logits / softcap) * softcap + mask
    return torch.matmul(torch.softmax(logits, dim=-1, dtype=torch.float32).to(q.dtype), v)
