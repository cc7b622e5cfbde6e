"""Speculative rejection sampling (T>0) gives the target's output distribution, with sampled drafts and with greedy
(argmax) drafts: statistical tests, fixed seeds."""

from __future__ import annotations

import pytest
import torch

from dflash.eval.live import live_decode, target_only_decode
from dflash.inference.sampling import (greedy_drafts_outcome, greedy_outcome, probabilities, sample,
                                       sampled_outcome)
from tests.schema_options import LIVE_ENGINE

VOCAB = 4


def markov_chains():
    """Target p(next | previous) and a rather different drafter q, with zeros on both sides: q misses tokens the
    target likes (only the residual distribution can produce them) and proposes tokens the target never emits."""
    p = torch.tensor([[0.10, 0.60, 0.30, 0.00],
                      [0.50, 0.05, 0.05, 0.40],
                      [0.25, 0.25, 0.25, 0.25],
                      [0.00, 0.20, 0.70, 0.10]])
    q = torch.tensor([[0.50, 0.00, 0.20, 0.30],
                      [0.10, 0.10, 0.70, 0.10],
                      [0.70, 0.10, 0.10, 0.10],
                      [0.30, 0.30, 0.00, 0.40]])
    return p, q


def speculative_markov(p, q, first, num_tokens, block_size, generator, accept=sampled_outcome, greedy=False):
    """The live loop's structure on Markov chains: draft block_size-1 tokens from q (its argmax when `greedy`), the
    target's distribution at every block position given the drafted prefix, then the acceptance rule (its outcome
    [accepted drafts, next token] read back to the host); returns the first num_tokens tokens."""
    tokens = [first]
    while len(tokens) <= num_tokens:
        drafts, draft_probs, previous = [], [], tokens[-1]
        for _ in range(block_size - 1):
            draft_probs.append(q[previous])
            previous = int(q[previous].argmax()) if greedy else int(sample(q[previous], generator))
            drafts.append(previous)
        context = [tokens[-1]] + drafts
        target_probs = torch.stack([p[t] for t in context])
        accepted, following = accept(target_probs, torch.stack(draft_probs), torch.tensor(drafts), generator).tolist()
        tokens += drafts[:accepted] + [following]
    return tuple(tokens[1 : num_tokens + 1])


def empirical(samples):
    counts: dict = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    return {k: v / len(samples) for k, v in counts.items()}


def total_variation(a: dict, b: dict) -> float:
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


def exact_joint(p, first, num_tokens):
    joint = {(): 1.0}
    for _ in range(num_tokens):
        joint = {seq + (t,): prob * float(p[seq[-1] if seq else first, t])
                 for seq, prob in joint.items() for t in range(VOCAB)}
    return {k: v for k, v in joint.items() if v > 0}


def test_rejection_sampling_gives_the_target_joint_distribution():
    p, q = markov_chains()
    generator = torch.Generator().manual_seed(0)
    samples = [speculative_markov(p, q, 0, 3, 3, generator) for _ in range(6000)]
    target = exact_joint(p, 0, 3)
    # 64 outcomes, 6000 samples: the expected TV of a correct sampler is about 0.03.
    assert total_variation(empirical(samples), target) < 0.05
    assert set(empirical(samples)) <= set(target), "emitted a sequence the target gives probability 0"
    # The test has power: accepting every draft (output = drafter's distribution) is far off.
    def accept_all(target_probs, draft_probs, drafts, generator):
        return torch.stack([torch.tensor(len(drafts)), sample(target_probs[-1], generator)])
    wrong = [speculative_markov(p, q, 0, 3, 3, generator, accept=accept_all) for _ in range(2000)]
    assert total_variation(empirical(wrong), target) > 0.2


