"""The drafter side of live speculative decoding: context keys/values cached and extended with verified positions.

`DFlashDraftModel.forward` projects the whole context through fc, hidden_norm and every layer's k/v projections on
each call: O(context) work per drafted block. The context of a live decode only grows (verified positions never
change), so this module keeps, per drafter layer, the context keys (after k_norm and RoPE at their absolute
positions) and values, and each step only projects the positions verified since the last one. The block part
repeats the drafter's own attention math with its own modules; `tests/test_eval_live.py` checks that the result
equals `DFlashDraftModel.forward` on the full context (full and sliding layers, context longer than the window).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash.models.drafter import DFlashDraftModel, apply_rotary, sliding_mask_from_positions


class CachedDrafter:
    """Drafts blocks for one sequence (batch 1); `extend` appends verified target features to the cached context."""

    def __init__(self, drafter: DFlashDraftModel) -> None:
        self.drafter = drafter
        self.config = drafter.config
        self.device = next(drafter.parameters()).device
        self.dtype = drafter.fc.weight.dtype
        self.keys: list[torch.Tensor | None] = [None] * len(drafter.layers)
        self.values: list[torch.Tensor | None] = [None] * len(drafter.layers)
        self.length = 0

    @torch.inference_mode()
    def extend(self, features: torch.Tensor) -> None:
        """Append the target features [n, K*H] of the next n positions (length .. length+n-1) to the context."""
        expected = self.config.num_taps * self.config.hidden_size
        if features.dim() != 2 or features.shape[-1] != expected:
            raise ValueError(f"features must be [n, {expected}], got {tuple(features.shape)}")
        n = features.shape[0]
        context = self.drafter.hidden_norm(self.drafter.fc(features.to(self.device, self.dtype)))[None]
        positions = torch.arange(self.length, self.length + n, device=self.device)[None]
        cos, sin = self.drafter.rotary_emb(positions, self.dtype)
        for i, layer in enumerate(self.drafter.layers):
            attn = layer.self_attn
            k = attn.k_norm(attn.k_proj(context).view(1, n, attn.num_kv_heads, attn.head_dim)).transpose(1, 2)
            v = attn.v_proj(context).view(1, n, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
            k = apply_rotary(k, cos, sin)
            self.keys[i] = k if self.keys[i] is None else torch.cat([self.keys[i], k], dim=2)
            self.values[i] = v if self.values[i] is None else torch.cat([self.values[i], v], dim=2)
        self.length += n

    @torch.inference_mode()
    def hidden(self, noise_embedding: torch.Tensor) -> torch.Tensor:
        """Drafter output [size, H] for the block whose embedding is `noise_embedding` [size, H], placed right
        after the cached context (anchor at position `length`)."""
        if self.length == 0:
            raise ValueError("the drafter context is empty: extend() it with the prompt's features first")
        size = noise_embedding.shape[0]
        hidden = noise_embedding.to(self.device, self.dtype)[None]
        block_positions = torch.arange(self.length, self.length + size, device=self.device)[None]
        cos, sin = self.drafter.rotary_emb(block_positions, self.dtype)
        sliding = None
        if self.config.sliding_window is not None:
            all_positions = torch.arange(self.length + size, device=self.device)[None]
            sliding = sliding_mask_from_positions(block_positions, all_positions, self.config.sliding_window)
        for i, layer in enumerate(self.drafter.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attn.q_norm(attn.q_proj(x).view(1, size, attn.num_heads, attn.head_dim)).transpose(1, 2)
            k = attn.k_norm(attn.k_proj(x).view(1, size, attn.num_kv_heads, attn.head_dim)).transpose(1, 2)
            v = attn.v_proj(x).view(1, size, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            k = torch.cat([self.keys[i], k], dim=2)
            v = torch.cat([self.values[i], v], dim=2)
            mask = sliding if attn.layer_type == "sliding_attention" else None
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                 enable_gqa=attn.num_heads != attn.num_kv_heads)
            hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(1, size, attn.num_heads * attn.head_dim))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.drafter.norm(hidden)[0]
