"""The acceptance evaluator: metrics by hand, and replay == a plain speculative decoding loop on tiny targets."""

from __future__ import annotations

import csv
import json
import os
import types

import pytest
import torch

from dflash.eval.evaluate import evaluate, format_table, load_prompt_sets, write_summary
from dflash.eval.metrics import PhaseTimer, StepTrace, acceptance_metrics
from dflash.eval.replay import DrafterProposer, greedy_continuations, replay, target_pass
from tests.schema_options import EVAL_BATCH, eval_options

FAMILIES = ["llama", "qwen3_5"]


# Metrics ---------------------------------------------------------------------------------------------------------


def test_metrics_by_hand():
    # B = 4. Prompt 1: three full steps. Prompt 2: a full step, then a last step with only 2 positions left in the
    # continuation, both drafts accepted, so 2 tokens are committed and no bonus.
    first = StepTrace([4, 2, 1], [3, 1, 0], [3, 3, 3])
    second = StepTrace([4, 2], [3, 2], [3, 2])
    m = acceptance_metrics([first, second], block_size=4)
    assert m["tau"] == pytest.approx(13 / 5)
    assert m["tau_prompt_mean"] == pytest.approx((7 / 3 + 6 / 2) / 2)
    assert m["acceptance_rate"] == pytest.approx(9 / 14)
    # k=1: accepted in 4 of 5 steps; k=2: 3 of 5; k=3: 2 of the 4 steps that drafted position 3.
    assert m["per_position"] == pytest.approx([4 / 5, 3 / 5, 2 / 4])
    assert m["committed_histogram"] == [0, 1, 2, 0, 2]
    assert (m["num_prompts"], m["num_steps"], m["num_tokens"], m["num_accepted"], m["num_drafted"]) == (2, 5, 13, 9, 14)


def test_metrics_empty_and_invalid():
    m = acceptance_metrics([StepTrace()], block_size=4)
    assert m["tau"] is None and m["acceptance_rate"] is None and m["per_position"] == [None, None, None]
    assert m["num_prompts"] == 1 and m["num_steps"] == 0
    with pytest.raises(ValueError, match="committed=5"):
        acceptance_metrics([StepTrace([5], [3], [3])], block_size=4)
    with pytest.raises(ValueError, match="accepted=3, drafted=2"):
        acceptance_metrics([StepTrace([3], [3], [2])], block_size=4)
    with pytest.raises(ValueError, match="differ in length"):
        acceptance_metrics([StepTrace([1, 1], [0], [3])], block_size=4)


def test_format_table_and_write_summary(tmp_path):
    traces = [StepTrace([4, 2, 1], [3, 1, 0], [3, 3, 3])]
    metrics = {**acceptance_metrics(traces, 4), "greedy_mismatches": 0}
    summary = {"schema_version": 1, "block_size": 4, "max_new_tokens": 8, "prompt_sets": {"gsm8k": metrics},
               "overall": metrics}
    table = format_table(summary)
    assert "gsm8k" in table and "overall" in table and "2.33" in table and "0.444" in table
    path = write_summary(summary, str(tmp_path / "eval"))
    with open(path) as f:
        assert json.load(f) == summary
    assert os.path.getsize(tmp_path / "eval" / "per_position.png") > 1000
    assert os.path.getsize(tmp_path / "eval" / "committed_histogram.png") > 1000
    assert sorted(os.listdir(tmp_path / "eval")) == ["committed_histogram.png", "per_position.png", "summary.csv",
                                                     "summary.json"]
    with open(tmp_path / "eval" / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["prompt_set"] for r in rows] == ["gsm8k", "overall"]
    assert float(rows[1]["tau"]) == pytest.approx(7 / 3) and rows[1]["num_drafted"] == "9"
    assert rows[1]["greedy_mismatches"] == "0" and rows[1]["speedup"] == ""