def test_greedy_and_sampled_outcome_edge_cases():
    logits = torch.tensor([[0.0, 5.0, 0.0], [0.0, 0.0, 5.0], [5.0, 0.0, 0.0]])
    assert greedy_outcome(logits, torch.tensor([1, 2])).tolist() == [2, 0]
    assert greedy_outcome(logits, torch.tensor([1, 0])).tolist() == [1, 2]
    assert greedy_outcome(logits, torch.tensor([2, 2])).tolist() == [0, 1]
    generator = torch.Generator().manual_seed(0)
    target = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    # Drafts the target is certain of are always accepted; a draft it gives 0 is always replaced.
    assert sampled_outcome(target, target[:2], torch.tensor([1, 2]), generator).tolist() == [2, 0]
    draft = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    assert sampled_outcome(target, draft, torch.tensor([0, 2]), generator).tolist() == [0, 1]
    with pytest.raises(ValueError, match="need target_probs"):
        sampled_outcome(target[:2], draft, torch.tensor([0, 2]), generator)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        probabilities(logits, 0.0)


@pytest.mark.parametrize("draft_sampling", ["sampled", "greedy"])
@pytest.mark.slow
def test_live_sampling_matches_target_sampling_on_a_tiny_target(draft_sampling, make_drafter):
    """End to end through live_decode: the distribution of the first token that comes out of a verify step (the
    second new token) equals the target's, computed exactly from the target's logits, with sampled and with
    greedy drafts."""
    from dflash.models.targets import load_target

    adapter = load_target("tiny", tiny={"family": "llama", "seed": 0, "tokenizer": "builtin"})
    drafter = make_drafter(adapter, block_size=3, std=0.3)
    prompt = adapter.chat_ids([{"role": "user", "content": "What is two plus two?"}])
    # The random target's logits are nearly flat; a low temperature puts its distributions on a few tokens, so a
    # few hundred samples measure them.
    temperature = 0.03
    with torch.no_grad():
        first = probabilities(adapter.model(torch.tensor([prompt])).logits[0, -1], temperature)
        candidates = [int(t) for t in torch.nonzero(first > 1e-4).flatten()]
        batch = torch.tensor([prompt + [t] for t in candidates])
        second = probabilities(adapter.model(batch).logits[:, -1], temperature)
    exact = (first[candidates, None] * second).sum(0)
    exact = {t: float(v) for t, v in enumerate(exact) if v > 1e-6}
    # About 0.75 / 0.22 / small rest: a correct sampler's expected TV over 400 samples is about 0.04.
    assert max(exact.values()) < 0.9 and sorted(exact.values())[-2] > 0.1, f"target too peaked for this test: {exact}"
    generator = torch.Generator().manual_seed(0)
    live = [live_decode(drafter, adapter, prompt, max_new_tokens=3, stop_token_ids=[], temperature=temperature,
                        generator=generator, draft_sampling=draft_sampling, target_engine=LIVE_ENGINE).continuation[1]
            for _ in range(400)]
    assert total_variation(empirical(live), exact) < 0.1
    if draft_sampling == "sampled":  # the baseline once
        plain = [target_only_decode(adapter, prompt, max_new_tokens=2, stop_token_ids=[], temperature=temperature,
                                    generator=generator, target_engine=LIVE_ENGINE).continuation[1] for _ in range(400)]
        assert total_variation(empirical(plain), exact) < 0.1


def greedy_rule(target_probs, draft_probs, drafts, generator):
    return greedy_drafts_outcome(target_probs, drafts, generator)


def test_greedy_drafts_give_the_target_joint_distribution():
    """Argmax drafts verified as deterministic proposals (accept with p(d), replace from p without d): the output is
    the target's, although the drafts never follow the drafter's distribution."""
    p, q = markov_chains()
    generator = torch.Generator().manual_seed(1)
    samples = [speculative_markov(p, q, 0, 3, 3, generator, accept=greedy_rule, greedy=True) for _ in range(6000)]
    target = exact_joint(p, 0, 3)
    assert total_variation(empirical(samples), target) < 0.05
    assert set(empirical(samples)) <= set(target), "emitted a sequence the target gives probability 0"
    # Power: verifying the argmax drafts by the sampled-draft rule (q = the drafter's softmax, not the one-hot it
    # proposed) is not exact.
    wrong = [speculative_markov(p, q, 0, 3, 3, generator, greedy=True) for _ in range(2000)]
    assert total_variation(empirical(wrong), target) > 0.1


