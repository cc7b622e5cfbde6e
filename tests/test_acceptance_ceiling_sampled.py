"""bench/acceptance_ceiling.py, sampled rule: the block-parallel ceiling's estimator against exact answers.

The core (marginals from rollouts, survival of drafts verified by rejection sampling) runs on conditionals given as
functions of the drafted prefix; a two-token Markov chain has a ceiling computable by enumeration. The KV-cached
target behind the real measurement is checked against full forwards of a tiny random target.
"""

import importlib.util
import itertools
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SPEC = importlib.util.spec_from_file_location("acceptance_ceiling", ROOT / "bench" / "acceptance_ceiling.py")
ceiling = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(ceiling)

# Two tokens; the first draws 0 with probability 0.7, every later one repeats the previous token with probability 0.9.
FIRST = (0.7, 0.3)
REPEAT = 0.9
POSITIONS = 3


def chain_conditional(prefix: tuple[int, ...]) -> tuple[float, float]:
    if not prefix:
        return FIRST
    return (REPEAT, 1 - REPEAT) if prefix[-1] == 0 else (1 - REPEAT, REPEAT)


def batched(conditional):
    """conditional(prefix tuple) -> distribution, as a function of a batch of prefixes [N, J] -> [N, V] float64."""
    def probs(prefixes: torch.Tensor) -> torch.Tensor:
        return torch.tensor([conditional(tuple(row)) for row in prefixes.tolist()], dtype=torch.float64)
    return probs


def rollout_and_along(probs, positions: int):
    """`rollout` and `along` (acceptance_ceiling.Rollout / Along) of a target given by its conditionals."""
    def rollout(count: int, generator: torch.Generator | None = None, greedy: bool = False):
        tokens, out = torch.empty(count, 0, dtype=torch.long), []
        for k in range(positions):
            out.append(probs(tokens))
            if k < positions - 1:
                step = (out[-1].argmax(-1, keepdim=True) if greedy
                        else torch.multinomial(out[-1], 1, generator=generator))
                tokens = torch.cat([tokens, step], dim=1)
        return tokens, torch.stack(out, dim=1)

    def along(drafts: torch.Tensor) -> torch.Tensor:
        return torch.stack([probs(drafts[:, :k]) for k in range(positions)], dim=1)

    return rollout, along


def exact_marginals() -> list[tuple[float, float]]:
    """m_k by enumerating the chain's paths."""
    marginals = []
    for k in range(POSITIONS):
        m = [0.0, 0.0]
        for prefix in itertools.product((0, 1), repeat=k):
            weight = 1.0
            for j, token in enumerate(prefix):
                weight *= chain_conditional(prefix[:j])[token]
            for token, p in enumerate(chain_conditional(prefix)):
                m[token] += weight * p
        marginals.append(tuple(m))
    return marginals


def exact_accepted(marginals) -> float:
    """E[accepted drafts] of blocks y_k ~ m_k (independent) under rejection sampling, by enumerating the blocks."""
    total = 0.0
    for block in itertools.product((0, 1), repeat=POSITIONS):
        weight, survival, accepted = 1.0, 1.0, 0.0
        for k, token in enumerate(block):
            weight *= marginals[k][token]
            survival *= min(1.0, chain_conditional(block[:k])[token] / marginals[k][token])
            accepted += survival
        total += weight * accepted
    return total


def test_position_only_target_accepts_every_draft():
    # Conditionals that depend on the position only: the marginal is the conditional, every draft is accepted.
    table = torch.softmax(torch.randn(5, 7, generator=torch.Generator().manual_seed(1), dtype=torch.float64), -1)
    rollout, along = rollout_and_along(lambda prefixes: table[prefixes.shape[1]].expand(prefixes.shape[0], -1), 5)
    _, probs = rollout(8, torch.Generator().manual_seed(2))
    assert torch.allclose(probs.mean(0), table, rtol=0, atol=1e-12)
    survival = ceiling.block_parallel_survival(rollout, along, rollouts=8, drafts=64,
                                               generator=torch.Generator().manual_seed(3))[1.0]
    summary = ceiling.summarize(survival.mean(0, keepdim=True), [0])
    assert summary["tau"] == pytest.approx(1 + 5, abs=1e-9)
    assert summary["survival"] == [1.0] * 5


