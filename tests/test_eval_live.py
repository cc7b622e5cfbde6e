"""Live speculative decoding: lossless at T=0 on dense and GDN hybrid targets, same tau as the replay, cached
drafter context equal to the drafter's full forward, the naive cache crop shown NOT lossless on GDN, and greedy
(argmax) drafts at T>0 (eval.draft_sampling) through both engines, evaluate and the config."""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch
import torch.nn.functional as F

from dflash.eval import live
from dflash.inference.drafter_cache import CachedDrafter, TargetHead, context_keys_values
from dflash.eval.live import live_decode, target_only_decode
from dflash.eval.metrics import PhaseTimer
from dflash.eval.replay import DrafterProposer, replay
from dflash.train.heldout import _FrozenHead
from tests.schema_options import DRAFT_SAMPLING, LIVE_ENGINE, eval_options

FAMILIES = ["llama", "qwen3_5"]
TEXTS = ["Hi", "What is two plus two?", "Write a haiku about the sea, please."]


def prompts_for(adapter):
    return [adapter.chat_ids([{"role": "user", "content": t}]) for t in TEXTS]


def own_greedy(adapter, prompt, num_tokens):
    """The target's greedy tokens after `prompt`: a full forward per token, no cache, independent of live.py."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(num_tokens):
            tokens.append(int(adapter.model(torch.tensor([tokens], device=adapter.device)).logits[0, -1].argmax()))
    return tokens[len(prompt):]


def corrupt(token, position, vocab_size):
    """Deterministically wrong drafts at some positions, so acceptance lengths vary from step to step."""
    return (token + 1) % vocab_size if position % 5 == 0 or position % 7 == 3 else token


def oracle(monkeypatch, adapter, prompt, truth):
    """Replace the drafter's logits by one-hot logits of the target's own greedy tokens, corrupted by position."""
    sequence = list(prompt) + truth

    def fake(context, anchor, size):
        start = context.length
        logits = torch.zeros(size - 1, adapter.vocab_size, device=adapter.device)
        for k in range(1, size):
            token = sequence[start + k] if start + k < len(sequence) else 0
            logits[k - 1, corrupt(token, start + k, adapter.vocab_size)] = 1.0
        return logits, logits.argmax(dim=-1)

    monkeypatch.setattr(live, "draft_block", fake)


@pytest.mark.parametrize("family", FAMILIES)
def test_live_output_equals_target_greedy(family, tiny_target, make_drafter, monkeypatch):
    adapter = tiny_target(family)
    drafter = make_drafter(adapter, block_size=5)
    prompt = prompts_for(adapter)[1]
    truth = own_greedy(adapter, prompt, 24)
    # A real (random) drafter: mostly rejections, every step rolls the cache back.
    result = live_decode(drafter, adapter, prompt, max_new_tokens=24, stop_token_ids=[], target_engine=LIVE_ENGINE,
                         draft_sampling=DRAFT_SAMPLING)
    assert result.continuation == truth
    assert sum(result.trace.committed) == 23
    # Profiling the phases of each step changes nothing but the clock.
    timer = PhaseTimer()
    profiled = live_decode(drafter, adapter, prompt, max_new_tokens=24, stop_token_ids=[], timer=timer,
                           target_engine=LIVE_ENGINE, draft_sampling=DRAFT_SAMPLING)
    assert profiled.continuation == truth and profiled.trace == result.trace
    assert sorted(timer.totals) == ["live_accept", "live_draft", "live_prefill", "live_rollback", "live_verify"]
    # An oracle drafter with errors: partial and full acceptance, rollbacks of every length.
    oracle(monkeypatch, adapter, prompt, truth)
    result = live_decode(drafter, adapter, prompt, max_new_tokens=24, stop_token_ids=[], target_engine=LIVE_ENGINE,
                         draft_sampling=DRAFT_SAMPLING)
    assert result.continuation == truth
    assert len(set(result.trace.committed)) >= 3, result.trace.committed
    assert target_only_decode(adapter, prompt, max_new_tokens=24, stop_token_ids=[],
                              target_engine=LIVE_ENGINE).continuation == truth


@pytest.mark.gpu(reason="flash-linear-attention's GDN kernels: chunked in a verify, recurrent token by token")
@pytest.mark.parametrize("block_size", [2, 5, 16])
def test_live_decoding_on_a_gdn_hybrid_on_cuda_is_lossless(block_size, varied_target, make_drafter, monkeypatch):
    """On CUDA a hybrid's verify of a block runs the GDN layers' chunked kernel and target-only decoding their
    recurrent one, and every partial acceptance restores the GDN states: in float32 the live output is the target's
    own greedy output, with an oracle drafter that accepts none, some and all of a block. The target's weights are
    large enough (varied_target) that its greedy text varies and its logits are no near-ties."""
    adapter = varied_target("qwen3_5", device="cuda")
    drafter = make_drafter(adapter, block_size=block_size, window=16).to("cuda")
    for prompt in prompts_for(adapter):
        truth = target_only_decode(adapter, prompt, max_new_tokens=40, stop_token_ids=[],
                                   target_engine=LIVE_ENGINE).continuation
        assert truth == own_greedy(adapter, prompt, 40)
        with monkeypatch.context() as patched:
            oracle(patched, adapter, prompt, truth)
            result = live_decode(drafter, adapter, prompt, max_new_tokens=40, stop_token_ids=[],
                                 target_engine=LIVE_ENGINE, draft_sampling=DRAFT_SAMPLING)
        assert result.continuation == truth
        assert len(set(result.trace.committed)) >= 2, result.trace.committed  # rollbacks of several lengths


def test_naive_crop_is_not_lossless_on_gdn(tiny_target, make_drafter, monkeypatch):
    """Without restoring the GDN conv/recurrent states the hybrid target continues from states that saw rejected
    drafts; this is what makes the rollback test above able to fail."""
    adapter = tiny_target("qwen3_5")
    drafter = make_drafter(adapter, block_size=5)
    prompt = prompts_for(adapter)[1]
    truth = own_greedy(adapter, prompt, 24)
    oracle(monkeypatch, adapter, prompt, truth)
    naive = live_decode(drafter, adapter, prompt, max_new_tokens=24, stop_token_ids=[], restore_linear=False,
                        target_engine=LIVE_ENGINE, draft_sampling=DRAFT_SAMPLING)
    assert naive.continuation != truth
    dense = tiny_target("llama")
    dense_prompt = prompts_for(dense)[1]
    dense_truth = own_greedy(dense, dense_prompt, 24)
    oracle(monkeypatch, dense, dense_prompt, dense_truth)
    # On a dense target cropping the KV cache is all there is to it.
    plain = live_decode(make_drafter(dense, block_size=5), dense, dense_prompt, max_new_tokens=24, stop_token_ids=[],
                        restore_linear=False, target_engine=LIVE_ENGINE, draft_sampling=DRAFT_SAMPLING)
    assert plain.continuation == dense_truth


@pytest.mark.parametrize("family", FAMILIES)
def test_live_tau_equals_replay_tau(family, tiny_target, make_drafter, monkeypatch):
    adapter = tiny_target(family)
    drafter = make_drafter(adapter, block_size=4, std=0.2)
    prompts = prompts_for(adapter)
    stop_ids = adapter.stop_token_ids()
    replayed = replay(drafter, adapter, prompts, max_new_tokens=16, stop_token_ids=stop_ids, batch_size=3)
    for prompt, expected in zip(prompts, replayed):
        result = live_decode(drafter, adapter, prompt, max_new_tokens=16, stop_token_ids=stop_ids,
                             target_engine=LIVE_ENGINE, draft_sampling=DRAFT_SAMPLING)
        assert result.continuation == expected.continuation
        assert result.trace == expected.trace
    # And with an oracle that accepts often, where blocks are cut by max_new_tokens.
    truth = own_greedy(adapter, prompts[2], 21)
    oracle(monkeypatch, adapter, prompts[2], truth)
    result = live_decode(drafter, adapter, prompts[2], max_new_tokens=21, stop_token_ids=[], target_engine=LIVE_ENGINE,
                         draft_sampling=DRAFT_SAMPLING)
    assert result.continuation == truth and max(result.trace.committed) == 4
    assert result.trace.committed == oracle_replay_steps(adapter, prompts[2], truth, block_size=4, max_new_tokens=21)


def oracle_replay_steps(adapter, prompt, truth, *, block_size, max_new_tokens):
    """The committed lengths of the reference loop for the corrupted-oracle drafts, computed on the known truth."""
    sequence, start, end, steps = list(prompt) + truth, len(prompt), len(prompt) + len(truth) - 1, []
    while start < end:
        size = min(block_size, len(prompt) + max_new_tokens - start)
        accepted = 0
        while accepted < size - 1 and start + accepted + 1 <= end and \
                corrupt(sequence[start + accepted + 1], start + accepted + 1, adapter.vocab_size) == \
                sequence[start + accepted + 1]:
            accepted += 1
        committed = min(accepted + 1, end - start)
        steps.append(committed)
        start += committed
    return steps


@pytest.mark.parametrize("layer_types", [("sliding_attention", "full_attention"), ("full_attention",)])
def test_cached_drafter_equals_full_forward(layer_types, tiny_target, make_drafter):
    adapter = tiny_target("qwen3_5")
    drafter = make_drafter(adapter, layer_types=layer_types, window=6, std=0.2)
    prompt = prompts_for(adapter)[2]
    features = adapter.capture(torch.tensor([prompt]), None, drafter.target_layer_ids)[0]
    cached = CachedDrafter(drafter, TargetHead.of(adapter))
    cached.extend(features[:20])
    for start in (20, 23, 31):
        if start > cached.length:
            cached.extend(features[cached.length:start])
        block = torch.tensor([prompt[start]] + [drafter.mask_token_id] * 3)
        noise = adapter.embed_tokens()(block)
        with torch.no_grad():
            direct = drafter(torch.arange(start + 4)[None], noise[None], features[None, :start])[0]
        torch.testing.assert_close(cached.hidden(noise), direct, atol=1e-5, rtol=1e-4)
        # The drafting step: the same block through the target's head, and the argmax of its logits.
        logits, drafts = cached.draft(prompt[start], 4)
        torch.testing.assert_close(logits, direct[1:] @ adapter.lm_head_weight().T, atol=1e-5, rtol=1e-4)
        assert torch.equal(drafts, logits.argmax(dim=-1))
    width = drafter.config.num_taps * adapter.hidden_size
    with pytest.raises(ValueError, match=rf"features must be \[n, {width}\]"):
        cached.extend(features[:2, :5])
    with pytest.raises(ValueError, match=rf"features must be \[batch, n, {width}\]"):
        context_keys_values(drafter, features, torch.arange(len(features))[None])


@pytest.mark.parametrize("family", ["gemma3_text", "gemma2"])
def test_replay_and_live_embed_the_block_as_training_does(family, tiny_target, make_drafter):
    """Gemma's embedding module multiplies by sqrt(hidden_size); training embeds the block with the raw weight
    (train/forward.py, and the held-out replay through _FrozenHead), so replay and live drafting must too."""
    adapter = tiny_target(family)
    drafter = make_drafter(adapter, std=0.2)
    weight, head = adapter.embed_tokens().weight, adapter.lm_head_weight()
    prompt = prompts_for(adapter)[2]
    features = adapter.capture(torch.tensor([prompt]), None, drafter.target_layer_ids)[0]
    replayed = DrafterProposer(drafter, adapter, [prompt], [features])
    heldout = DrafterProposer(drafter, _FrozenHead(weight, head), [prompt], [features])
    cached = CachedDrafter(drafter, TargetHead.of(adapter))
    cached.extend(features[:20])
    for start in (20, 27):
        cached.extend(features[cached.length:start])
        hidden = replayed.hidden([0], [start], 4)[0]
        assert torch.equal(hidden, heldout.hidden([0], [start], 4)[0])
        block = torch.tensor([prompt[start]] + [drafter.mask_token_id] * 3)
        with torch.no_grad():
            trained = drafter(torch.arange(start + 4)[None], F.embedding(block, weight)[None], features[None, :start])
        torch.testing.assert_close(hidden, trained[0], atol=1e-5, rtol=1e-4)
        logits, drafts = cached.draft(prompt[start], 4)
        torch.testing.assert_close(logits, adapter.logit_transform(hidden[1:] @ head.T), atol=1e-5, rtol=1e-4)
        assert drafts.tolist() == replayed([0], [start], 4)[0].tolist()


def test_live_rejects_bad_input(tiny_target, make_drafter):
    adapter = tiny_target("llama")
    drafter = make_drafter(adapter)
    with pytest.raises(ValueError, match="empty"):
        live_decode(drafter, adapter, [], max_new_tokens=4, stop_token_ids=[], target_engine=LIVE_ENGINE,
                    draft_sampling=DRAFT_SAMPLING)
    with pytest.raises(ValueError, match="max_new_tokens"):
        live_decode(drafter, adapter, [5, 6], max_new_tokens=0, stop_token_ids=[], target_engine=LIVE_ENGINE,
                    draft_sampling=DRAFT_SAMPLING)
    with pytest.raises(ValueError, match="temperature"):
        target_only_decode(adapter, [5, 6], max_new_tokens=4, stop_token_ids=[], temperature=-1.0,
                           target_engine=LIVE_ENGINE)
    with pytest.raises(ValueError, match="draft_sampling must be one of"):
        live_decode(drafter, adapter, [5, 6], max_new_tokens=4, stop_token_ids=[], temperature=1.0,
                    draft_sampling="top1", target_engine=LIVE_ENGINE)


def test_evaluate_live_mode_reports_speed_and_matches_replay(tiny_target, make_drafter, tmp_path):
    from dflash.eval.evaluate import evaluate, format_table, write_summary

    adapter = tiny_target("qwen3_5")
    drafter = make_drafter(adapter, block_size=4, std=0.2)
    sets = {"a": prompts_for(adapter)[:2], "b": prompts_for(adapter)[2:]}
    live_summary = evaluate(drafter, adapter, sets, max_new_tokens=12, show_progress=False,
                            categories={"a": ["math", "writing"]}, **eval_options(mode="live"))
    replay_summary = evaluate(drafter, adapter, sets, max_new_tokens=12, show_progress=False, **eval_options())
    assert live_summary["mode"] == "live" and replay_summary["mode"] == "replay"
    for name in ("a", "b"):
        live_set, replay_set = live_summary["prompt_sets"][name], replay_summary["prompt_sets"][name]
        for key in ("tau", "acceptance_rate", "per_position", "committed_histogram", "num_steps"):
            assert live_set[key] == replay_set[key], key
    overall = live_summary["overall"]
    assert overall["lossless_mismatches"] == 0
    assert overall["speculative_new_tokens"] == overall["target_new_tokens"] == 3 * 12
    assert overall["speculative_tokens_per_s"] > 0 and overall["target_tokens_per_s"] > 0
    assert overall["speedup"] == pytest.approx(overall["speculative_tokens_per_s"] / overall["target_tokens_per_s"])
    assert overall["speculative_seconds"] == pytest.approx(
        sum(live_summary["prompt_sets"][n]["speculative_seconds"] for n in ("a", "b")))
    # The speedup's factors: tokens per speculative step, and a step's cost in target-only steps, both after the
    # prefills (each decode's first token, read by the host).
    assert overall["speculative_steps"] == overall["num_steps"] and overall["target_steps"] == 3 * (12 - 1)
    assert 0 < overall["speculative_prefill_seconds"] < overall["speculative_seconds"]
    assert 0 < overall["target_prefill_seconds"] < overall["target_seconds"]
    # Each prompt's first token is its prefill's, not a step's (the factor would overstate by 12/11 here).
    assert overall["speculative_prefill_tokens"] == 3
    assert overall["tokens_per_step"] == pytest.approx((overall["speculative_new_tokens"] - 3) / overall["num_steps"])
    assert overall["tokens_per_step"] == pytest.approx(overall["tau"])  # what the steps committed: tau
    spec_step = (overall["speculative_seconds"] - overall["speculative_prefill_seconds"]) / overall["num_steps"]
    target_step = (overall["target_seconds"] - overall["target_prefill_seconds"]) / overall["target_steps"]
    assert overall["step_cost"] == pytest.approx(spec_step / target_step)
    assert "speedup" in format_table(live_summary) and "step cost" in format_table(live_summary)
    assert sorted(live_summary["timing"]["seconds"]) == ["live_speculative", "live_target_only", "live_warmup"]
    assert live_summary["timing"]["seconds"]["live_speculative"] == pytest.approx(
        overall["speculative_seconds"], abs=2e-3)
    by_category = live_summary["categories"]["a"]
    assert sorted(by_category) == ["math", "writing"] and by_category["math"]["num_prompts"] == 1
    assert by_category["math"]["num_steps"] + by_category["writing"]["num_steps"] == live_summary["prompt_sets"]["a"][
        "num_steps"]
    write_summary(live_summary, str(tmp_path))
    lines = (tmp_path / "summary.csv").read_text().splitlines()
    assert "speedup" in lines[0] and [line.split(",")[0] for line in lines[1:]] == ["a", "b", "overall", "a/math",
                                                                                  "a/writing"]
    with pytest.raises(ValueError, match="must label each"):
        evaluate(drafter, adapter, sets, max_new_tokens=4, show_progress=False, categories={"a": ["math"]},
                 **eval_options())
    with pytest.raises(ValueError, match="temperature must be a number >= 0"):
        evaluate(drafter, adapter, sets, max_new_tokens=4, show_progress=False, temperature=-0.7, **eval_options())
    with pytest.raises(ValueError, match="unknown eval mode"):
        evaluate(drafter, adapter, sets, max_new_tokens=4, show_progress=False, **eval_options(mode="fast"))


def test_mtbench_categories_of_the_packaged_questions():
    from dflash.data.prompts import load_prompts
    from dflash.eval.categories import mtbench_categories, prompt_categories

    labels = mtbench_categories()
    assert len(labels) == 80 and set(labels.values()) == {"writing", "roleplay", "reasoning", "math", "coding",
                                                          "extraction", "stem", "humanities"}
    prompts = load_prompts("mtbench", limit=5)
    assert prompt_categories("mtbench", prompts) == [labels[p.id] for p in prompts]
    assert prompt_categories("gsm8k", prompts) is None
    with pytest.raises(FileNotFoundError, match="question file not found"):
        mtbench_categories("/nonexistent/question.jsonl")


def test_target_cache_rollback_bounds_and_state_restore(tiny_target):
    from dflash.inference.target_cache import CachedTarget, snapshot_linear_states

    adapter = tiny_target("qwen3_5")
    prompt = prompts_for(adapter)[0]
    target = CachedTarget(adapter, [1, 3])
    target.forward(prompt)
    before = [t.clone() for _, _, t in snapshot_linear_states(target.cache)]
    assert before, "the hybrid target should have linear-attention states to snapshot"
    target.verify([5, 6, 7, 8])
    with pytest.raises(ValueError, match="rollback keeps"):
        target.rollback(len(prompt))
    with pytest.raises(ValueError, match="rollback keeps"):
        target.rollback(len(prompt) + 5)
    features = target.rollback(len(prompt) + 2)
    assert target.length == len(prompt) + 2 and features.shape == (2, 2 * adapter.hidden_size)
    # The states now equal those of a fresh target fed prompt + [5, 6]: the rejected 7, 8 left no trace.
    fresh = CachedTarget(adapter, [1, 3])
    fresh.forward(prompt + [5, 6])
    for (_, _, got), (_, _, want) in zip(snapshot_linear_states(target.cache), snapshot_linear_states(fresh.cache)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert any(not torch.equal(a, b) for a, (_, _, b) in zip(before, snapshot_linear_states(target.cache)))
    # The token count a linear layer keeps (Transformers 5.2x; get_seq_length reads it) counts the kept tokens once.
    counts = [int(layer.cumulative_length_linear) for layer in target.cache.layers
              if hasattr(layer, "cumulative_length_linear")]
    assert counts == [len(prompt) + 2] * len(counts)
    # The verify block may be a device tensor (live decoding keeps drafts there); rollback re-runs its kept part.
    logits, _ = target.verify(torch.tensor([7, 8, 9]))
    assert logits.shape[0] == 3 and target.rollback(len(prompt) + 3).shape == (1, 2 * adapter.hidden_size)
    target.verify([5])
    target.forward([6])
    with pytest.raises(ValueError, match="must follow a verify directly"):
        target.rollback(len(prompt) + 4)


def direct_cached_model(adapter, layer_ids):
    """The HF model called directly over a DynamicCache of its own, as a live target: step(ids, last) appends ids
    and returns (logits, features from output_hidden_states[L + 1]); rollback(start, keep, ids) keeps `keep`
    positions of the verify of `ids` from `start` (GDN states restored and the kept tokens re-run)."""
    from dflash.inference.target_cache import (crop_attention, has_linear_layers, new_cache, restore_linear_states,
                                               snapshot_linear_states)

    cache = new_cache(adapter.model)
    argument = "cache" if "cache" in inspect.signature(adapter.model.forward).parameters else "past_key_values"
    state = {"length": 0, "snapshot": []}

    @torch.inference_mode()
    def step(ids, last=False):
        n, length = len(ids), state["length"]
        out = adapter.model(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, length + n, dtype=torch.long),
                            position_ids=torch.arange(length, length + n)[None], use_cache=True,
                            output_hidden_states=True, logits_to_keep=1 if last else 0, **{argument: cache})
        state["length"] += n
        return out.logits[0], torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1)

    @torch.inference_mode()
    def verify(ids):
        state["snapshot"] = snapshot_linear_states(cache)
        return step(ids)

    @torch.inference_mode()
    def rollback(start, keep, ids):
        if not has_linear_layers(cache):
            crop_attention(cache, keep)
            state["length"] = keep
            return None
        restore_linear_states(state["snapshot"])
        crop_attention(cache, start)
        state["length"] = start
        return step(ids[: keep - start])[1]

    return step, verify, rollback


@pytest.mark.parametrize("family", FAMILIES)
def test_live_target_is_the_adapter_forward(family, tiny_target, make_drafter, monkeypatch):
    """The live decoder's HF-engine target runs every forward as TargetAdapter.forward with its cache (the model is
    called by nothing else), without the right-padding check (a device read) or the adapter's kernels() (a
    hybrid's capture conv choice); each forward gives bitwise what the HF model called directly over its own
    DynamicCache gives: logits, and the taps' hidden states (id L = hidden_states[L + 1]), through a rollback."""
    from dflash.inference.target_cache import CachedTarget

    adapter = tiny_target(family)
    forward, caches, model_calls, checked, kernels = adapter.forward, [], [], [], []

    def counted(*args, **kwargs):
        caches.append(kwargs.get("cache"))
        return forward(*args, **kwargs)

    monkeypatch.setattr(adapter, "forward", counted)
    monkeypatch.setattr(adapter, "check_right_padding", checked.append)
    monkeypatch.setattr(adapter, "kernels", lambda: kernels.append(1) or contextlib.nullcontext())
    hook = adapter.model.register_forward_pre_hook(lambda *_: model_calls.append(1))
    try:
        prompt = prompts_for(adapter)[1]
        result = live_decode(make_drafter(adapter, block_size=5), adapter, prompt, max_new_tokens=12,
                             stop_token_ids=[], target_engine="hf", draft_sampling=DRAFT_SAMPLING)
    finally:
        hook.remove()
    assert result.continuation == own_greedy(adapter, prompt, 12)
    assert len(caches) == len(model_calls) > len(result.trace.committed)
    assert caches[0] is not None and all(cache is caches[0] for cache in caches)
    assert checked == [] and kernels == []

    target = CachedTarget(adapter, [1, 3])
    step, verify, rollback = direct_cached_model(adapter, [1, 3])
    start = len(prompt)
    pairs = [(target.forward(prompt, last_logits_only=True), step(prompt, last=True)),
             (target.verify([5, 6, 7, 8]), verify([5, 6, 7, 8]))]
    kept = (target.rollback(start + 2), rollback(start, start + 2, [5, 6, 7, 8]))
    pairs.append((target.forward([9]), step([9])))
    assert pairs[0][0][0].shape == (1, adapter.vocab_size)
    for (logits, features), (want_logits, want_features) in pairs:
        assert torch.equal(logits, want_logits) and torch.equal(features, want_features)
    if family == "llama":  # a dense rollback slices the cache and recomputes nothing
        assert kept == (None, None)
    else:  # a hybrid's re-runs the kept tokens: their features
        assert kept[0].shape == (2, 2 * adapter.hidden_size) and torch.equal(*kept)


