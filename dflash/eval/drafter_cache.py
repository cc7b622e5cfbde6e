"""Drafting from cached context keys/values: the live decoder's growing context and the replay's batched blocks.

`DFlashDraftModel.forward` projects the whole context through fc, hidden_norm and every layer's k/v projections on
each call: O(context) work per drafted block. Verified positions never change, so their keys (after k_norm and
RoPE at their absolute positions) and values can be computed once per position (`context_keys_values`) and each
drafted block only runs its own tokens through the layers (`block_hidden`). The block part repeats the drafter's
own attention math with its own modules; `tests/test_eval_live.py` and `tests/test_eval.py` check that the result
equals `DFlashDraftModel.forward` on the full context (full and sliding layers, context longer than the window,
left-padded batches).
- `CachedDrafter`: one live sequence; `extend` appends the positions verified since the last step.
- `DrafterProposer` (replay.py): many stored sequences; keys/values of all their positions are computed once and
  each step gathers the context of its rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash.models.drafter import DFlashDraftModel, apply_rotary, sliding_mask_from_positions

# Per drafter layer: (keys [b, kv_heads, n, head_dim] after k_norm + RoPE, values [b, kv_heads, n, head_dim]).
KeysValues = list[tuple[torch.Tensor, torch.Tensor]]


@torch.inference_mode()
def context_keys_values(drafter: DFlashDraftModel, features: torch.Tensor, positions: torch.Tensor) -> KeysValues:
    """Every layer's context keys/values of target features [b, n, K*H] at absolute positions [b, n]."""
    check_features(drafter.config, features, batched=True)
    dtype = drafter.fc.weight.dtype
    context = drafter.hidden_norm(drafter.fc(features.to(drafter.fc.weight.device, dtype)))
    cos, sin = drafter.rotary_emb(positions, dtype)
    return [_keys_values(layer.self_attn, context, cos, sin) for layer in drafter.layers]


def _keys_values(attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One drafter layer's keys (k_norm, then RoPE) and values [b, kv_heads, n, head_dim] of inputs x [b, n, H]."""
    batch, n, _ = x.shape
    k = attn.k_norm(attn.k_proj(x).view(batch, n, attn.num_kv_heads, attn.head_dim)).transpose(1, 2)
    v = attn.v_proj(x).view(batch, n, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    return apply_rotary(k, cos, sin), v


@torch.inference_mode()
def block_hidden(
    drafter: DFlashDraftModel,
    noise_embedding: torch.Tensor,
    block_positions: torch.Tensor,
    context: KeysValues,
    context_positions: torch.Tensor,
    context_valid: torch.Tensor | None = None,
    block_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Drafter output [b, S, H] of blocks with embeddings [b, S, H] at positions [b, S] after cached context.

    context: keys/values of C context columns per row (context_keys_values), at positions context_positions
    [b, C]; context_valid [b, C] and block_valid [b, S] (None = all valid) mask out padding columns as keys in
    every layer (a padded block position still gets an output, which means nothing).
    """
    dtype = drafter.fc.weight.dtype
    hidden = noise_embedding.to(drafter.fc.weight.device, dtype)
    batch, size, _ = hidden.shape
    cos, sin = drafter.rotary_emb(block_positions, dtype)
    full = None
    if context_valid is not None or block_valid is not None:
        device = context_positions.device
        if context_valid is None:
            context_valid = torch.ones(context_positions.shape, dtype=torch.bool, device=device)
        if block_valid is None:
            block_valid = torch.ones(batch, size, dtype=torch.bool, device=device)
        full = torch.cat([context_valid, block_valid], dim=1)[:, None, None, :]
    sliding = None
    if drafter.config.sliding_window is not None:
        key_positions = torch.cat([context_positions, block_positions], dim=1)
        sliding = sliding_mask_from_positions(block_positions, key_positions, drafter.config.sliding_window)
        if full is not None:
            sliding = sliding & full
    for layer, (context_keys, context_values) in zip(drafter.layers, context):
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        q = attn.q_norm(attn.q_proj(x).view(batch, size, attn.num_heads, attn.head_dim)).transpose(1, 2)
        q = apply_rotary(q, cos, sin)
        k, v = _keys_values(attn, x, cos, sin)
        k = torch.cat([context_keys, k], dim=2)
        v = torch.cat([context_values, v], dim=2)
        mask = sliding if attn.layer_type == "sliding_attention" else full
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=attn.num_heads != attn.num_kv_heads)
        hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(batch, size, attn.num_heads * attn.head_dim))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return drafter.norm(hidden)


def check_features(config, features: torch.Tensor, batched: bool = False) -> None:
    """ValueError unless `features` [n, K*H] (batched: [b, n, K*H]) are target features of the drafter `config`'s
    taps."""
    expected = config.num_taps * config.hidden_size
    dims, leading = (3, "batch, n") if batched else (2, "n")
    if features.dim() != dims or features.shape[-1] != expected:
        raise ValueError(f"features must be [{leading}, {expected}], got {tuple(features.shape)}")


def check_context(length: int) -> None:
    """ValueError when a block would be drafted from an empty context."""
    if length == 0:
        raise ValueError("the drafter context is empty: extend() it with the prompt's features first")


class CachedDrafter:
    """Drafts blocks for one sequence (batch 1); `extend` appends verified target features to the cached context."""

    def __init__(self, drafter: DFlashDraftModel) -> None:
        self.drafter = drafter
        self.config = drafter.config
        self.device = next(drafter.parameters()).device
        self.context: KeysValues = []
        self.length = 0

    @torch.inference_mode()
    def extend(self, features: torch.Tensor) -> None:
        """Append the target features [n, K*H] of the next n positions (length .. length+n-1) to the context."""
        check_features(self.config, features)
        n = features.shape[0]
        positions = torch.arange(self.length, self.length + n, device=self.device)[None]
        new = context_keys_values(self.drafter, features[None], positions)
        if self.context:
            new = [(torch.cat([k, nk], dim=2), torch.cat([v, nv], dim=2))
                   for (k, v), (nk, nv) in zip(self.context, new)]
        self.context = new
        self.length += n

    @torch.inference_mode()
    def hidden(self, noise_embedding: torch.Tensor) -> torch.Tensor:
        """Drafter output [size, H] for the block whose embedding is `noise_embedding` [size, H], placed right
        after the cached context (anchor at position `length`)."""
        check_context(self.length)
        size = noise_embedding.shape[0]
        positions = torch.arange(self.length + size, device=self.device)[None]
        return block_hidden(self.drafter, noise_embedding[None], positions[:, self.length:], self.context,
                            positions[:, : self.length])[0]
