"""Evaluator and export corrections: replay counts drafted positions as a live decoder does, exports are readable
by others and survive a failed swap, live eval warms up without changing results, z-lab configs with reference
options this drafter lacks are refused, summaries are written with the shared atomic writer, plot titles say how
the summary was measured."""

from __future__ import annotations

import json
import os

import pytest
import torch

from dflash.eval import export, live
from dflash.eval import evaluate as evaluate_module
from dflash.eval.evaluate import evaluate, write_summary
from dflash.eval.export import export_zlab, load_drafter, process_umask
from dflash.eval.live import live_decode
from dflash.eval.metrics import StepTrace, acceptance_metrics
from dflash.eval.plots import per_position_title
from dflash.eval.replay import DrafterProposer, greedy_continuations, replay
from dflash.models.drafter_config import DrafterConfig
from tests.test_export import small_drafter


def test_replay_and_live_traces_agree_when_a_stop_token_lies_in_a_rejected_block(tiny_target, make_drafter,
                                                                                  monkeypatch):
    adapter = tiny_target("qwen3")
    block_size, budget = 8, 30
    drafter = make_drafter(adapter, block_size=block_size)
    prompt = adapter.chat_ids([{"role": "user", "content": "What is two plus two?"}])
    free = greedy_continuations(adapter, [prompt], max_new_tokens=budget, stop_token_ids=[])[0]
    # The stop token: a token the target first says late in its answer.
    offset = next(i for i, t in enumerate(free) if i >= 10 and t not in free[:i])
    stop, sequence = free[offset], list(prompt) + free
    # Drafts follow the target, but are wrong just before the stop token (the block holding both is rejected before
    # reaching it) and once earlier (so that block starts a few positions before the stop token).
    wrong = {len(prompt) + offset - 1, len(prompt) + offset - 10}

    def draft_token(position):
        token = sequence[position] if position < len(sequence) else 0
        return (token + 1) % adapter.vocab_size if position in wrong else token

    def live_drafts(context, adapter_, anchor, size):
        logits = torch.zeros(size - 1, adapter.vocab_size)
        for k in range(1, size):
            logits[k - 1, draft_token(context.length + k)] = 1.0
        return logits

    def replay_drafts(self, rows, starts, sizes):
        return torch.tensor([[draft_token(s + k) for k in range(1, max(sizes))] for s in starts])

    monkeypatch.setattr(live, "draft_block_logits", live_drafts)
    monkeypatch.setattr(DrafterProposer, "__call__", replay_drafts)
    for stop_ids in ([stop], []):  # the answer ends on the stop token; at max_new_tokens
        replayed = replay(drafter, adapter, [prompt], max_new_tokens=budget, stop_token_ids=stop_ids)[0]
        decoded = live_decode(drafter, adapter, prompt, max_new_tokens=budget, stop_token_ids=stop_ids,
                              target_engine="hf")
        assert decoded.continuation == replayed.continuation
        # committed, accepted and drafted of every step
        assert decoded.trace == replayed.trace
    trace = live_decode(drafter, adapter, prompt, max_new_tokens=budget, stop_token_ids=[stop],
                        target_engine="hf").trace
    # The case being tested: a step before the last drafted past the stop token (and was rejected before it).
    end = len(prompt) + offset  # the stop token's position
    anchors = [len(prompt) + sum(trace.committed[:s]) for s in range(trace.num_steps)]
    assert any(anchor + block_size - 1 > end for anchor in anchors[:-1]), (anchors, end)
    assert trace.drafted[:-1] == [block_size - 1] * (trace.num_steps - 1) and trace.drafted[-1] < block_size - 1


@pytest.fixture
def umask():
    """set(mask): the process umask for the test, restored after it."""
    saved = os.umask(0o022)
    os.umask(saved)
    yield os.umask
    os.umask(saved)


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_export_modes_follow_the_umask(tmp_path, umask, mask):
    umask(mask)
    assert process_umask() == mask
    out = export_zlab(small_drafter(), str(tmp_path / "export"))
    assert os.stat(out).st_mode & 0o777 == 0o777 & ~mask
    for name in os.listdir(out):
        assert os.stat(os.path.join(out, name)).st_mode & 0o777 == 0o666 & ~mask, name


def test_process_umask_without_proc(umask, monkeypatch):
    def no_proc(*args, **kwargs):
        raise OSError("no /proc")

    umask(0o026)
    monkeypatch.setattr(export, "open", no_proc, raising=False)
    assert process_umask() == 0o026
    assert os.umask(0o026) == 0o026  # and the mask is left as it was


