"""The T > 0 acceptance estimate (dflash/eval/expected_acceptance.py): its walk equals the replay where acceptance
is certain, and on a tiny target it agrees with live rejection sampling averaged over seeds."""

from __future__ import annotations

import csv
import itertools
import json
import math
import random
import zlib

import numpy as np
import pytest
import torch

from dflash.eval import live
from dflash.eval.expected_acceptance import (block_survival, expected_metrics, expected_traces, head_logits,
                                             walk_expected)
from dflash.eval.live import live_decode
from dflash.eval.metrics import acceptance_metrics
from dflash.eval.replay import replay, replay_steps
from dflash.eval.replay_estimate import sampled_continuations, target_pass_with_final
from tests.schema_options import EVAL_BATCH, eval_options

TEXTS = ["Hi", "What is two plus two?", "Write a haiku about the sea, please."]


def prompts_for(adapter):
    return [adapter.chat_ids([{"role": "user", "content": t}]) for t in TEXTS]


@pytest.mark.parametrize("seed", range(4))
def test_walk_with_certain_acceptance_is_the_replay(seed):
    """Survivals of 0 and 1 make the expected walk the replay's walk: same steps, counts and histogram."""
    rng = random.Random(seed)
    block_size, prompt_len, max_new_tokens = 5, 3, 23
    length = prompt_len + rng.randint(2, max_new_tokens)
    sequence = [rng.randrange(50) for _ in range(length)]
    accept = {t: rng.random() < 0.7 for t in range(length)}  # drafts predicting position t match

    def propose(rows, starts, sizes):
        drafts = torch.full((len(rows), max(sizes) - 1), -5)
        for i, start in enumerate(starts):
            for k in range(1, sizes[i]):
                if start + k < length and accept[start + k]:
                    drafts[i, k - 1] = sequence[start + k]
        return drafts

    greedy = torch.tensor(sequence[1:] + [0])
    trace = replay_steps([sequence], [greedy], [prompt_len], propose, block_size=block_size,
                         max_new_tokens=max_new_tokens)[0]
    survival = np.zeros((length - 1 - prompt_len, block_size))
    for i in range(length - 1 - prompt_len):
        start, alive = prompt_len + i, 1.0
        survival[i, 0] = 1.0
        for k in range(1, block_size):
            alive *= float(start + k < length and accept[start + k])
            survival[i, k] = alive
    expected = walk_expected(survival, prompt_len, length - 1, prompt_len + max_new_tokens, block_size)
    metrics, replayed = expected_metrics([expected], block_size), acceptance_metrics([trace], block_size)
    for key, value in replayed.items():
        if isinstance(value, list):
            assert metrics[key] == pytest.approx(value), key
        else:
            assert metrics[key] == pytest.approx(value), key


def test_a_pass_without_a_step_counts_no_token():
    """An answer cut at a stop string before its first token (a pass that ends at the prompt's last position) and
    a one-token answer (the prefill's) take no step and commit nothing, as in the replay: they leave the pooled
    tau of the others as it is (an empty one counted -1 token)."""
    block_size, prompt_len = 4, 9
    empty = walk_expected(np.zeros((0, block_size)), prompt_len, prompt_len - 1, prompt_len + 20, block_size)
    single = walk_expected(np.zeros((0, block_size)), prompt_len, prompt_len, prompt_len + 20, block_size)
    full = walk_expected(np.ones((3, block_size)), prompt_len, prompt_len + 3, prompt_len + 20, block_size)
    assert (empty.steps, empty.committed) == (single.steps, single.committed) == (0, 0.0)
    assert expected_metrics([empty, single, full], block_size)["tau"] == expected_metrics([full], block_size)["tau"]


