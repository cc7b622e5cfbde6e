"""The acceptance rules of dflash/inference/sampling.py, computed on the device (one host sync per live step), draw
the same random numbers and give the same tokens as the host-branching reference rules below, and `sample` draws
what torch.multinomial draws. The distributions themselves are tested in test_eval_sampling.py."""

from __future__ import annotations

import pytest
import torch

from dflash.inference.sampling import greedy_drafts_outcome, greedy_outcome, sample, sampled_outcome


def multinomial(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def reference_sampled(target_probs, draft_probs, drafts, generator) -> tuple[int, int]:
    """Rejection sampling of sampled drafts, branching on the host at every decision."""
    n = drafts.shape[0]
    uniforms = torch.rand(n, generator=generator)
    index = torch.arange(n)
    p, q = target_probs[index, drafts], draft_probs[index, drafts]
    rejected = (uniforms * q >= p).nonzero()
    if rejected.numel() == 0:
        return n, int(multinomial(target_probs[n], generator))
    k = int(rejected[0, 0])
    residual = (target_probs[k] - draft_probs[k]).clamp_min(0)
    total = residual.sum()
    replacement = residual / total if float(total) > 0 else target_probs[k]
    return k, int(multinomial(replacement, generator))


def reference_greedy_drafts(target_probs, drafts, generator) -> tuple[int, int]:
    """Rejection sampling of deterministic drafts, branching on the host at every decision."""
    n = drafts.shape[0]
    uniforms = torch.rand(n, generator=generator)
    p = target_probs[torch.arange(n), drafts]
    rejected = (uniforms >= p).nonzero()
    if rejected.numel() == 0:
        return n, int(multinomial(target_probs[n], generator))
    k = int(rejected[0, 0])
    residual = target_probs[k].clone()
    residual[drafts[k]] = 0
    total = residual.sum()
    replacement = residual / total if float(total) > 0 else target_probs[k]
    return k, int(multinomial(replacement, generator))


def cases(count: int):
    """(case, target_probs [n+1, V], draft_probs [n, V], drafts [n]): peaked and flat distributions, drafts from
    the drafter's distribution, so both full acceptance and every rejection position occur."""
    torch.manual_seed(0)
    for case in range(count):
        n, vocab = 1 + case % 6, 2 + case % 9
        target = torch.softmax((0.5 + case % 4) * torch.randn(n + 1, vocab), dim=-1)
        draft = torch.softmax((0.5 + case % 3) * torch.randn(n, vocab), dim=-1)
        if case % 5 == 0:
            draft = target[:n].clone()  # a perfect drafter: everything accepted
        yield case, target, draft, torch.multinomial(draft, 1).squeeze(-1)


def test_sample_draws_what_multinomial_draws():
    for case in range(200):
        vocab = 2 + case % 50
        probs = torch.softmax(3 * torch.randn(1 + case % 3, vocab), dim=-1)
        probs = probs[0] if case % 2 else probs
        probs[..., case % vocab] = 0.0  # zero entries, as in a residual
        ours, theirs = torch.Generator().manual_seed(case), torch.Generator().manual_seed(case)
        assert torch.equal(sample(probs, ours), multinomial(probs, theirs)), case
        assert torch.equal(torch.rand(3, generator=ours), torch.rand(3, generator=theirs)), case  # same state after


def test_device_rules_give_the_host_rules_tokens():
    outcomes = set()
    for case, target, draft, drafts in cases(400):
        sampled = sampled_outcome(target, draft, drafts, torch.Generator().manual_seed(case)).tolist()
        assert tuple(sampled) == reference_sampled(target, draft, drafts, torch.Generator().manual_seed(case)), case
        greedy = draft.argmax(dim=-1)
        got = greedy_drafts_outcome(target, greedy, torch.Generator().manual_seed(case)).tolist()
        assert tuple(got) == reference_greedy_drafts(target, greedy, torch.Generator().manual_seed(case)), case
        outcomes |= {(sampled[0], drafts.shape[0]), (got[0], drafts.shape[0])}
    # Rejections at the first positions of 5 drafts and full acceptance were exercised.
    assert {(k, n) for k, n in outcomes if k < n} >= {(k, 5) for k in range(3)}, sorted(outcomes)
    assert any(k == n for k, n in outcomes)


def test_residual_without_mass_falls_back_to_the_target_row():
    """A rejection whose residual rounds to zero mass draws from the target's row, as the host rule does."""
    target = torch.tensor([[0.5, 0.5, 0.0], [0.0, 1.0, 0.0]])
    draft = torch.tensor([[0.5, 0.5, 0.0]])  # p == q: the residual is all zeros, yet u * q >= p can hold (u ~ 1)
    for seed in range(50):
        uniforms = torch.rand(1, generator=torch.Generator().manual_seed(seed))
        got = sampled_outcome(target, draft, torch.tensor([0]), torch.Generator().manual_seed(seed)).tolist()
        assert tuple(got) == reference_sampled(target, draft, torch.tensor([0]), torch.Generator().manual_seed(seed))
        assert got[0] == (0 if float(uniforms[0]) >= 1.0 else 1)


def test_greedy_outcome():
    logits = torch.tensor([[0.0, 5.0, 0.0], [0.0, 0.0, 5.0], [5.0, 0.0, 0.0]])
    for drafts, want in (([1, 2], [2, 0]), ([1, 0], [1, 2]), ([2, 2], [0, 1])):
        got = greedy_outcome(logits, torch.tensor(drafts))
        assert got.dtype == torch.long and got.tolist() == want


@pytest.mark.parametrize("rule", ["sampled", "greedy"])
def test_no_draft_draws_the_bonus(rule):
    target = torch.tensor([[0.0, 1.0, 0.0]])
    drafts = torch.zeros(0, dtype=torch.long)
    generator = torch.Generator().manual_seed(0)
    outcome = (sampled_outcome(target, torch.zeros(0, 3), drafts, generator) if rule == "sampled"
               else greedy_drafts_outcome(target, drafts, generator))
    assert outcome.tolist() == [0, 1]