def test_greedy_drafts_are_accepted_with_the_target_probability_of_each_draft():
    """Per position: draft k is accepted with probability p_k(d_k) given drafts 1..k-1 were, so the committed
    length follows the survival products of p(d); every committed token, replacement included, is drawn from the
    target's distribution at its position."""
    target = torch.tensor([[0.90, 0.05, 0.05],
                           [0.30, 0.50, 0.20],
                           [0.10, 0.10, 0.80],
                           [0.20, 0.30, 0.50]])
    drafts = torch.tensor([0, 1, 0])  # p(d) = 0.9, 0.5, 0.1
    generator = torch.Generator().manual_seed(2)
    trials = 20000
    outcomes = [greedy_drafts_outcome(target, drafts, generator).tolist() for _ in range(trials)]
    accepted = torch.tensor([a for a, _ in outcomes])
    p = [0.9, 0.5, 0.1]
    exact = [1 - p[0], p[0] * (1 - p[1]), p[0] * p[1] * (1 - p[2]), p[0] * p[1] * p[2]]
    for n, probability in enumerate(exact):
        assert abs(float((accepted == n).float().mean()) - probability) < 0.01, (n, probability)
    # Conditional acceptance per position equals p(draft): P(a >= k+1 | a >= k) = p_k(d_k).
    for k in range(3):
        reached = accepted >= k
        assert abs(float((accepted[reached] >= k + 1).float().mean()) - p[k]) < 0.02, k
    # The token after the accepted prefix: a replacement from p_k without d_k, or the bonus from the last row; so
    # position k's token (accepted draft or replacement), given the prefix was accepted, is distributed as p_k.
    for k in range(3):
        reached = [i for i, (a, _) in enumerate(outcomes) if a >= k]
        tokens = [int(drafts[k]) if outcomes[i][0] > k else outcomes[i][1] for i in reached]
        counts = torch.bincount(torch.tensor(tokens), minlength=3).float() / len(tokens)
        assert float((counts - target[k]).abs().sum()) / 2 < 0.02, (k, counts)
    bonus = [f for a, f in outcomes if a == 3]
    assert abs(len(bonus) / trials - exact[3]) < 0.01
    counts = torch.bincount(torch.tensor(bonus), minlength=3).float() / len(bonus)
    assert float((counts - target[3]).abs().sum()) / 2 < 0.05


def test_greedy_drafts_rule_is_rejection_sampling_with_one_hot_draft_probs():
    """greedy_drafts_outcome = sampled_outcome with q one-hot at the drafts: the same random numbers, the same
    result."""
    torch.manual_seed(0)
    for case in range(200):
        n, vocab = 1 + case % 5, 2 + case % 7
        target = torch.softmax(3 * torch.randn(n + 1, vocab), dim=-1)
        drafts = torch.randint(vocab, (n,))
        one_hot = torch.nn.functional.one_hot(drafts, vocab).float()
        ours = greedy_drafts_outcome(target, drafts, torch.Generator().manual_seed(case)).tolist()
        theirs = sampled_outcome(target, one_hot, drafts, torch.Generator().manual_seed(case)).tolist()
        assert ours == theirs, case


def test_greedy_drafts_edge_cases():
    generator = torch.Generator().manual_seed(0)
    certain = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    # A draft the target is certain of is always accepted; one it gives 0 is always replaced, never by itself.
    assert greedy_drafts_outcome(certain, torch.tensor([1, 2]), generator).tolist() == [2, 0]
    assert greedy_drafts_outcome(certain, torch.tensor([1, 0]), generator).tolist() == [1, 2]
    split = torch.tensor([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]])
    outcomes = {tuple(greedy_drafts_outcome(split, torch.tensor([0]), generator).tolist()) for _ in range(50)}
    assert outcomes <= {(0, 1), (0, 2)}
    with pytest.raises(ValueError, match="need target_probs"):
        greedy_drafts_outcome(certain[:2], torch.tensor([1, 2]), generator)