def test_survival_rules_on_a_hand_example():
    """Greedy drafts on a greedy pass: the product of p(d) up to the first draft off the pass. On a pass sampled at
    T: greedy drafts survive while they are the stored tokens; sampled drafts by min(1, q/p) of the stored tokens."""
    p = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1], [0.1, 0.8, 0.1]])
    q = torch.tensor([[0.2, 0.7, 0.1], [0.6, 0.2, 0.2], [0.3, 0.3, 0.4]])
    target, draft = p.log()[None], q.log()[None]
    stored = torch.tensor([[1, 0, 1]])
    # Drafts (argmax q) are 1, 0, 2: they agree with the pass at positions 1 and 2, not 3.
    greedy = block_survival(draft, target, stored, temperature=1.0, path_temperature=0.0, draft_sampling="greedy")
    assert greedy[0].tolist() == pytest.approx([0.3, 0.3 * 0.6, 0.3 * 0.6 * 0.1])
    on_sampled = block_survival(draft, target, stored, temperature=1.0, path_temperature=1.0, draft_sampling="greedy")
    assert on_sampled[0].tolist() == [1.0, 1.0, 0.0]
    sampled = block_survival(draft, target, stored, temperature=1.0, path_temperature=1.0, draft_sampling="sampled")
    kept = torch.minimum(torch.ones(3), q[[0, 1, 2], stored[0]] / p[[0, 1, 2], stored[0]]).tolist()
    assert sampled[0].tolist() == pytest.approx([kept[0], kept[0] * kept[1], kept[0] * kept[1] * kept[2]])
    # On a pass sampled at another temperature the stored tokens are weighed by p_T / r and the last position
    # counts its acceptance whatever its token: S_k = prod_{j<k} f_j * beta_k.
    other = block_survival(draft, target, stored, temperature=1.0, path_temperature=0.5, draft_sampling="sampled")
    r = torch.softmax(p.log() / 0.5, dim=-1)[[0, 1, 2], stored[0]]
    f = (torch.minimum(p, q)[[0, 1, 2], stored[0]] / r).tolist()
    beta = torch.minimum(p, q).sum(-1).tolist()
    assert other[0].tolist() == pytest.approx([beta[0], f[0] * beta[1], f[0] * f[1] * beta[2]])


class _ToyModels:
    """A target and a drafter over a 3-token vocabulary whose logits are fixed pseudo-random functions of the
    prefix, small enough to enumerate every continuation and every outcome of live rejection sampling. The
    drafter's logits at block position k depend only on the prefix up to the anchor (as a DFlash drafter's do):
    the target's along its own greedy rollout from the anchor, plus noise, so blocks are accepted in part."""

    vocab = 3

    def __init__(self, temperature: float):
        self.temperature, self._memo = temperature, {}

    def _noise(self, key: tuple, scale: float) -> torch.Tensor:
        generator = torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))
        return torch.randn(self.vocab, generator=generator, dtype=torch.float64) * scale

    def target_logits(self, prefix: list[int]) -> torch.Tensor:
        key = ("target", *prefix)
        if key not in self._memo:
            self._memo[key] = self._noise(key, 2.0)
        return self._memo[key]

    def p(self, prefix: list[int]) -> torch.Tensor:
        return torch.softmax(self.target_logits(prefix) / self.temperature, dim=-1)

    def draft_logits(self, prefix: list[int], size: int) -> torch.Tensor:
        """[size - 1, V]: block positions 1..size-1 of the block anchored at prefix[-1]."""
        tokens, rows = list(prefix), []
        for k in range(1, size):
            logits = self.target_logits(tokens)
            rows.append(logits + self._noise(("drafter", *prefix, k), 1.5))
            tokens.append(int(logits.argmax()))
        return torch.stack(rows)


def _live_outcomes(toy: _ToyModels, prefix: list[int], size: int, draft_sampling: str,
                   draft_temperature: float) -> list[tuple[float, list[int], int]]:
    """Every outcome of one live speculative step from the anchor prefix[-1] with a block of `size`, as the
    serving rules define it: (probability, the prefix after the committed tokens, drafts accepted)."""
    q = torch.softmax(toy.draft_logits(prefix, size) / draft_temperature, dim=-1)
    outcomes: list[tuple[float, list[int], int]] = []

    def position(k: int, context: list[int], mass: float) -> None:  # draft k after k - 1 accepted drafts
        p = toy.p(context)
        if k == size:  # every draft accepted: the bonus token from p
            outcomes.extend((mass * float(p[t]), context + [t], k - 1) for t in range(toy.vocab))
            return
        if draft_sampling == "greedy":  # the argmax, accepted with p(d); else a token != d from p
            d = int(q[k - 1].argmax())
            outcomes.extend((mass * float(p[t]), context + [t], k - 1) for t in range(toy.vocab) if t != d)
            position(k + 1, context + [d], mass * float(p[d]))
            return
        accept = torch.minimum(torch.ones(()), p / q[k - 1])  # d ~ q, accepted with min(1, p/q)
        rejected = float((q[k - 1] * (1 - accept)).sum())
        residual = torch.clamp(p - q[k - 1], min=0)
        if rejected > 0:
            outcomes.extend((mass * rejected * float(residual[t] / residual.sum()), context + [t], k - 1)
                            for t in range(toy.vocab) if residual[t] > 0)
        for d in range(toy.vocab):
            position(k + 1, context + [d], mass * float(q[k - 1, d] * accept[d]))

    position(1, list(prefix), 1.0)
    return outcomes