def test_live_greedy_drafts_at_temperature(tiny_target, make_drafter, monkeypatch):
    """draft_sampling="greedy" at T>0: the drafter proposes its argmax, verified by greedy_drafts_outcome; the hf and
    the static engine (dense targets) draw the same tokens from the same seed, the GDN hybrid decodes too, and at
    T=0 the setting changes nothing."""
    dense = tiny_target("llama")
    drafter = make_drafter(dense, block_size=4, std=0.2)
    prompt = prompts_for(dense)[2]
    runs = {}
    for engine in ("hf", "static"):
        result = live_decode(drafter, dense, prompt, max_new_tokens=20, stop_token_ids=[], temperature=0.9,
                             generator=torch.Generator().manual_seed(3), target_engine=engine,
                             draft_sampling="greedy")
        assert result.engine == engine and len(result.continuation) == 20
        runs[engine] = (result.continuation, result.trace)
    assert runs["static"] == runs["hf"]
    sampled = live_decode(drafter, dense, prompt, max_new_tokens=20, stop_token_ids=[], temperature=0.9,
                          generator=torch.Generator().manual_seed(3), target_engine=LIVE_ENGINE,
                          draft_sampling="sampled")
    assert (sampled.continuation, sampled.trace) != runs["hf"], "the setting changed nothing"
    hybrid = tiny_target("qwen3_5")
    result = live_decode(make_drafter(hybrid, block_size=4, std=0.2), hybrid, prompts_for(hybrid)[1],
                         max_new_tokens=12, stop_token_ids=[], temperature=0.9,
                         generator=torch.Generator().manual_seed(0), draft_sampling="greedy", target_engine=LIVE_ENGINE)
    assert len(result.continuation) == 12 and result.trace.num_steps >= 1
    # The proposals are the drafter's argmax at every step, and the deterministic-proposal rule verifies them.
    drafted, verified = [], []
    real_draft, real_accept = live.draft_block, live.greedy_drafts_outcome

    def recording_draft(*args):
        drafted.append(real_draft(*args))
        return drafted[-1]

    def recording_accept(target_probs, drafts, generator):
        verified.append(drafts.clone())
        return real_accept(target_probs, drafts, generator)

    monkeypatch.setattr(live, "draft_block", recording_draft)
    monkeypatch.setattr(live, "greedy_drafts_outcome", recording_accept)
    live_decode(drafter, dense, prompt, max_new_tokens=12, stop_token_ids=[], temperature=0.9,
                generator=torch.Generator().manual_seed(1), draft_sampling="greedy", target_engine=LIVE_ENGINE)
    assert len(drafted) == len(verified) >= 2
    for (logits, argmax), drafts in zip(drafted, verified):
        assert torch.equal(logits.argmax(dim=-1), drafts) and torch.equal(argmax, drafts)
    # T=0: greedy verification whatever draft_sampling says.
    verified.clear()
    truth = own_greedy(dense, prompt, 12)
    for draft_sampling in ("greedy", "sampled"):
        assert live_decode(drafter, dense, prompt, max_new_tokens=12, stop_token_ids=[],
                           draft_sampling=draft_sampling, target_engine=LIVE_ENGINE).continuation == truth
    assert verified == []