def test_failed_swap_keeps_the_previous_export(tmp_path, monkeypatch):
    out = str(tmp_path / "export")
    first = small_drafter()
    export_zlab(first, out, dtype=torch.float32)
    replace, calls = os.replace, []

    def second_fails(source, destination):
        calls.append(destination)
        if destination == out and calls.count(out) == 1:  # the new export moving in, after the old one moved out
            raise OSError("disk gone")
        replace(source, destination)

    monkeypatch.setattr(os, "replace", second_fails)
    with pytest.raises(OSError, match="disk gone"):
        export_zlab(small_drafter(("full_attention",)), out, dtype=torch.float32)
    monkeypatch.undo()
    assert calls[-3].endswith(".old") and calls[-2:] == [out, out]  # failed moving in; the old one moved back
    assert sorted(os.listdir(tmp_path)) == ["export"]
    assert load_drafter(out).config == first.config


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
    options = dict(max_new_tokens=12, show_progress=False, mode="live", temperature=0.9, seed=3)
    warm = evaluate(drafter, adapter, sets, **options)
    assert calls[:2] == [("spec", 0, 8), ("target", 0, 8)]  # prompt 0, two blocks, before the timed decodes
    assert len(calls) == 2 + 2 * len(prompts)
    calls.clear()
    cold = evaluate(drafter, adapter, sets, warm_up=False, **options)
    assert len(calls) == 2 * len(prompts)
    timings = {"speculative_seconds", "speculative_tokens_per_s", "target_seconds", "target_tokens_per_s", "speedup"}
    for name in ("a", "b"):
        got, want = warm["prompt_sets"][name], cold["prompt_sets"][name]
        assert {k: v for k, v in got.items() if k not in timings} == {k: v for k, v in want.items() if k not in timings}
    assert warm["overall"]["speculative_new_tokens"] == cold["overall"]["speculative_new_tokens"]
    assert warm["overall"]["num_prompts"] == len(prompts)
    assert warm["overall"]["committed_histogram"] == cold["overall"]["committed_histogram"]
    # Charged to its own phase, outside every prompt set and outside the speedup's clocks.
    assert "live_warmup" in warm["timing"]["seconds"] and "live_warmup" not in cold["timing"]["seconds"]
    assert all("live_warmup" not in phases for phases in warm["timing"]["prompt_sets"].values())


def zlab_config() -> dict:
    return small_drafter().config.to_zlab()


@pytest.mark.parametrize("where", ["dflash_config", "top"])
@pytest.mark.parametrize("name, value", [("input_embedding_scale", 2.0), ("output_multiplier", 0.5),
                                         ("final_logit_softcapping", 30.0)])
def test_zlab_config_with_a_reference_option_on_is_refused(where, name, value, tmp_path):
    config = zlab_config()
    (config["dflash_config"] if where == "dflash_config" else config)[name] = value
    with pytest.raises(ValueError, match=f"{name}={value}"):
        DrafterConfig.from_zlab(config)
    # Through load_drafter too: a published folder with such a config is not loaded.
    out = export_zlab(small_drafter(), str(tmp_path / "export"))
    os.remove(os.path.join(out, "checksums.json"))  # a published folder has none
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=name):
        load_drafter(out)


def test_zlab_is_causal_is_refused_only_where_it_changes_a_layer():
    config = zlab_config()
    kinds = config["layer_types"]
    assert kinds == ["sliding_attention", "full_attention"]
    with pytest.raises(ValueError, match="is_causal=True"):
        DrafterConfig.from_zlab({**config, "is_causal": True})  # the full layer would become causal
    with pytest.raises(ValueError, match="is_causal=False"):  # the sliding layer would become bidirectional
        DrafterConfig.from_zlab({**config, "dflash_config": {**config["dflash_config"], "is_causal": False}})
    all_full = {**config, "layer_types": ["full_attention"] * len(kinds), "is_causal": False}
    assert DrafterConfig.from_zlab(all_full).layer_types == ["full_attention"] * len(kinds)
    assert DrafterConfig.from_zlab({**config, "is_causal": None}) == small_drafter().config


def test_zlab_config_with_reference_options_off_loads():
    config = zlab_config()
    config["dflash_config"].update(input_embedding_scale=1.0, output_multiplier=1, final_logit_softcapping=None)
    config.update(final_logit_softcapping=0.0, output_multiplier=1.0)
    assert DrafterConfig.from_zlab(config) == small_drafter().config


def test_summary_files_are_synced_to_disk(tmp_path, monkeypatch):
    metrics = acceptance_metrics([StepTrace([2, 1], [1, 0], [1, 1])], 2)
    summary = {"schema_version": 2, "mode": "replay", "temperature": 0.0, "block_size": 2, "max_new_tokens": 4,
               "prompt_sets": {"a": metrics}, "overall": metrics}
    synced, fsync = [], os.fsync

    def record(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", record)
    write_summary(summary, str(tmp_path))
    names = {os.path.basename(path).split(".tmp")[0].lstrip(".") for path in synced}
    assert {"summary.json", "summary.csv"} <= names
    assert sorted(p for p in os.listdir(tmp_path) if not p.endswith(".png")) == ["summary.csv", "summary.json"]


def test_per_position_title_says_how_the_summary_was_measured():
    assert per_position_title({"mode": "replay", "temperature": 0.0, "block_size": 16}) == \
        "Acceptance per position, replay greedy (block size 16)"
    title = per_position_title({"mode": "live", "temperature": 0.7, "block_size": 8})
    assert "live T=0.7" in title and "reedy" not in title