def _exact_live(toy, prefix, *, max_length, block_size, draft_sampling, draft_temperature, memo) -> tuple:
    """(expected steps, expected accepted drafts) of live decoding from the anchor prefix[-1] to max_length
    tokens, every outcome enumerated (committed tokens past max_length are cut, as the decoder cuts them)."""
    if len(prefix) >= max_length:
        return 0.0, 0.0
    key = tuple(prefix)
    if key not in memo:
        size = min(block_size, max_length - (len(prefix) - 1))
        steps, accepted = 1.0, 0.0
        for mass, after, a in _live_outcomes(toy, prefix, size, draft_sampling, draft_temperature):
            more = _exact_live(toy, after[:max_length], max_length=max_length, block_size=block_size,
                               draft_sampling=draft_sampling, draft_temperature=draft_temperature, memo=memo)
            steps, accepted = steps + mass * more[0], accepted + mass * (a + more[1])
        memo[key] = (steps, accepted)
    return memo[key]


@pytest.mark.parametrize("draft_sampling,draft_temperature", [("greedy", None), ("sampled", None), ("sampled", 0.5)])
def test_estimate_on_passes_sampled_at_t_is_live_decoding_exactly(draft_sampling, draft_temperature):
    """Averaged over every continuation, weighted by its probability at T, the estimate's expected steps and
    accepted drafts are those of live rejection sampling, every outcome of which is enumerated on a toy target."""
    temperature, block_size, prompt, max_new_tokens = 1.0, 4, [0, 2], 6
    toy = _ToyModels(temperature)
    max_length = len(prompt) + max_new_tokens
    sequences, weights = [], []
    for continuation in itertools.product(range(toy.vocab), repeat=max_new_tokens):
        sequence = prompt + list(continuation)
        sequences.append(sequence)
        weights.append(math.prod(float(toy.p(sequence[:t])[sequence[t]]) for t in range(len(prompt), max_length)))
    assert sum(weights) == pytest.approx(1.0)
    finals = [torch.stack([toy.target_logits(s[: t + 1]) for t in range(len(s))]).float() for s in sequences]

    def draft_logits(rows, starts, sizes):
        out = torch.zeros(len(rows), max(sizes) - 1, toy.vocab)
        for i, (row, start, size) in enumerate(zip(rows, starts, sizes)):
            out[i, : size - 1] = toy.draft_logits(sequences[row][: start + 1], size)
        return out

    traces = expected_traces(draft_logits, torch.eye(toy.vocab), finals, sequences, [len(prompt)] * len(sequences),
                             block_size=block_size, max_new_tokens=max_new_tokens, temperature=temperature,
                             path_temperature=temperature, draft_sampling=draft_sampling,
                             draft_temperature=draft_temperature)
    estimated_steps = sum(w * t.steps for w, t in zip(weights, traces))
    estimated_accepted = sum(w * t.accepted for w, t in zip(weights, traces))
    memo, steps, accepted = {}, 0.0, 0.0
    first = toy.p(prompt)
    for token in range(toy.vocab):  # the first token comes from the prefill; steps start at it
        more = _exact_live(toy, prompt + [token], max_length=max_length, block_size=block_size,
                           draft_sampling=draft_sampling, draft_temperature=draft_temperature or temperature,
                           memo=memo)
        steps, accepted = steps + float(first[token]) * more[0], accepted + float(first[token]) * more[1]
    assert 1.2 < (max_new_tokens - 1) / steps < block_size - 0.5  # blocks are accepted in part
    assert estimated_steps == pytest.approx(steps, rel=1e-5)
    assert estimated_accepted == pytest.approx(accepted, rel=1e-5)