def test_a_step_cost_below_one_target_step_is_called_noise():
    """A tiny target's live timings on a shared CPU showed 2.05x for a drafter accepting nothing (a step of 0.43
    target steps), then 0.45x: a speculative step runs a target forward and more, so below 1 the clock is noise."""
    traces = [StepTrace([4, 2, 1], [3, 1, 0], [3, 3, 3])]
    for cost, said in ((0.43, True), (1.35, False)):
        metrics = {**acceptance_metrics(traces, 4), "speedup": 2.05, "step_cost": cost}
        table = format_table({"block_size": 4, "prompt_sets": {"gsm8k": metrics}, "overall": metrics})
        assert ("(a speculative step measured at 0.43 target-only steps, which runs one target forward and more: the "
                "timings are noise here, a shared or busy machine; tau is not)" in table) == said


# A plain speculative decoding loop, written independently of the replay -------------------------------------------


def plain_speculative_decode(adapter, prompt, draft, *, block_size, max_new_tokens, stop_ids):
    """Reference-loop semantics with the target re-run on the whole committed sequence for every verify.

    draft(tokens, start, size) -> size-1 draft ids for the block anchored at tokens[start] (tokens = committed).
    Returns (committed tokens per step, committed sequence).
    """
    def greedy(tokens):
        with torch.no_grad():
            return adapter.model(torch.tensor([tokens])).logits[0].argmax(-1).tolist()

    tokens = list(prompt) + [greedy(prompt)[-1]]
    start, max_length = len(prompt), len(prompt) + max_new_tokens
    steps, stopped = [], tokens[start] in stop_ids
    while start + 1 < max_length and not stopped:
        size = min(block_size, max_length - start)
        drafts = draft(tokens[: start + 1], start, size)
        posterior = greedy(tokens[: start + 1] + drafts)[start:]
        accepted = 0
        while accepted < size - 1 and drafts[accepted] == posterior[accepted]:
            accepted += 1
        new = (drafts[:accepted] + [posterior[accepted]])[: max_length - start - 1]
        for i, token in enumerate(new):
            if token in stop_ids:
                new, stopped = new[: i + 1], True
                break
        tokens = tokens[: start + 1] + new
        start += len(new)
        steps.append(len(new))
    return steps, tokens


def drafter_draft(drafter, adapter):
    """Drafts from the drafter with features from a fresh target pass over the committed tokens (no replay)."""

    def draft(tokens, start, size):
        features = adapter.capture(torch.tensor([tokens[:start]]), None, drafter.target_layer_ids)
        block = torch.tensor([[tokens[start]] + [drafter.mask_token_id] * (size - 1)])
        with torch.no_grad():
            hidden = drafter(torch.arange(start + size)[None], adapter.embed_tokens()(block), features)
        return (hidden[0, 1:] @ adapter.lm_head_weight().T).argmax(-1).tolist()

    return draft


def corrupt(token, position, vocab_size):
    """Deterministically wrong drafts at some positions, so acceptance lengths vary from step to step."""
    return (token + 1) % vocab_size if position % 5 == 0 or position % 7 == 3 else token


def own_greedy(adapter, prompt, num_tokens):
    """The target's greedy tokens after `prompt`: a full forward per token, independent of the code under test."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(num_tokens):
            tokens.append(int(adapter.model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


def noisy_oracle_draft(adapter, prompt, num_tokens):
    """Drafts = the target's own greedy tokens, corrupted by position."""
    truth = list(prompt) + own_greedy(adapter, prompt, num_tokens)

    def draft(tokens, start, size):
        return [corrupt(truth[start + k], start + k, adapter.vocab_size) for k in range(1, size)]

    return draft


def oracle_proposer(noisy):
    """A DrafterProposer.__call__ that reads the true continuation from the replay's own sequences."""

    def propose(self, rows, starts, sizes):
        drafts = torch.full((len(rows), max(sizes) - 1), self.drafter.mask_token_id, dtype=torch.long)
        for i, (r, s, size) in enumerate(zip(rows, starts, sizes)):
            true = self.sequences[r][s + 1 : s + size]
            if noisy:
                true = [corrupt(t, s + k, self.adapter.vocab_size) for k, t in enumerate(true, start=1)]
            drafts[i, : len(true)] = torch.tensor(true, dtype=torch.long)
        return drafts

    return propose


