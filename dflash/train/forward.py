"""The training forward: every block of a sequence through the drafter in one call (notes section 4)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash.models.drafter import DFlashDraftModel
from dflash.train.objective import block_attention_masks, block_inputs


def training_forward(
    drafter: DFlashDraftModel,
    embed_weight: torch.Tensor,
    input_ids: torch.Tensor,
    target_hidden: torch.Tensor,
    anchors: torch.Tensor,
) -> torch.Tensor:
    """Hidden states [batch, N*B, H] of all blocks anchored at `anchors` [batch, N].

    input_ids: [batch, T]; target_hidden: [batch, T, K*H], the captured features of the same positions.
    Keys are laid out as [features 0..T-1 ++ blocks]; the mask decides what each query sees.
    """
    config = drafter.config
    block_ids, block_positions = block_inputs(input_ids, anchors, config.block_size, config.mask_token_id)
    context_len = target_hidden.shape[1]
    context_positions = torch.arange(context_len, device=input_ids.device).expand(input_ids.shape[0], -1)
    position_ids = torch.cat([context_positions, block_positions], dim=1)
    masks = block_attention_masks(
        anchors, context_len, config.block_size, config.layer_types, config.sliding_window
    )
    noise_embedding = F.embedding(block_ids, embed_weight)
    return drafter(position_ids, noise_embedding, target_hidden, attention_mask=masks)