def test_near_zero_temperature_on_the_greedy_pass_is_the_greedy_replay(tiny_target, make_drafter):
    """At T -> 0 along the greedy continuation, the estimate of a real drafter is its greedy replay."""
    adapter = tiny_target("llama")
    drafter = make_drafter(adapter, block_size=4, std=0.2)
    prompts, stop_ids = prompts_for(adapter), adapter.stop_token_ids()
    replayed = replay(drafter, adapter, prompts, max_new_tokens=16, stop_token_ids=stop_ids, batch_size=3)
    sequences = [list(p) + r.continuation for p, r in zip(prompts, replayed)]
    from dflash.eval.replay import DrafterProposer

    features, finals = target_pass_with_final(adapter, sequences, drafter.config.target_layer_ids)
    proposer = DrafterProposer(drafter, adapter, sequences, features)
    head = adapter.lm_head_weight()
    traces = expected_traces(head_logits(proposer.hidden, head), head, finals, sequences, [len(p) for p in prompts],
                             block_size=4, max_new_tokens=16, temperature=1e-4, path_temperature=0.0,
                             draft_sampling="greedy")
    metrics, exact = expected_metrics(traces, 4), acceptance_metrics([r.trace for r in replayed], 4)
    for key in ("tau", "acceptance_rate", "num_steps", "num_accepted", "num_drafted"):
        assert metrics[key] == pytest.approx(exact[key], abs=1e-6), key


class _Rollout:
    """An oracle drafter that depends only on the prefix up to the anchor, as a DFlash drafter does: its logits at
    block position k are the target's own logits along the target's greedy rollout from the anchor."""

    def __init__(self, adapter):
        self.adapter, self.memo = adapter, {}

    def next_logits(self, tokens: list[int]) -> torch.Tensor:
        """The target's logits after `tokens`, memoized per sequence: the rollouts of neighbouring anchors (and of
        the live decodes and the estimates) go through the same sequences."""
        key = tuple(tokens)
        if key not in self.memo:
            with torch.no_grad():
                self.memo[key] = self.adapter.model(torch.tensor([tokens])).logits[0, -1].float()
        return self.memo[key]

    def logits(self, prefix: list[int], size: int) -> torch.Tensor:
        tokens, rows = list(prefix), []
        for _ in range(size - 1):
            rows.append(self.next_logits(tokens))
            tokens.append(int(rows[-1].argmax()))
        return torch.stack(rows)


class _TrackedTarget:
    """A live decode's cached target that also keeps the tokens in its cache, so the oracle sees the prefix."""

    def __init__(self, target):
        self.target, self.tokens = target, []

    def forward(self, tokens, **kwargs):
        self.tokens += list(tokens)
        return self.target.forward(tokens, **kwargs)

    def verify(self, block):
        self.tokens += block.tolist()
        return self.target.verify(block)

    def rollback(self, length):
        self.tokens = self.tokens[:length]
        return self.target.rollback(length)


def _live_tau(adapter, drafter, prompts, rollout, monkeypatch, *, temperature, draft_sampling, seed, max_new_tokens,
              draft_temperature=None):
    tracked = []
    original = live._target

    def target(*args, **kwargs):
        made, engine = original(*args, **kwargs)
        tracked.append(_TrackedTarget(made))
        return tracked[-1], engine

    def draft(context, anchor, size):
        logits = rollout.logits(tracked[-1].tokens[: context.length] + [anchor], size)
        return logits, logits.argmax(dim=-1)

    monkeypatch.setattr(live, "_target", target)
    monkeypatch.setattr(live, "draft_block", draft)
    generator = torch.Generator().manual_seed(seed)
    traces = [live_decode(drafter, adapter, p, max_new_tokens=max_new_tokens, stop_token_ids=[],
                          temperature=temperature, generator=generator, target_engine="hf",
                          draft_sampling=draft_sampling, draft_temperature=draft_temperature).trace for p in prompts]
    return acceptance_metrics(traces, drafter.config.block_size)["tau"]


def _estimated_tau(adapter, drafter, prompts, rollout, *, temperature, draft_sampling, seed, max_new_tokens,
                   draft_temperature=None):
    continuations = sampled_continuations(adapter, prompts, max_new_tokens=max_new_tokens, stop_token_ids=[],
                                          temperature=temperature, seed=seed, engine="hf", batch_size=EVAL_BATCH)
    sequences = [list(p) + c for p, c in zip(prompts, continuations)]
    _, finals = target_pass_with_final(adapter, sequences, drafter.config.target_layer_ids)

    def draft_logits(rows, starts, sizes):
        out = torch.zeros(len(rows), max(sizes) - 1, adapter.vocab_size)
        for i, (row, start, size) in enumerate(zip(rows, starts, sizes)):
            out[i, : size - 1] = rollout.logits(sequences[row][: start + 1], size)
        return out

    traces = expected_traces(draft_logits, adapter.lm_head_weight(), finals, sequences, [len(p) for p in prompts],
                             block_size=drafter.config.block_size, max_new_tokens=max_new_tokens,
                             temperature=temperature, path_temperature=temperature, draft_sampling=draft_sampling,
                             draft_temperature=draft_temperature)
    return expected_metrics(traces, drafter.config.block_size)["tau"]


