"""Live decoding against replay: the same traces when a stop token lies in a rejected block, and a live warm-up
that is neither timed nor counted and changes no result."""

from __future__ import annotations

import torch

from dflash.eval import evaluate as evaluate_module
from dflash.eval import live
from dflash.eval.evaluate import evaluate
from dflash.eval.live import live_decode
from dflash.eval.replay import DrafterProposer, greedy_continuations, replay
from tests.schema_options import DRAFT_SAMPLING, EVAL_BATCH, eval_options

def test_replay_and_live_traces_agree_when_a_stop_token_lies_in_a_rejected_block(tiny_target, make_drafter,
                                                                                  monkeypatch):
    adapter = tiny_target("qwen3")
    block_size, budget = 8, 30
    drafter = make_drafter(adapter, block_size=block_size)
    prompt = adapter.chat_ids([{"role": "user", "content": "What is two plus two?"}])
    free = greedy_continuations(adapter, [prompt], max_new_tokens=budget, stop_token_ids=[], batch_size=EVAL_BATCH)[0]
    # The stop token: a token the target first says late in its answer.
    offset = next(i for i, t in enumerate(free) if i >= 10 and t not in free[:i])
    stop, sequence = free[offset], list(prompt) + free
    # Drafts follow the target, but are wrong just before the stop token (the block holding both is rejected before
    # reaching it) and once earlier (so that block starts a few positions before the stop token).
    wrong = {len(prompt) + offset - 1, len(prompt) + offset - 10}

    def draft_token(position):
        token = sequence[position] if position < len(sequence) else 0
        return (token + 1) % adapter.vocab_size if position in wrong else token

    def live_drafts(context, anchor, size):
        logits = torch.zeros(size - 1, adapter.vocab_size)
        for k in range(1, size):
            logits[k - 1, draft_token(context.length + k)] = 1.0
        return logits, logits.argmax(dim=-1)

    def replay_drafts(self, rows, starts, sizes):
        return torch.tensor([[draft_token(s + k) for k in range(1, max(sizes))] for s in starts])

    monkeypatch.setattr(live, "draft_block", live_drafts)
    monkeypatch.setattr(DrafterProposer, "__call__", replay_drafts)
    for stop_ids in ([stop], []):  # the answer ends on the stop token; at max_new_tokens
        replayed = replay(drafter, adapter, [prompt], max_new_tokens=budget, stop_token_ids=stop_ids,
                          batch_size=EVAL_BATCH)[0]
        decoded = live_decode(drafter, adapter, prompt, max_new_tokens=budget, stop_token_ids=stop_ids,
                              target_engine="hf", draft_sampling=DRAFT_SAMPLING)
        assert decoded.continuation == replayed.continuation
        # committed, accepted and drafted of every step
        assert decoded.trace == replayed.trace
    trace = live_decode(drafter, adapter, prompt, max_new_tokens=budget, stop_token_ids=[stop],
                        target_engine="hf", draft_sampling=DRAFT_SAMPLING).trace
    # The case being tested: a step before the last drafted past the stop token (and was rejected before it).
    end = len(prompt) + offset  # the stop token's position
    anchors = [len(prompt) + sum(trace.committed[:s]) for s in range(trace.num_steps)]
    assert any(anchor + block_size - 1 > end for anchor in anchors[:-1]), (anchors, end)
    assert trace.drafted[:-1] == [block_size - 1] * (trace.num_steps - 1) and trace.drafted[-1] < block_size - 1


def test_live_warm_up_is_neither_timed_nor_counted_and_changes_no_result(tiny_target, make_drafter, monkeypatch):
    adapter = tiny_target("qwen3")
    drafter = make_drafter(adapter, block_size=4, std=0.2)
    prompts = [adapter.chat_ids([{"role": "user", "content": t}]) for t in ("Hi", "What is two plus two?", "Sea")]
    sets = {"a": prompts[:2], "b": prompts[2:]}
    calls = []

    def recorded(name, decode):
        def call(*args, **kwargs):  # the prompt is the last positional argument of both decoders
            calls.append((name, prompts.index(args[-1]), kwargs["max_new_tokens"]))
            return decode(*args, **kwargs)
        return call

    monkeypatch.setattr(evaluate_module, "live_decode", recorded("spec", evaluate_module.live_decode))
    monkeypatch.setattr(evaluate_module, "target_only_decode", recorded("target", evaluate_module.target_only_decode))
    # T > 0: a warm-up drawing from the timed decodes' generator would change their samples.
    options = eval_options(max_new_tokens=12, show_progress=False, mode="live", temperature=0.9, seed=3)
    warm = evaluate(drafter, adapter, sets, **options)
    # Prompt 0 before the timed decodes: speculative decodes until every block size (4, 3, 2) was met, the
    # largest first, then two blocks' worth target-only.
    warm_ups = calls[: calls.index(("target", 0, 8)) + 1]
    assert warm_ups[0] == ("spec", 0, 4) and all(call[:2] == ("spec", 0) for call in warm_ups[:-1])
    assert len(calls) == len(warm_ups) + 2 * len(prompts)
    calls.clear()
    cold = evaluate(drafter, adapter, sets, warm_up=False, **options)
    assert len(calls) == 2 * len(prompts)
    timings = {"speculative_seconds", "speculative_tokens_per_s", "target_seconds", "target_tokens_per_s", "speedup",
               "speculative_ms_per_step", "target_ms_per_step", "step_cost", "speculative_prefill_seconds",
               "target_prefill_seconds"}
    for name in ("a", "b"):
        got, want = warm["prompt_sets"][name], cold["prompt_sets"][name]
        assert {k: v for k, v in got.items() if k not in timings} == {k: v for k, v in want.items() if k not in timings}
    assert warm["overall"]["speculative_new_tokens"] == cold["overall"]["speculative_new_tokens"]
    assert warm["overall"]["num_prompts"] == len(prompts)
    assert warm["overall"]["committed_histogram"] == cold["overall"]["committed_histogram"]
    # Charged to its own phase, outside every prompt set and outside the speedup's clocks.
    assert "live_warmup" in warm["timing"]["seconds"] and "live_warmup" not in cold["timing"]["seconds"]
    assert all("live_warmup" not in phases for phases in warm["timing"]["prompt_sets"].values())