def test_evaluate_records_draft_sampling(tiny_target, make_drafter):
    from dflash.config import ConfigError, compose, fingerprints, settings_from
    from dflash.eval.evaluate import evaluate, format_table

    adapter = tiny_target("llama")
    drafter = make_drafter(adapter, block_size=4, std=0.2)
    sets = {"a": prompts_for(adapter)[:2]}
    summary = evaluate(drafter, adapter, sets, max_new_tokens=8, show_progress=False, temperature=0.7,
                       **eval_options(mode="live", draft_sampling="greedy", measure_target=False))
    assert summary["draft_sampling"] == "greedy" and summary["temperature"] == 0.7
    assert summary["overall"]["num_tokens"] == 2 * 7
    assert "T=0.7, greedy drafts" in format_table(summary)
    replayed = evaluate(drafter, adapter, sets, max_new_tokens=8, show_progress=False,
                        **eval_options(draft_sampling="sampled"))
    assert replayed["draft_sampling"] == "sampled" and "drafts" not in format_table(replayed).splitlines()[0]
    with pytest.raises(ValueError, match="draft_sampling must be one of"):
        evaluate(drafter, adapter, sets, max_new_tokens=4, show_progress=False,
                 **eval_options(mode="live", draft_sampling="top1"))
    # The setting: checked when composed; left out of the eval fingerprint at "sampled" (today's behaviour), so
    # evaluations made before it keep theirs; "greedy" is another evaluation.
    with pytest.raises(ConfigError, match="eval.draft_sampling"):
        settings_from(compose(["+experiment=tiny", "eval.draft_sampling=top1", "run_dir=/nonexistent/run"]))
    keys = {}
    for value in ("sampled", "greedy"):
        settings = settings_from(compose(["+experiment=tiny", "eval.mode=live", "eval.temperature=1.0",
                                          f"eval.draft_sampling={value}", "run_dir=/nonexistent/run"]))
        assert settings.eval.draft_sampling == value
        keys[value] = fingerprints.eval_fingerprint(settings, "DRAFTER", "FOLDER")
        assert ("draft_sampling" in fingerprints.stage_settings(settings.eval, "eval")) == (value == "greedy")
    assert keys["sampled"] != keys["greedy"]


