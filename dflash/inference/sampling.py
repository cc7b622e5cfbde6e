"""Verification rules of speculative decoding: greedy prefix matching (T=0) and, at T>0, rejection sampling of
sampled drafts or of greedy (argmax) drafts.

Rejection sampling (Leviathan et al. 2023, Chen et al. 2023): draft k was sampled from the drafter's q_k; accept it
with probability min(1, p_k(d)/q_k(d)) where p_k is the target's distribution at that position given the accepted
prefix; at the first rejection sample the replacement from normalise(max(0, p_k - q_k)); when every draft is
accepted sample a bonus token from the target's next distribution. Each committed token is then distributed
exactly as the target's own sample, so the output distribution is the target's (tests/test_eval_sampling.py).

Greedy drafts (`greedy_drafts_outcome`) are the same rule with q_k one-hot at the drafter's argmax: accept with
probability p_k(d), replace from p_k with d's mass removed, renormalised. It is exact for any deterministic proposal
and is what vLLM (draft_sample_method "greedy", its default) and SGLang (DFLASH) do at T>0 (docs/eval.md).
"""

from __future__ import annotations

import torch

# How the drafter proposes at T>0 (eval.draft_sampling): "sampled" draws each block position from q_k independently,
# "greedy" proposes the argmax of q_k (a coherent block; accepted with probability p_k(d)).
DRAFT_SAMPLING = ("greedy", "sampled")


def probabilities(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / temperature) in fp32 (plain temperature sampling: no top-k / top-p)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token id per row of probs [..., V] (a LongTensor of shape probs.shape[:-1]), on the device.

    The draw torch.multinomial(probs, 1) makes (ATen's one-sample path: q ~ Exp(1) per entry, argmax of p / q),
    written out: multinomial first checks its input on the host (two device syncs), this does not. The same random
    numbers and the same tokens as multinomial for one generator state (tests/test_eval_sampling_reference.py); rows
    must be valid distributions (nothing checks for negative, NaN or all-zero rows)."""
    flat = probs.reshape(-1, probs.shape[-1])
    noise = torch.empty_like(flat).exponential_(1, generator=generator)
    return (flat / noise).argmax(dim=-1).reshape(probs.shape[:-1])


def greedy_outcome(target_logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """[accepted drafts, next token] (a LongTensor [2] on the device) for T=0: the longest prefix of drafts [n]
    equal to the target's argmax at block positions 0..n-1 of target_logits [n+1, V]; the next token is the
    target's argmax after that prefix."""
    predicted = target_logits.argmax(dim=-1)
    accepted = (drafts.to(predicted.device) == predicted[:-1]).int().cumprod(0).sum()
    return torch.stack([accepted, predicted.index_select(0, accepted[None])[0]])


def _rejection_outcome(target_probs: torch.Tensor, rejected: torch.Tensor, residual_of,
                       generator: torch.Generator | None) -> torch.Tensor:
    """[accepted drafts, next token] on the device from the rejection flags [n] of the drafts: the drafts before
    the first rejection are accepted; the next token is drawn from normalise(residual_of(k)) at the first rejected
    position k (target_probs[k] when the residual rounds to zero mass), or from the bonus row target_probs[n] when
    nothing was rejected. Both cases are computed and one row is chosen on the device, so there is no host sync
    and exactly one draw, as the branching rule makes."""
    n = rejected.shape[0]
    accepted = (~rejected).int().cumprod(0).sum()
    bonus = target_probs[n]
    if n == 0:
        return torch.stack([accepted, sample(bonus, generator)])
    first = accepted.clamp(max=n - 1)[None]  # the first rejected position when there is one
    residual = residual_of(first)
    total = residual.sum()
    replacement = torch.where(total > 0, residual / total, target_probs.index_select(0, first)[0])
    return torch.stack([accepted, sample(torch.where(accepted < n, replacement, bonus), generator)])


def sampled_outcome(target_probs: torch.Tensor, draft_probs: torch.Tensor, drafts: torch.Tensor,
                    generator: torch.Generator | None) -> torch.Tensor:
    """[accepted drafts, next token] (LongTensor [2], on the device) by rejection sampling of sampled drafts;
    target_probs [n+1, V], draft_probs [n, V], drafts [n]."""
    n = drafts.shape[0]
    if target_probs.shape[0] != n + 1 or draft_probs.shape[0] != n:
        raise ValueError(f"need target_probs [{n + 1}, V] and draft_probs [{n}, V] for {n} drafts, got "
                         f"{tuple(target_probs.shape)} and {tuple(draft_probs.shape)}")
    device = target_probs.device
    drafts = drafts.to(device)
    draft_probs = draft_probs.to(device)
    uniforms = torch.rand(n, generator=generator, device=device)
    index = torch.arange(n, device=device)
    p, q = target_probs[index, drafts], draft_probs[index, drafts]
    # u < p/q written without the division; q > 0 because d was sampled from q. A rejection implies p(d) < q(d),
    # so the residual has positive mass; the zero-mass fallback only guards rounding.
    return _rejection_outcome(
        target_probs, uniforms * q >= p,
        lambda k: (target_probs.index_select(0, k)[0] - draft_probs.index_select(0, k)[0]).clamp_min(0), generator)


def greedy_drafts_outcome(target_probs: torch.Tensor, drafts: torch.Tensor,
                          generator: torch.Generator | None) -> torch.Tensor:
    """[accepted drafts, next token] (LongTensor [2], on the device) for deterministic drafts (the drafter's
    argmax) at T>0: rejection sampling with q_k one-hot at draft k, so draft k is accepted with probability p_k(d)
    and, at the first rejection, the replacement is sampled from p_k with d's mass removed; target_probs [n+1, V],
    drafts [n]. Draws the same random numbers as sampled_outcome and gives its result for one-hot draft_probs,
    without building them."""
    n = drafts.shape[0]
    if target_probs.shape[0] != n + 1:
        raise ValueError(f"need target_probs [{n + 1}, V] for {n} drafts, got {tuple(target_probs.shape)}")
    device = target_probs.device
    drafts = drafts.to(device)
    uniforms = torch.rand(n, generator=generator, device=device)
    p = target_probs[torch.arange(n, device=device), drafts]

    def rest(k: torch.Tensor) -> torch.Tensor:
        # p_k without the draft's mass; a rejection implies p(d) < 1, so the rest has positive mass.
        return target_probs.index_select(0, k)[0].scatter(0, drafts.index_select(0, k), 0.0)

    return _rejection_outcome(target_probs, uniforms >= p, rest, generator)
