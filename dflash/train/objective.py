"""The DFlash training objective (method.md §4): anchors, block inputs, the block-sparse mask, labels, loss.

One training forward runs every block of a sequence at once. Block j is [x_a, MASK, ..., MASK] at positions
a_j .. a_j+B-1 and must see exactly what it would see at inference: the target features of positions strictly
before a_j (the anchor's own feature is not known yet when it is drafted), its own block (bidirectional in full
layers, causal with a window in sliding layers), and never another block. Position k of the block predicts the
token at a_j+k (same-position labels), weighted exp(-(k-1)/gamma) (`exp_decay`) or by D-PACE weights computed from
the drafter's current label probabilities (`dpace`, docs/training.md "Loss options"); position 0 is the given anchor.
With `kl_weight` > 0 each position's loss mixes that CE with KL(target || drafter), the target's next-token
distribution read from its final hidden state at a_j+k-1 (colocated capture only). With `train.labels=target` the
CE's label of position k is the target's argmax token at a_j+k-1 instead of the stored token at a_j+k (the same
for greedy answers, the target's greedy choice after a sampled prefix for sampled ones; colocated capture only).
"""

from __future__ import annotations

import math

import torch

from dflash.config.schema import LOSS_WEIGHTINGS
from dflash.models.targets.logit_transform import LogitTransform, logits_from_hidden
from dflash.train.head_cross_entropy import head_loss


def valid_anchor_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """[..., T] bool: a is a usable anchor iff a and a+1 are both response tokens (there is something to predict)."""
    valid = torch.zeros_like(loss_mask, dtype=torch.bool)
    valid[..., :-1] = loss_mask[..., :-1].bool() & loss_mask[..., 1:].bool()
    return valid