def test_the_decode_that_meets_a_prompt_first_alternates(tiny_target, make_drafter, monkeypatch):
    """The first decode of a prompt meets its length cold (allocator, per-shape caches) and the second warm: the
    speculative decode first every time gave the target-only baseline the warm prefills."""
    import dflash.eval.evaluate as evaluate_module
    from dflash.eval.evaluate import evaluate

    adapter = tiny_target("llama")
    drafter = make_drafter(adapter, block_size=4, std=0.2)
    order = []
    for name in ("live_decode", "target_only_decode"):
        original = getattr(evaluate_module, name)

        def recorded(*args, _original=original, _name=name, **kwargs):
            order.append((_name, tuple(args[2] if _name == "live_decode" else args[1])))
            return _original(*args, **kwargs)

        monkeypatch.setattr(evaluate_module, name, recorded)
    prompts = prompts_for(adapter)[:4]
    evaluate(drafter, adapter, {"a": prompts}, max_new_tokens=6, show_progress=False, **eval_options(mode="live"))
    timed = order[-2 * len(prompts):]  # after the untimed warm-up
    firsts = [timed[2 * i][0] for i in range(len(prompts))]
    assert len(prompts) >= 2
    assert firsts == ["target_only_decode" if i % 2 else "live_decode" for i in range(len(prompts))]
    assert all(timed[2 * i][1] == timed[2 * i + 1][1] == tuple(p) for i, p in enumerate(prompts))