@pytest.fixture(scope="module")
def rollout(tiny_target) -> _Rollout:
    """One oracle for the three cases below: the target's logits after a sequence are the same in each, and their
    estimates walk the same sampled continuations (the seeds and the temperature are the same)."""
    return _Rollout(tiny_target("llama"))


@pytest.mark.slow
@pytest.mark.parametrize("draft_sampling,draft_temperature", [("greedy", None), ("sampled", None), ("sampled", 0.025)])
def test_estimate_agrees_with_live_rejection_sampling(draft_sampling, draft_temperature, tiny_target, make_drafter,
                                                      rollout, monkeypatch):
    """Over 16 seeds, the mean estimated tau (each seed: the target's own sampled continuations) and the mean live
    tau (each seed: rejection sampling) agree within 4 standard errors of their difference, from the seeds' spread.
    T = 0.05 makes the tiny random target's next-token distribution peaked enough (max p ~0.6) for blocks to be
    accepted in part. Drafts drawn at half the temperature (sharper than the target) agree too."""
    adapter = tiny_target("llama")
    drafter = make_drafter(adapter, block_size=4)
    prompts, temperature, max_new_tokens, seeds = prompts_for(adapter), 0.05, 16, range(16)
    settings = dict(temperature=temperature, draft_sampling=draft_sampling, max_new_tokens=max_new_tokens,
                    draft_temperature=draft_temperature)
    lives = [_live_tau(adapter, drafter, prompts, rollout, monkeypatch, seed=s, **settings) for s in seeds]
    estimates = [_estimated_tau(adapter, drafter, prompts, rollout, seed=s, **settings) for s in seeds]
    error = math.sqrt(np.var(lives, ddof=1) / len(lives) + np.var(estimates, ddof=1) / len(estimates))
    print(f"live {np.mean(lives):.3f} +- {np.std(lives, ddof=1):.3f}, estimate {np.mean(estimates):.3f} +- "
          f"{np.std(estimates, ddof=1):.3f}, standard error of the difference {error:.3f}")
    assert np.mean(lives) > 1.3  # blocks are accepted in part: the comparison means something
    assert abs(np.mean(lives) - np.mean(estimates)) < 4 * error


def test_replay_at_a_temperature_writes_the_estimate(tiny_target, make_drafter, tmp_path):
    """evaluate(mode=replay, T > 0) gives the estimate, named in the summary; the same seed, the same figures."""
    from dflash.eval.evaluate import evaluate, format_table, write_summary

    adapter = tiny_target("llama")
    drafter = make_drafter(adapter, block_size=4, std=0.2)
    sets = {"a": prompts_for(adapter)[:2], "b": prompts_for(adapter)[2:]}
    settings = eval_options(max_new_tokens=10, show_progress=False, temperature=0.05, draft_sampling="greedy", seed=3)
    summary = evaluate(drafter, adapter, sets, categories={"a": ["math", "writing"]}, **settings)
    assert "T=0.05" in summary["estimate"] and summary["mode"] == "replay"
    overall = summary["overall"]
    assert 1.0 <= overall["tau"] <= 4.0 and overall["num_tokens"] == sum(
        summary["prompt_sets"][n]["num_tokens"] for n in ("a", "b"))
    assert overall["num_steps"] == pytest.approx(overall["num_tokens"] / overall["tau"])
    assert sum(overall["committed_histogram"]) == pytest.approx(overall["num_steps"])
    assert evaluate(drafter, adapter, sets, **settings)["overall"]["tau"] == pytest.approx(overall["tau"])
    assert "replay estimate of the acceptance at T=0.05" in format_table(summary)
    write_summary(summary, str(tmp_path))
    assert (tmp_path / "summary.csv").read_text().splitlines()[1].startswith("a,")
    # prompts.csv: a row per prompt (expectations), which summary.json leaves out.
    prompts = list(csv.DictReader((tmp_path / "prompts.csv").open()))
    assert [(r["prompt_set"], r["category"]) for r in prompts] == [("a", "math"), ("a", "writing")] + [("b", "")] * (
        len(sets["b"]))
    assert sum(float(r["steps"]) for r in prompts) == pytest.approx(overall["num_steps"])
    assert "per_prompt" not in json.loads((tmp_path / "summary.json").read_text())