def test_draft_survival_over_all_blocks_is_the_exact_ceiling():
    # With the exact marginals, the probability-weighted survival over every possible block is the exact expectation.
    marginals = exact_marginals()
    assert marginals[0] == FIRST and marginals[1] == pytest.approx((0.66, 0.34))
    expected = exact_accepted(marginals)
    _, along = rollout_and_along(batched(chain_conditional), POSITIONS)
    blocks = torch.tensor(list(itertools.product((0, 1), repeat=POSITIONS)))
    proposal = torch.tensor(marginals, dtype=torch.float64)
    survival = ceiling.draft_survival(proposal, blocks, along(blocks))
    weights = proposal.gather(-1, blocks.T).T.prod(dim=1)
    assert float((weights[:, None] * survival).sum()) == pytest.approx(expected, abs=1e-12)
    # The chain's ceiling is far from both all-accepted (3) and one-accepted, so a wrong formula shows.
    assert 1.6 < expected < 2.4


def test_rejection_sampling_with_uniform_draws_agrees_with_the_analytic_expectation():
    marginals = exact_marginals()
    generator, trials, accepted = torch.Generator().manual_seed(0), 20000, 0
    m = torch.tensor(marginals, dtype=torch.float64)
    blocks = torch.multinomial(m, trials, replacement=True, generator=generator).T
    uniforms = torch.rand(trials, POSITIONS, generator=generator, dtype=torch.float64)
    for block, draws in zip(blocks.tolist(), uniforms.tolist()):
        for k, token in enumerate(block):
            if draws[k] >= chain_conditional(tuple(block[:k]))[token] / marginals[k][token]:
                break
            accepted += 1
    # Per-trial standard deviation < 1.2: 0.03 is about 3.5 standard errors at 20000 trials.
    assert accepted / trials == pytest.approx(exact_accepted(marginals), abs=0.03)


def test_estimator_with_rollouts_reaches_the_exact_ceiling():
    rollout, along = rollout_and_along(batched(chain_conditional), POSITIONS)
    survival = ceiling.block_parallel_survival(rollout, along, rollouts=4000, drafts=8000,
                                               generator=torch.Generator().manual_seed(0), powers=(1.0, 64.0))
    summary = ceiling.summarize(survival[1.0].mean(0, keepdim=True), [0])
    assert summary["tau"] == pytest.approx(1 + exact_accepted(exact_marginals()), abs=0.03)
    assert summary["survival"][0] == 1.0  # m_1 = p_1 exactly
    # q ~ m^64 is nearly the point mass on token 0 at every position: accepted with 0.7, 0.7*0.9, 0.7*0.81.
    sharp = ceiling.summarize(survival[64.0].mean(0, keepdim=True), [0])
    assert sharp["survival"] == pytest.approx([0.7, 0.63, 0.567], abs=1e-3)


def test_summarize_errors_and_conditional_acceptance():
    survivals = torch.tensor([[1.0, 0.5, 0.25], [1.0, 0.7, 0.35], [1.0, 0.3, 0.0]])
    summary = ceiling.summarize(survivals, [0, 0, 1])
    taus = torch.tensor([2.75, 3.05, 2.3], dtype=torch.float64)
    assert summary["tau"] == pytest.approx(float(taus.mean()), abs=1e-4)
    assert summary["se_anchors"] == pytest.approx(float(taus.std() / 3 ** 0.5), abs=1e-4)
    assert summary["se_prompts"] == pytest.approx(float(torch.tensor([2.9, 2.3]).std() / 2 ** 0.5), abs=1e-4)
    assert summary["conditional_acceptance"] == pytest.approx([1.0, 0.5, 0.4], abs=1e-4)


def test_cached_anchor_target_matches_full_forwards(tiny_target):
    adapter = tiny_target("llama")
    model, vocab = adapter.model, adapter.vocab_size
    generator = torch.Generator().manual_seed(0)
    sequence = torch.randint(0, vocab, (30,), generator=generator).tolist()
    cache = ceiling.context_cache(model, sequence)
    target = ceiling.AnchorTarget(model, cache, sequence[:17], temperature=0.7, positions=4)

    def full(block: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([sequence[:17] + block])).logits[0, 16:20]
        return torch.softmax(logits.float() / 0.7, dim=-1)

    drafts = torch.randint(0, vocab, (3, 4), generator=generator)
    along = target.along(drafts)
    for row in range(3):
        torch.testing.assert_close(along[row], full(drafts[row].tolist()), rtol=0, atol=1e-5)
    tokens, probs = target.rollout(2, generator)
    assert tokens.shape == (2, 3) and probs.shape == (2, 4, vocab)
    for row in range(2):
        torch.testing.assert_close(probs[row], full(tokens[row].tolist() + [0]), rtol=0, atol=1e-5)
    # The cache of the whole sequence is left as it was: a second anchor reads the same context.
    again = ceiling.AnchorTarget(model, cache, sequence[:17], temperature=0.7, positions=4).along(drafts)
    torch.testing.assert_close(again, along, rtol=0, atol=0)
    greedy_tokens, greedy_probs = target.rollout(1, greedy=True)
    assert greedy_tokens[0].tolist() == greedy_probs[0, :3].argmax(-1).tolist()