def prompts_for(adapter):
    texts = ["Hi", "What is two plus two?", "Write a haiku about the sea, please."]
    return [adapter.chat_ids([{"role": "user", "content": t}]) for t in texts]


# Replay vs the plain loop ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_replay_matches_plain_loop_with_varied_acceptance(family, tiny_target, make_drafter, monkeypatch):
    adapter = tiny_target(family)
    drafter = make_drafter(adapter, block_size=5)
    prompts = prompts_for(adapter)
    max_new_tokens = 23
    # A stop token first generated mid-continuation (when one exists: the tiny llama repeats one token), so the stop
    # path and the max_new_tokens path both run.
    free = greedy_continuations(adapter, prompts, max_new_tokens=max_new_tokens, stop_token_ids=[],
                                batch_size=EVAL_BATCH)
    stop_ids = [c[9] for c in free if c.index(c[9]) >= 3][:1]
    monkeypatch.setattr(DrafterProposer, "__call__", oracle_proposer(noisy=True))
    results = replay(drafter, adapter, prompts, max_new_tokens=max_new_tokens, stop_token_ids=stop_ids, batch_size=2)
    committed = []
    for prompt, result in zip(prompts, results):
        draft = noisy_oracle_draft(adapter, prompt, max_new_tokens + 5)
        steps, tokens = plain_speculative_decode(adapter, prompt, draft, block_size=5, max_new_tokens=max_new_tokens,
                                                 stop_ids=stop_ids)
        assert result.greedy_mismatches == 0
        assert list(prompt) + result.continuation == tokens
        assert result.trace.committed == steps
        committed += steps
    assert len(set(committed)) >= 3, f"acceptance did not vary: {committed}"
    if stop_ids:
        assert any(r.continuation[-1] in stop_ids and len(r.continuation) <= 10 for r in results)
    if family == "qwen3_5":
        assert stop_ids, "the hybrid target should exercise the stop-token path"


@pytest.mark.parametrize("family", FAMILIES)
def test_random_drafter_matches_plain_loop(family, tiny_target, make_drafter):
    adapter = tiny_target(family)
    drafter = make_drafter(adapter)
    prompts = prompts_for(adapter)[:2]
    summary = evaluate(drafter, adapter, {"chat": prompts}, max_new_tokens=12, show_progress=False, **eval_options())
    steps = []
    for prompt in prompts:
        prompt_steps, _ = plain_speculative_decode(adapter, prompt, drafter_draft(drafter, adapter), block_size=4,
                                                   max_new_tokens=12, stop_ids=adapter.stop_token_ids())
        steps += prompt_steps
    chat = summary["prompt_sets"]["chat"]
    assert chat["num_steps"] == len(steps) and chat["num_tokens"] == sum(steps)
    assert chat["tau"] == pytest.approx(sum(steps) / len(steps))
    assert 1.0 <= chat["tau"] < 1.3
    assert summary["overall"]["greedy_mismatches"] == 0
    assert summary["block_size"] == 4


def test_perfect_drafter_commits_full_blocks(tiny_target, make_drafter, monkeypatch):
    adapter = tiny_target("qwen3_5")
    drafter = make_drafter(adapter, block_size=4)
    monkeypatch.setattr(DrafterProposer, "__call__", oracle_proposer(noisy=False))
    prompts = prompts_for(adapter)
    summary = evaluate(drafter, adapter, {"a": prompts[:2], "b": prompts[2:]}, max_new_tokens=20, show_progress=False,
                       **eval_options())
    for result in replay(drafter, adapter, prompts, max_new_tokens=20, batch_size=EVAL_BATCH):
        committed = result.trace.committed
        assert all(c == 4 for c in committed[:-1]) and sum(committed) == len(result.continuation) - 1
        if len(result.continuation) == 20:
            # The prefill's token, then 19 tokens: four full blocks and a last step cut by max_new_tokens.
            assert committed == [4, 4, 4, 4, 3]
        assert result.trace.accepted == [min(c, 3) for c in committed]
    overall = summary["overall"]
    assert overall["acceptance_rate"] == 1.0 and overall["per_position"] == [1.0, 1.0, 1.0]
    assert overall["tau"] == pytest.approx(overall["num_tokens"] / overall["num_steps"]) and overall["tau"] > 3.5


