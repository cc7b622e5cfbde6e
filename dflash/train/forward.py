"""The training forward: every block of a sequence through the drafter in one call (method.md §4)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash.config.schema import ATTENTION_BACKENDS
from dflash.models.drafter import DFlashDraftModel
from dflash.train.objective import block_attention_masks, block_inputs


def resolve_attention(name: str, device: torch.device) -> str:
    """'auto' -> 'flex' on CUDA (block-sparse kernel), 'sdpa' elsewhere (dense boolean mask, exact reference)."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"train.attention must be one of {ATTENTION_BACKENDS}, got {name!r}")
    on_cuda = torch.device(device).type == "cuda"
    if name == "auto":
        return "flex" if on_cuda else "sdpa"
    if name == "flex" and not on_cuda:
        raise ValueError("train.attention=flex trains only on CUDA: torch has no FlexAttention backward on CPU; "
                         "use sdpa or auto")
    return name


def training_forward(
    drafter: DFlashDraftModel,
    embed_weight: torch.Tensor,
    input_ids: torch.Tensor,
    target_hidden: torch.Tensor,
    anchors: torch.Tensor,
    attention: str = "sdpa",
) -> torch.Tensor:
    """Hidden states [batch, N*B, H] of all blocks anchored at `anchors` [batch, N].

    input_ids: [batch, T]; target_hidden: [batch, T, K*H], the captured features of the same positions.
    Keys are laid out as [features 0..T-1 ++ blocks]; the mask decides what each query sees. attention: "sdpa"
    (dense boolean mask) or "flex" (BlockMask, no dense grid); both give the same result.
    """
    config = drafter.config
    block_ids, block_positions = block_inputs(input_ids, anchors, config.block_size, config.mask_token_id)
    context_len = target_hidden.shape[1]
    context_positions = torch.arange(context_len, device=input_ids.device).expand(input_ids.shape[0], -1)
    position_ids = torch.cat([context_positions, block_positions], dim=1)
    if attention == "flex":
        from dflash.train.flex_mask import flex_block_masks

        masks = flex_block_masks(anchors, context_len, config.block_size, config.layer_types, config.sliding_window)
    elif attention == "sdpa":
        masks = block_attention_masks(
            anchors, context_len, config.block_size, config.layer_types, config.sliding_window
        )
    else:
        raise ValueError(f"attention must be 'sdpa' or 'flex' here (resolve 'auto' first), got {attention!r}")
    noise_embedding = F.embedding(block_ids, embed_weight)
    return drafter(position_ids, noise_embedding, target_hidden, attention_mask=masks)
