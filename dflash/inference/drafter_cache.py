"""Drafting from cached context keys/values: the live decoder's growing context and the replay's batched blocks.

`DFlashDraftModel.forward` on target features projects the whole context through fc, hidden_norm and every layer's
k/v projections on each call: O(context) work per drafted block. Verified positions never change, so their keys
(after k_norm and RoPE at their absolute positions) and values are computed once per position
(`DFlashDraftModel.context_keys_values`) and each drafted block runs only its own tokens through the same forward
(`block_hidden`, which adds the masks of padded and windowed keys). `tests/test_eval_live.py` and
`tests/test_eval.py` check that the result equals the forward on target features (full and sliding layers, context
longer than the window, left-padded batches).
- `CachedDrafter`: one live sequence; `extend` appends the positions verified since the last step and `draft` runs
  a block [anchor, MASK...] through the target's embedding weight, the drafter and the target's head
  (`block_drafts`).
- `DrafterProposer` (replay.py): many stored sequences; keys/values of all their positions are computed once and
  each step gathers the context of its rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dflash.models.drafter import DFlashDraftModel, sliding_mask_from_positions
from dflash.models.targets.logit_transform import logits_from_hidden

# Per drafter layer: (keys [b, kv_heads, n, head_dim] after k_norm + RoPE, values [b, kv_heads, n, head_dim]).
KeysValues = list[tuple[torch.Tensor, torch.Tensor]]


@torch.inference_mode()
def context_keys_values(drafter: DFlashDraftModel, features: torch.Tensor, positions: torch.Tensor) -> KeysValues:
    """Every layer's context keys/values of target features [b, n, K*H] at absolute positions [b, n]."""
    check_features(drafter.config, features, batched=True)
    return drafter.context_keys_values(features.to(drafter.fc.weight.device), positions)


def block_masks(drafter: DFlashDraftModel, block_positions: torch.Tensor, context_positions: torch.Tensor,
                context_valid: torch.Tensor | None, block_valid: torch.Tensor | None) -> dict[str, torch.Tensor | None]:
    """The drafter's attention masks (by layer type, [b, 1, S, C + S], True = visible) for blocks at positions
    [b, S] after cached context columns at positions [b, C]: padding columns (valid False) hidden from every layer,
    and the sliding layers' window by position."""
    full = None
    if context_valid is not None or block_valid is not None:
        device = context_positions.device
        if context_valid is None:
            context_valid = torch.ones(context_positions.shape, dtype=torch.bool, device=device)
        if block_valid is None:
            block_valid = torch.ones(block_positions.shape, dtype=torch.bool, device=device)
        full = torch.cat([context_valid, block_valid], dim=1)[:, None, None, :]
    masks = {"full_attention": full}
    if drafter.config.sliding_window is not None:
        key_positions = torch.cat([context_positions, block_positions], dim=1)
        sliding = sliding_mask_from_positions(block_positions, key_positions, drafter.config.sliding_window)
        masks["sliding_attention"] = sliding if full is None else sliding & full
    return masks


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
    masks = block_masks(drafter, block_positions, context_positions, context_valid, block_valid)
    return drafter(block_positions, noise_embedding.to(drafter.fc.weight.device), attention_mask=masks,
                   context_keys_values=context)


@dataclass(frozen=True, eq=False)
class TargetHead:
    """The target's frozen parts a live drafter drafts through: the input embedding of the block's tokens (its
    weight is what is used, see `embed`), the output head weight [V, H] and the logit transform
    (models/targets/logit_transform.py; None = raw logits)."""

    embedding: nn.Embedding
    weight: torch.Tensor
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None

    @classmethod
    def of(cls, adapter) -> TargetHead:
        return cls(adapter.embed_tokens(), adapter.lm_head_weight(), adapter.logit_transform)

    @property
    def device(self) -> torch.device:
        """Where the block's token ids go: the embedding's device."""
        return self.embedding.weight.device

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The token embeddings [..., H] of `tokens`: rows of the embedding weight."""
        # Not the module's output: training embeds the block this way (train/forward.py), as serving engines do with
        # the target's shared weight, whereas Gemma's module also multiplies by sqrt(hidden_size).
        return F.embedding(tokens, self.embedding.weight)


def block_drafts(head: TargetHead, tokens: torch.Tensor,
                 hidden: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafter logits [n-1, V] of the block `tokens` [n] = [anchor, MASK x (n-1)] and their argmax [n-1]: the
    tokens through the target's embedding weight (`TargetHead.embed`), `hidden` (the drafter's output [n, H] of the
    embedded block [n, H]) and the target's head; the anchor's own output is not a draft."""
    logits = logits_from_hidden(hidden(head.embed(tokens))[1:], head.weight, head.transform)
    return logits, logits.argmax(dim=-1)


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
    """Drafts blocks for one sequence (batch 1) through the target's `head`; `extend` appends verified target
    features to the cached context."""

    def __init__(self, drafter: DFlashDraftModel, head: TargetHead) -> None:
        self.drafter = drafter
        self.head = head
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

    @torch.inference_mode()
    def draft(self, anchor: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafter logits [size-1, V] and their argmax [size-1] for the block [anchor, MASK x (size-1)] placed right
        after the cached context."""
        tokens = torch.full((size,), self.config.mask_token_id, dtype=torch.long, device=self.head.device)
        tokens[0] = anchor
        return block_drafts(self.head, tokens, self.hidden)