def test_drafts_drawn_at_their_own_temperature():
    """draft_temperature sets q = softmax(z / draft_temperature) alone: the same survival as drafter logits scaled
    by T / draft_temperature drawn at T; None is T itself; greedy drafts do not read it."""
    generator = torch.Generator().manual_seed(0)
    n, width, vocab, temperature = 6, 4, 9, 0.8
    draft, target = torch.randn(n, width, vocab, generator=generator), torch.randn(n, width, vocab, generator=generator)
    stored = torch.randint(0, vocab, (n, width), generator=generator)
    rule = dict(temperature=temperature, path_temperature=temperature)
    sharp = block_survival(draft, target, stored, draft_sampling="sampled", draft_temperature=0.4, **rule)
    assert torch.allclose(sharp, block_survival(draft * 2, target, stored, draft_sampling="sampled", **rule))
    plain = block_survival(draft, target, stored, draft_sampling="sampled", **rule)
    assert torch.equal(plain, block_survival(draft, target, stored, draft_sampling="sampled",
                                             draft_temperature=temperature, **rule))
    assert not torch.allclose(sharp, plain)
    greedy = block_survival(draft, target, stored, draft_sampling="greedy", **rule)
    assert torch.equal(greedy, block_survival(draft, target, stored, draft_sampling="greedy", draft_temperature=0.4,
                                              **rule))


def test_the_summary_names_the_draft_temperature(tiny_target, make_drafter):
    from dflash.eval.evaluate import evaluate, format_table

    adapter = tiny_target("llama")
    drafter = make_drafter(adapter, block_size=4, std=0.2)
    sets = {"a": prompts_for(adapter)[:1]}
    settings = eval_options(max_new_tokens=6, show_progress=False, temperature=0.05, draft_sampling="sampled")
    summary = evaluate(drafter, adapter, sets, draft_temperature=0.02, **settings)
    assert summary["draft_temperature"] == 0.02
    assert "sampled drafts drawn at T=0.02" in format_table(summary)
    assert "draft_temperature" not in evaluate(drafter, adapter, sets, **settings)
    with pytest.raises(ValueError, match="draft_temperature must be a number > 0"):
        evaluate(drafter, adapter, sets, draft_temperature=0.0, **settings)


@pytest.mark.parametrize("draft_sampling", ["greedy", "sampled"])
def test_the_logit_transform_reaches_both_distributions(draft_sampling):
    """A target whose logit transform doubles its logits (a scale of 2, dflash/models/targets/logit_transform.py)
    shares its head with the drafter: the estimate at T equals the one without the transform at T/2, where the
    target's p, the drafter's q and the pass's own temperature all sharpen alike. Greedy drafts read p on a greedy
    pass (on a pass sampled at T they survive by matching its tokens alone)."""
    from dflash.models.targets.logit_transform import LogitTransform

    generator = torch.Generator().manual_seed(0)
    vocab, hidden, block_size = 11, 5, 4
    head = torch.randn(vocab, hidden, generator=generator)
    sequences = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (9, 12)]
    finals = [torch.randn(len(s), hidden, generator=generator) for s in sequences]
    drafter_out = {(r, s): torch.randn(block_size, hidden, generator=generator)
                   for r, seq in enumerate(sequences) for s in range(len(seq))}

    def hidden_of(rows, starts, sizes):
        return torch.stack([drafter_out[(r, s)] for r, s in zip(rows, starts)])

    def estimate(transform, temperature):
        traces = expected_traces(head_logits(hidden_of, head, transform), head, finals, sequences, [3, 4],
                                 block_size=block_size, max_new_tokens=10, temperature=temperature,
                                 path_temperature=temperature if draft_sampling == "sampled" else 0.0,
                                 draft_sampling=draft_sampling, transform=transform)
        return expected_metrics(traces, block_size)

    doubled, halved = estimate(LogitTransform(scale=2.0), 1.0), estimate(None, 0.5)
    assert doubled["tau"] == pytest.approx(halved["tau"]) and doubled["per_position"] == pytest.approx(
        halved["per_position"])
    assert estimate(None, 1.0)["tau"] != pytest.approx(doubled["tau"])