def stored_proposer(adapter, drafter):
    """(prompts, sequences, DrafterProposer) over 6 greedy tokens after each test prompt."""
    prompts = prompts_for(adapter)
    continuations = greedy_continuations(adapter, prompts, max_new_tokens=6, stop_token_ids=[], batch_size=EVAL_BATCH)
    sequences = [p + c for p, c in zip(prompts, continuations)]
    features, _ = target_pass(adapter, sequences, drafter.target_layer_ids)
    return prompts, sequences, DrafterProposer(drafter, adapter, sequences, features)


def direct_hidden(adapter, drafter, sequence, start, size):
    """The drafter's own forward on the block of `size` anchored at `start`, features from a fresh capture."""
    context = adapter.capture(torch.tensor([sequence[:start]]), None, drafter.target_layer_ids)
    block = torch.tensor([[sequence[start]] + [drafter.mask_token_id] * (size - 1)])
    with torch.no_grad():
        return drafter(torch.arange(start + size)[None], adapter.embed_tokens()(block), context)[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_drafting_matches_direct_call(family, tiny_target, make_drafter):
    # Sliding window 8 < context length, contexts of different lengths left-padded in one batch.
    adapter = tiny_target(family)
    drafter = make_drafter(adapter, std=0.2)
    prompts, sequences, proposer = stored_proposer(adapter, drafter)
    rows, starts = [0, 1, 2, 0], [len(prompts[0]), len(prompts[1]) + 2, len(prompts[2]) + 1, len(prompts[0]) + 3]
    batched = proposer.hidden(rows, starts, 4)
    for i, (r, s) in enumerate(zip(rows, starts)):
        direct = direct_hidden(adapter, drafter, sequences[r], s, 4)
        torch.testing.assert_close(batched[i], direct, atol=1e-5, rtol=1e-4)
    assert min(starts) > drafter.config.sliding_window
    assert not torch.allclose(batched[0], batched[3], atol=1e-3)


def test_blocks_of_different_sizes_in_one_proposal_match_direct_calls(tiny_target, make_drafter):
    # Blocks shortened near max_new_tokens share the step's drafter forward, right-padded and masked: each row must
    # equal the drafter run on its own block size (full-attention drafts depend on the block length).
    adapter = tiny_target("llama")
    drafter = make_drafter(adapter, std=0.2)
    prompts, sequences, proposer = stored_proposer(adapter, drafter)
    rows, starts, sizes = [0, 1, 2], [len(prompts[0]) + 1, len(prompts[1]) + 2, len(prompts[2])], [2, 4, 3]
    batched = proposer.hidden(rows, starts, sizes)
    drafts = proposer(rows, starts, sizes)
    assert batched.shape[1] == 4 and drafts.shape == (3, 3)
    for i, (r, s, size) in enumerate(zip(rows, starts, sizes)):
        direct = direct_hidden(adapter, drafter, sequences[r], s, size)
        torch.testing.assert_close(batched[i, :size], direct, atol=1e-5, rtol=1e-4)
        assert drafts[i, : size - 1].tolist() == (direct[1:] @ adapter.lm_head_weight().T).argmax(-1).tolist()
    # The padded tail changes nothing: the full-attention output at size 2 differs from the first 2 of size 4.
    assert not torch.allclose(batched[0, :2], proposer.hidden([0], [starts[0]], 4)[0, :2], atol=1e-4)


def test_a_prompt_set_without_a_source_is_named(tiny_target):
    with pytest.raises(ValueError, match=r"eval prompt set 'code' names no source \(one of .*humaneval"):
        load_prompt_sets(tiny_target("llama"), {"code": {"limit": 2}}, max_new_tokens=6, batch_size=EVAL_BATCH)


def test_summary_says_where_the_time_went(tiny_target, make_drafter, monkeypatch):
    adapter = tiny_target("llama")
    timer = PhaseTimer(adapter.device)
    sets, categories, _ = load_prompt_sets(adapter, {"mtbench": {"source": "mtbench", "limit": 2, "turns": 2}},
                                        max_new_tokens=6, timer=timer, batch_size=EVAL_BATCH)
    # A slow drafter: its time must land in the "draft" phase, not elsewhere. The replay's clock is one that only
    # the drafter advances (10 ms a call), so the attribution is checked exactly, whatever else the machine runs.
    original, now = DrafterProposer.__call__, [0.0]

    def slow(self, rows, starts, sizes):
        now[0] += 0.01
        return original(self, rows, starts, sizes)

    monkeypatch.setattr(DrafterProposer, "__call__", slow)
    monkeypatch.setattr("dflash.eval.replay.time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    summary = evaluate(make_drafter(adapter), adapter, sets, max_new_tokens=6, show_progress=False,
                       categories=categories, timer=timer, **eval_options())
    timing = summary["timing"]
    steps = summary["overall"]["num_steps"]
    per_set = timing["prompt_sets"]
    assert sorted(per_set["mtbench"]) == ["accept", "draft", "generate", "load_prompts", "target_pass"]
    assert sorted(per_set["mtbench_turn2"]) == ["accept", "draft", "generate", "target_pass", "turn2_answers"]
    # Every figure is rounded to the millisecond: a sum of n of them is off by at most (n + 1) / 2 ms.
    for phase, seconds in timing["seconds"].items():
        terms = [p[phase] for p in per_set.values() if phase in p]
        assert seconds == pytest.approx(sum(terms), abs=5e-4 * (len(terms) + 1) + 1e-9)
    terms = list(timing["seconds"].values())
    assert timing["total_seconds"] == pytest.approx(sum(terms), abs=5e-4 * (len(terms) + 1) + 1e-9)
    # Two sets replayed one step per call, each call taking 10 ms (steps >= calls >= steps / prompts per set); the
    # rest of the step loop took no time on that clock.
    assert timing["seconds"]["draft"] >= 0.01 * steps / 2 and timing["seconds"]["accept"] == 0
    table = format_table(summary)
    assert "time (s): load_prompts" in table and "mtbench_turn2: turn2_answers" in table


def test_replay_rejects_empty_prompt(tiny_target, make_drafter):
    adapter = tiny_target("llama")
    with pytest.raises(ValueError, match="empty"):
        replay(make_drafter(adapter), adapter, [[1, 2], []], max_new_tokens=4, batch_size=EVAL_BATCH)
    assert replay(make_drafter(adapter), adapter, [], max_new_tokens=4, batch_size=EVAL_BATCH) == []


def test_greedy_continuations_ignore_model_generation_defaults(tiny_target):
    # A repetition penalty or an eos in the model's generation_config must not leak into greedy continuations.
    adapter = tiny_target("qwen3_5")
    prompt = prompts_for(adapter)[1]
    config = adapter.model.generation_config
    saved = (config.repetition_penalty, config.eos_token_id)
    config.repetition_penalty, config.eos_token_id = 3.0, own_greedy(adapter, prompt, 4)[2]
    try:
        (continuation,) = greedy_continuations(adapter, [prompt], max_new_tokens=12, stop_token_ids=[],
                                               batch_size=EVAL_BATCH)
    finally:
        config.repetition_penalty, config.eos_token_id = saved
    assert continuation == own_greedy(adapter, prompt, 12)
    assert adapter.model.generation_config.repetition_penalty == saved[0]