def sample_anchors(
    loss_mask: torch.Tensor, num_anchors: int, generators: list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random distinct anchors per sequence, sorted, padded to `num_anchors`.

    loss_mask: [batch, T] (0 on padding). One generator per sequence so a sample's anchors depend only on its own
    seed, never on which rank or micro-batch it landed in. Returns (anchors [batch, N] long, valid [batch, N] bool).
    """
    # Every row's usable positions at once (a step has 64 rows; per-row tensor calls are host time), split by row.
    usable = valid_anchor_positions(loss_mask.cpu())
    counts = usable.sum(dim=1)
    positions = usable.nonzero()[:, 1]
    starts = (counts.cumsum(0) - counts).tolist()
    # Only the draw is per row (each row has its own generator); picking, sorting and padding are batched.
    draws = [torch.randperm(n, generator=g)[:num_anchors] + start
             for n, g, start in zip(counts.tolist(), generators, starts)]
    picks = torch.cat(draws) if draws else torch.zeros(0, dtype=torch.long)
    valid = torch.arange(num_anchors) < counts.clamp(max=num_anchors)[:, None]
    # Padding slots sort last (no position reaches T), then read 0 as before.
    anchors = torch.full(valid.shape, loss_mask.shape[1], dtype=torch.long)
    anchors[valid] = positions[picks]
    anchors = anchors.sort(dim=1).values.masked_fill_(~valid, 0)
    return anchors.to(loss_mask.device), valid.to(loss_mask.device)


def block_offsets(block_size: int, device: torch.device | None = None) -> torch.Tensor:
    return torch.arange(block_size, device=device)


def block_inputs(
    input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block token ids [batch, N*B] (anchor token then MASKs) and their positions [batch, N*B]."""
    batch, num_anchors = anchors.shape
    ids = torch.full((batch, num_anchors, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    ids[:, :, 0] = input_ids.gather(1, anchors)
    positions = anchors[:, :, None] + block_offsets(block_size, anchors.device)
    return ids.flatten(1), positions.flatten(1)


def block_targets(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    block_size: int,
    gamma: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels [batch, N, B] (token at a+k) and loss weights [batch, N, B].

    weight = exp(-(k-1)/gamma) * loss_mask[a+k] for k >= 1, zero at k = 0, past the sequence end and for padding
    anchors.
    """
    seq_len = input_ids.shape[1]
    positions = anchors[:, :, None] + block_offsets(block_size, anchors.device)
    inside = positions < seq_len
    clamped = positions.clamp(max=seq_len - 1)
    labels = input_ids.gather(1, clamped.flatten(1)).view_as(positions)
    on_response = loss_mask.gather(1, clamped.flatten(1)).view_as(positions).bool()
    k = block_offsets(block_size, anchors.device).to(torch.float32)
    decay = torch.exp(-(k - 1) / gamma)
    decay[0] = 0.0
    weights = decay * (inside & on_response & anchor_valid[:, :, None]).float()
    return labels, weights


def block_context_positions(anchors: torch.Tensor, block_size: int, seq_len: int) -> torch.Tensor:
    """Position a+k-1 [batch, N, B] for block position k of anchor a: the last position of the prefix before the
    token that block position k predicts. k = 0 (a-1, -1 for a = 0) and past the sequence end are clamped into
    range: those positions carry no loss."""
    return (anchors[:, :, None] + block_offsets(block_size, anchors.device) - 1).clamp(0, seq_len - 1)


def block_target_hidden(target_final: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """The target's final normed hidden state [batch, N*B, H] at position a+k-1 for block position k of anchor a.

    lm_head of that row is the target's distribution for the token at a+k, the one block position k predicts.
    """
    positions = block_context_positions(anchors, block_size, target_final.shape[1])
    index = positions.flatten(1)[:, :, None].expand(-1, -1, target_final.shape[-1])
    return target_final.gather(1, index.to(target_final.device))


@torch.no_grad()
def target_argmax(finals: torch.Tensor, head: torch.Tensor, rows: int = 1024) -> torch.Tensor:
    """The target's greedy next token [T] after each of its final hidden states [T, H]: the argmax of their logits
    through the head weight [V, H], `rows` at a time (a long sequence's logits at a 262k vocabulary would not fit at
    once). On the states' device; the raw logits, since no logit transform moves an argmax."""
    if finals.shape[0] == 0:
        return torch.zeros(0, dtype=torch.long, device=finals.device)
    return torch.cat([logits_from_hidden(finals[i : i + rows], head).argmax(-1).to(finals.device)
                      for i in range(0, finals.shape[0], rows)])


def target_labels(labels: torch.Tensor, weights: torch.Tensor, target_final: torch.Tensor, anchors: torch.Tensor,
                  lm_head_weight: torch.Tensor, chunk_size: int = 4096,
                  rows: torch.Tensor | None = None) -> torch.Tensor:
    """`labels` [batch, N, B] with each loss position's label replaced by the target's argmax token after the
    stored prefix (train.labels=target): block position k of anchor a gets the argmax of the target's logits at
    a+k-1. Where the stored answer is the target's greedy token the two agree; where it was sampled they differ.

    target_final: [batch, T, H], the target's final hidden states; weights: the loss weights, whose non-zero
    positions are the only ones computed (`rows`: loss_rows(weights) when the caller has them), chunk_size rows of
    logits at a time. Positions without loss keep their labels.
    """
    num_anchors, block_size = labels.shape[1:]
    rows = loss_rows(weights) if rows is None else rows.to(target_final.device)
    positions = block_context_positions(anchors, block_size, target_final.shape[1]).to(target_final.device)
    states = target_final[rows // (num_anchors * block_size), positions.reshape(-1)[rows]]
    replaced = labels.reshape(-1).clone()
    replaced[rows.to(labels.device)] = target_argmax(states, lm_head_weight, chunk_size).to(labels.device)
    return replaced.view_as(labels)


def block_attention_masks(
    anchors: torch.Tensor,
    context_len: int,
    block_size: int,
    layer_types: list[str],
    sliding_window: int | None,
) -> dict[str, torch.Tensor]:
    """Boolean masks [batch, 1, N*B, context_len + N*B] per layer type, True where a key is visible.

    Keys are [context features of positions 0..context_len-1 ++ all block tokens]. A dense mask is fine at the
    sizes this path serves (CPU, tests, small targets); large runs use a block-sparse kernel built from the same rule.
    """
    batch, num_anchors = anchors.shape
    device = anchors.device
    k = block_offsets(block_size, device)
    query_anchor = anchors[:, :, None].expand(batch, num_anchors, block_size).flatten(1)  # [b, Q]
    query_pos = (anchors[:, :, None] + k).flatten(1)
    query_block = torch.arange(num_anchors, device=device).repeat_interleave(block_size)  # [Q]
    query_offset = k.repeat(num_anchors)

    context_pos = torch.arange(context_len, device=device)
    sees_context = context_pos[None, None, :] < query_anchor[:, :, None]  # strictly before the anchor
    same_block = query_block[:, None] == query_block[None, :]  # [Q, Q]

    masks = {}
    for layer_type in sorted(set(layer_types)):
        if layer_type == "full_attention":
            context_part = sees_context
            block_part = same_block[None].expand(batch, -1, -1)
        elif layer_type == "sliding_attention":
            assert sliding_window is not None
            context_part = sees_context & (query_pos[:, :, None] - context_pos[None, None, :] < sliding_window)
            distance = query_offset[:, None] - query_offset[None, :]
            block_part = (same_block & (distance >= 0) & (distance < sliding_window))[None].expand(batch, -1, -1)
        else:
            raise ValueError(f"unknown layer type {layer_type!r}")
        masks[layer_type] = torch.cat([context_part, block_part], dim=2)[:, None]
    return masks


def check_loss_weighting(weighting: str, dpace_alpha: float) -> None:
    """ValueError unless `weighting` is one of LOSS_WEIGHTINGS and 0 <= dpace_alpha <= 1."""
    if weighting not in LOSS_WEIGHTINGS:
        raise ValueError(f"unknown train.loss_weighting {weighting!r}; options: {', '.join(LOSS_WEIGHTINGS)}")
    if not 0.0 <= dpace_alpha <= 1.0:
        raise ValueError(f"train.dpace_alpha must be in [0, 1], got {dpace_alpha}")


def check_kl_weight(kl_weight: float) -> None:
    """ValueError unless 0 <= kl_weight <= 1 (the loss is (1 - kl_weight) CE + kl_weight KL)."""
    if not 0.0 <= kl_weight <= 1.0:
        raise ValueError(f"train.kl_weight must be in [0, 1] (0: CE only, 1: KL only), got {kl_weight}")


def dpace_weights(label_prob: torch.Tensor, mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE position weights [..., B] (arXiv 2605.18810, Eqs. 7-8), from detached label probabilities.

    label_prob: q_k, the drafter's probability of the label at each block position; mask: bool, the positions that
    carry loss. q~_k = alpha + (1 - alpha) q_k; P_m = prod of q~_i over masked i <= m (unmasked positions, e.g. the
    anchor at k = 0, are skipped: factor 1); w_k = mask_k * sum over masked m >= k of P_m, which is the derivative
    of the smoothed accepted-length surrogate sum_m P_m with respect to log q~_k.
    """
    smoothed = torch.where(mask, alpha + (1.0 - alpha) * label_prob, torch.ones_like(label_prob))
    reach = torch.cumprod(smoothed, dim=-1) * mask
    return torch.flip(torch.cumsum(torch.flip(reach, (-1,)), dim=-1), (-1,)) * mask


def loss_normaliser(weights: torch.Tensor, weighting: str) -> torch.Tensor:
    """What one micro-batch adds to the global loss denominator, known before the forward pass.

    exp_decay: the sum of its position weights (the loss is a weighted mean CE). dpace: its number of blocks with a
    loss position (valid anchors), as the D-PACE author asks (SpecForge issue #828): dividing by the data-dependent
    D-PACE weight sum would cancel the accepted-length credit the weights encode.
    """
    if weighting == "dpace":
        return (weights != 0).any(dim=-1).sum().to(weights.dtype)
    return weights.sum()


def weighted_block_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    chunk_size: int = 4096,
    weighting: str = "exp_decay",
    dpace_alpha: float = 0.5,
    kl_weight: float = 0.0,
    target_hidden: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    transform: LogitTransform | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sum of weighted CE over block positions, computed in chunks so [positions, vocab] logits never coexist.

    hidden: [batch, N*B, H]; labels/weights: [batch, N, B]. The loss goes through head_loss (each chunk's logits
    made once, the hidden-state gradient with them), so peak memory is one chunk of logits. weighting "exp_decay"
    uses `weights` as the loss weights; "dpace" uses only their non-zero pattern (which positions carry loss) and
    weights each position by dpace_weights() of the drafter's label probabilities, detached, so the CE term alone
    carries the gradient (D-PACE Eq. 9). kl_weight > 0 needs target_hidden [batch, N*B, H] (block_target_hidden():
    the target's final hidden state whose next-token distribution p is the target's for each block position); each
    position's loss is then (1 - kl_weight) CE + kl_weight KL(p || q), weighted the same way (D-PACE weights still
    come from the drafter's label probability), with both heads' logits made chunk by chunk. rows:
    loss_rows(weights) of these exact weights, when known before the weights reached the device (not checked
    against them). transform: the target's final logit transform (head_loss). Returns (loss_sum, weight_sum of the
    weights used, per-position correct counts [B], per-position counts [B]) where the counts cover positions with
    non-zero weight.
    """
    check_loss_weighting(weighting, dpace_alpha)
    check_kl_weight(kl_weight)
    if kl_weight > 0 and target_hidden is None:
        raise ValueError(f"kl_weight={kl_weight} needs target_hidden, the target's final hidden states per position")
    block_size = labels.shape[-1]
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels, flat_weights = labels.reshape(-1), weights.reshape(-1)
    flat_target = target_hidden.reshape(-1, target_hidden.shape[-1]) if kl_weight > 0 else None
    # The loss rows: taken from the host when the caller has them (prepare_micro_batch), since nonzero() of a GPU
    # tensor waits for the GPU to reach it before it knows how many rows there are.
    rows = loss_rows(weights) if rows is None else rows.to(hidden.device, non_blocking=True)
    offsets = rows % block_size
    # Not bincount: on CUDA it reads the largest offset back to the host first.
    counts = (weights.reshape(-1, block_size) != 0).sum(dim=0).float()
    correct_sum = torch.zeros(block_size, device=hidden.device)
    terms, ce, correct = head_loss(flat_hidden[rows], lm_head_weight, flat_labels[rows], chunk_size,
                                   flat_target[rows] if kl_weight > 0 else None, kl_weight, transform=transform)
    correct_sum.index_add_(0, offsets, correct.detach().float())
    if weighting == "exp_decay":
        position_weights = flat_weights[rows]
    else:
        # A block's D-PACE weights need the probabilities of all its positions, hence per-position losses first.
        label_prob = torch.zeros_like(flat_weights, dtype=torch.float32)
        label_prob[rows] = torch.exp(-ce.detach())
        position_weights = dpace_weights(label_prob.view(weights.shape), weights != 0, dpace_alpha).reshape(-1)[rows]
    return (terms * position_weights).sum(), position_weights.sum(), correct_sum, counts


def loss_rows(weights: torch.Tensor) -> torch.Tensor:
    """Flat indices [R] of the block positions [batch, N, B] with non-zero loss weight, in row-major order."""
    return weights.reshape(-1).nonzero().flatten()


def decay_weights(block_size: int, gamma: float) -> list[float]:
    """The per-position weights, for docs and logs: [0, 1, exp(-1/gamma), ...]."""
    return [0.0] + [math.exp(-(k - 1) / gamma) for k in range(1, block_size)]
