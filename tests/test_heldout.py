"""Held-out acceptance during training: the data split, the stored target pass, replay tau == the evaluator's replay
tau, and the loop's heldout/* logging and best checkpoint (only on improvement, kept across a resume)."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import random

import pytest
import torch
from safetensors.torch import load_file

from dflash.config.schema import DeepSpeedSettings
from dflash.data.dataset import (build_dataset, fingerprint, format_stats, heldout_ids, load_dataset_dir,
                                 load_heldout_dir)
from dflash.data.prompts import Prompt
from dflash.eval.metrics import acceptance_metrics
from dflash.eval.replay import DrafterProposer, greedy_continuations, replay, target_pass
from dflash.eval.replay_estimate import target_pass_with_final
from dflash.models.drafter import DFlashDraftModel
from dflash.train import heldout_tracker, loop
from dflash.train.best_checkpoint import best_state_dict, read_best, write_best
from dflash.train.heldout import HeldoutSet, save_heldout_set, write_heldout_features
from dflash.train.metrics_log import MetricsLog
from tests import trainer_harness
from tests.forked import run_ranks
from tests.schema_options import HELDOUT_BATCH, answer_options

GEN = answer_options(max_length=160, max_new_tokens=6, batch_size=3, show_progress=False)


def make_prompts(n):
    return [Prompt(f"q{i}", [{"role": "user", "content": f"Question {i}: " + "word " * (i % 4)}], "test")
            for i in range(n)]


# The data split --------------------------------------------------------------------------------------------------


def test_heldout_split_is_seeded_deterministic_and_excluded(tiny_target, tmp_path):
    adapter = tiny_target("llama")
    prompts = make_prompts(7)
    stats = build_dataset(prompts, adapter, tmp_path / "a", heldout=2, **GEN)
    train_ids, held = load_dataset_dir(tmp_path / "a")["id"], load_heldout_dir(tmp_path / "a")
    assert set(held["id"]) == heldout_ids([p.id for p in prompts], 2, seed=0) and len(held) == 2
    assert not set(held["id"]) & set(train_ids) and set(held["id"]) | set(train_ids) == {p.id for p in prompts}
    assert held.column_names == ["id", "input_ids", "loss_mask", "prompt_set"]
    assert (stats["samples"], stats["heldout"], stats["settings"]["heldout"]) == (5, 2, 2)
    assert stats["heldout_num_tokens"] == sum(len(ids) for ids in held["input_ids"])
    # The choice depends on the ids and the seed, not on the prompt order; another seed chooses otherwise.
    shuffled = prompts[:]
    random.Random(1).shuffle(shuffled)
    build_dataset(shuffled, adapter, tmp_path / "b", heldout=2, **GEN)
    assert sorted(load_heldout_dir(tmp_path / "b")["id"]) == sorted(held["id"])
    assert [heldout_ids([p.id for p in prompts], 2, seed=s) for s in range(4)].count(set(held["id"])) < 4
    # What the capture stage does with it: one file that replays as the stored responses.
    path = str(tmp_path / "heldout.safetensors")
    assert write_heldout_features(adapter, held, [1, 3], path, batch_size=HELDOUT_BATCH)["samples"] == 2
    stored = HeldoutSet(path, batch_size=HELDOUT_BATCH)
    assert stored.tokens.tolist() == [t for ids in held["input_ids"] for t in ids]
    assert stored.prompt_lens == [mask.index(1) for mask in held["loss_mask"]]

    with pytest.raises(ValueError, match="heldout must be >= 0 and fewer than the 7 prompts, got 7"):
        build_dataset(prompts, adapter, tmp_path / "c", heldout=7, **GEN)
    with pytest.raises(ValueError, match="got -1"):
        build_dataset(prompts, adapter, tmp_path / "c", heldout=-1, **GEN)


def test_training_copies_of_a_heldout_prompt_are_dropped(tiny_target, tmp_path):
    adapter = tiny_target("llama")
    prompts = make_prompts(7)
    held = heldout_ids([p.id for p in prompts], 2, seed=0)
    copied = next(p for p in prompts if p.id in held)
    # The same prompt under other ids, as ShareGPT repeats a question: the copies stay out of training.
    copies = [Prompt(f"copy{k}", copied.messages, "test") for k in range(3)]
    assert not held & {p.id for p in copies}  # the split is by id: they would have been training prompts
    stats = build_dataset(prompts + copies, adapter, tmp_path / "a", heldout=2, **GEN)
    train_ids = set(load_dataset_dir(tmp_path / "a")["id"])
    assert stats["dropped_heldout_copies"] == 3 and not train_ids & {p.id for p in copies}
    assert (stats["samples"], stats["heldout"]) == (5, 2)
    assert "3 dropped (copies of a held-out prompt)" in format_stats(stats)


def test_no_heldout_leaves_the_dataset_as_before(tiny_target, tmp_path):
    adapter = tiny_target("llama")
    prompts = make_prompts(4)
    build_dataset(prompts, adapter, tmp_path, heldout=1, **GEN)
    stats = build_dataset(prompts, adapter, tmp_path, **GEN)
    settings = {k: GEN[k] for k in ("max_length", "max_new_tokens")} | {"temperature": 0.0, "top_p": 1.0, "seed": 0}
    assert stats["settings"] == settings and stats["fingerprint"] == fingerprint(prompts, adapter.tokenizer, settings)
    assert "heldout" not in stats and stats["samples"] == 4
    assert load_heldout_dir(tmp_path) is None and not (tmp_path / "heldout").exists()
    assert load_dataset_dir(tmp_path)["id"] == [p.id for p in prompts]


# The stored target pass and its replay ----------------------------------------------------------------------------


def heldout_rows(adapter, prompts, continuations):
    return [{"id": f"h{i}", "input_ids": p + c, "loss_mask": [0] * len(p) + [1] * len(c), "prompt_set": "t"}
            for i, (p, c) in enumerate(zip(prompts, continuations))]


def chat_prompts(adapter):
    texts = ["Hi", "What is two plus two?", "Write a haiku about the sea, please.", "Name three colours."]
    return [adapter.chat_ids([{"role": "user", "content": t}]) for t in texts]


ORIGINAL_PROPOSE = DrafterProposer.__call__


def recording(calls):
    """A DrafterProposer.__call__ that records every (rows' anchors, block size, drafts)."""
    original = ORIGINAL_PROPOSE

    def propose(self, rows, starts, size):
        drafts = original(self, rows, starts, size)
        calls.append(([self.sequences[r][s] for r, s in zip(rows, starts)], size, drafts.tolist()))
        return drafts

    return propose


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_heldout_replay_equals_the_evaluator_replay(family, tiny_target, make_drafter, tmp_path, monkeypatch):
    adapter = tiny_target(family)
    drafter = make_drafter(adapter, std=0.2, block_size=4)
    prompts, max_new_tokens = chat_prompts(adapter), 14
    stops = adapter.stop_token_ids()
    continuations = greedy_continuations(adapter, prompts, max_new_tokens=max_new_tokens, stop_token_ids=stops,
                                         batch_size=2)
    path = str(tmp_path / "heldout.safetensors")
    info = write_heldout_features(adapter, heldout_rows(adapter, prompts, continuations), drafter.target_layer_ids,
                                  path, batch_size=2)
    assert info == {"samples": 4, "tokens": sum(len(p) + len(c) for p, c in zip(prompts, continuations))}

    # Round trip: the stored sequences, prompt lengths and features are those of the evaluator's target pass.
    held = HeldoutSet(path, max_new_tokens=max_new_tokens, batch_size=2)
    assert len(held) == 4 and held.layer_ids == drafter.target_layer_ids
    assert held.prompt_lens == [len(p) for p in prompts]
    sequences = [p + c for p, c in zip(prompts, continuations)]
    assert held.tokens.tolist() == [t for s in sequences for t in s]
    features, greedy = target_pass(adapter, sequences[2:], drafter.target_layer_ids)
    begin, end = held.offsets[2], held.offsets[3]
    stored = load_file(path)
    assert torch.equal(stored["features"][begin:end], features[0]) and torch.equal(held.greedy[begin:end], greedy[0])
    _, finals = target_pass_with_final(adapter, sequences[2:], drafter.target_layer_ids)
    assert torch.equal(stored["final"][begin:end], finals[0])

    # The spine: the same drafts at the same anchors, so the same tau, as dflash.eval.replay.replay().
    evaluator_calls, heldout_calls = [], []
    monkeypatch.setattr(DrafterProposer, "__call__", recording(evaluator_calls))
    results = replay(drafter, adapter, prompts, max_new_tokens=max_new_tokens, batch_size=2)
    expected = acceptance_metrics([r.trace for r in results], drafter.block_size)
    monkeypatch.setattr(DrafterProposer, "__call__", recording(heldout_calls))
    drafter.train()
    metrics = held.evaluate(drafter, (adapter.embed_tokens().weight, adapter.lm_head_weight()))
    assert drafter.training, "evaluate must restore train mode"
    assert heldout_calls == evaluator_calls and len(heldout_calls) > 4
    assert metrics["tau"] == expected["tau"] and metrics["acceptance_rate"] == expected["acceptance_rate"]
    assert [metrics[f"acc_pos{k}"] for k in (1, 2, 3)] == expected["per_position"]
    assert metrics["samples"] == 4 and metrics["greedy_mismatches"] == 0
    assert sum(r.trace.num_steps for r in results) == expected["num_steps"] > 8
    # The estimate at T -> 0 along these greedy passes, from the stored final states, is the greedy replay.
    cold = held.evaluate(drafter, (adapter.embed_tokens().weight, adapter.lm_head_weight()), 1e-4)
    assert cold["tau"] == metrics["tau"] and cold["tau_T0.0001"] == pytest.approx(metrics["tau"], abs=1e-6)
    assert cold["acceptance_rate_T0.0001"] == pytest.approx(metrics["acceptance_rate"], abs=1e-6)
    assert held.logit_transform.identity  # the tiny target has none; one that has one is stored (below)


def test_heldout_passes_sampled_at_the_temperature_give_the_evaluators_estimate(tiny_target, make_drafter, tmp_path):
    """write_sampled_heldout continues the held-out prompts at T like replay at T does (same seed and batches): the
    held-out estimate on those passes equals the evaluator's replay estimate, and a HeldoutSet whose estimate comes
    from them keeps its own greedy tau."""
    from dflash.eval.expected_acceptance import expected_metrics
    from dflash.eval.replay_estimate import replay_estimate
    from dflash.train.heldout import sampled_path, write_sampled_heldout

    adapter = tiny_target("llama")
    drafter = make_drafter(adapter, std=0.2, block_size=4)
    prompts, max_new_tokens, temperature = chat_prompts(adapter), 12, 0.05
    continuations = greedy_continuations(adapter, prompts, max_new_tokens=max_new_tokens,
                                         stop_token_ids=adapter.stop_token_ids(), batch_size=2)
    rows = heldout_rows(adapter, prompts, continuations)
    path = str(tmp_path / "heldout.safetensors")
    write_heldout_features(adapter, rows, drafter.target_layer_ids, path, batch_size=2)
    write_sampled_heldout(adapter, rows, drafter.target_layer_ids, sampled_path(path, temperature),
                          temperature=temperature, seed=5, max_new_tokens=max_new_tokens, batch_size=2)
    assert sampled_path(path, temperature).endswith("heldout_T0.05.safetensors")
    sampled = HeldoutSet(sampled_path(path, temperature), max_new_tokens=max_new_tokens, batch_size=2)
    assert sampled.path_temperature == temperature and sampled.prompt_lens == [len(p) for p in prompts]
    held = HeldoutSet(path, max_new_tokens=max_new_tokens, batch_size=2, estimate_from=sampled)
    head = (adapter.embed_tokens().weight, adapter.lm_head_weight())
    figures = held.evaluate(drafter, head, temperature)
    expected = expected_metrics(replay_estimate(drafter, adapter, prompts, max_new_tokens=max_new_tokens,
                                                temperature=temperature, draft_sampling="greedy", seed=5,
                                                batch_size=2), 4)
    assert figures["tau_T0.05"] == pytest.approx(expected["tau"], rel=1e-6)
    assert figures["acceptance_rate_T0.05"] == pytest.approx(expected["acceptance_rate"], rel=1e-6)
    assert figures["tau"] == held.evaluate(drafter, head)["tau"]


def test_the_heldout_file_keeps_the_targets_logit_transform(tmp_path):
    from dflash.models.targets.logit_transform import LogitTransform

    transform = LogitTransform(scale=0.5, softcap=30.0)
    samples = learnable_store(2, seed=1)
    save_heldout_set(str(tmp_path / "h.safetensors"), [s["input_ids"].tolist() for s in samples],
                     [s["input_ids"] for s in samples], [s["hidden"] for s in samples], [4, 4], [0, 2],
                     logit_transform=transform)
    assert HeldoutSet(str(tmp_path / "h.safetensors"), batch_size=HELDOUT_BATCH).logit_transform == transform


def test_a_shorter_budget_cuts_the_responses(tiny_target, make_drafter, tmp_path):
    adapter = tiny_target("llama")
    drafter = make_drafter(adapter)
    prompts = chat_prompts(adapter)[:2]
    continuations = greedy_continuations(adapter, prompts, max_new_tokens=12, stop_token_ids=[],
                                         batch_size=HELDOUT_BATCH)
    path = str(tmp_path / "h.safetensors")
    write_heldout_features(adapter, heldout_rows(adapter, prompts, continuations), drafter.target_layer_ids, path,
                           batch_size=HELDOUT_BATCH)
    head = (adapter.embed_tokens().weight, adapter.lm_head_weight())
    replayed = replay(drafter, adapter, prompts, max_new_tokens=5, stop_token_ids=[], batch_size=HELDOUT_BATCH)
    expected = acceptance_metrics([r.trace for r in replayed], drafter.block_size)
    got = HeldoutSet(path, max_new_tokens=5, batch_size=HELDOUT_BATCH).evaluate(drafter, head)
    assert got["tau"] == expected["tau"] and expected["num_tokens"] == 2 * 4
    assert HeldoutSet(path, batch_size=HELDOUT_BATCH).max_new_tokens == 12  # default: the longest stored response


def test_bad_heldout_inputs_are_refused(tiny_target, make_drafter, tmp_path):
    adapter = tiny_target("llama")
    drafter = make_drafter(adapter)
    prompt = chat_prompts(adapter)[0]
    row = {"id": "x", "input_ids": prompt + [5, 6, 7], "loss_mask": [0] * len(prompt) + [1, 0, 1]}
    with pytest.raises(ValueError, match="'x': loss_mask is not prompt"):
        write_heldout_features(adapter, [row], [1, 3, 5], str(tmp_path / "h.safetensors"), batch_size=HELDOUT_BATCH)
    row["loss_mask"] = [0] * len(prompt) + [1, 1, 1]
    path = str(tmp_path / "h.safetensors")
    write_heldout_features(adapter, [row], [1, 3], path, batch_size=HELDOUT_BATCH)
    with pytest.raises(ValueError, match=r"target layers \[1, 3\], the drafter reads \[1, 3, 5\]"):
        HeldoutSet(path, batch_size=HELDOUT_BATCH).evaluate(drafter, (adapter.embed_tokens().weight,
                                                                      adapter.lm_head_weight()))
    with pytest.raises(ValueError, match="max_new_tokens must be >= 2"):
        HeldoutSet(path, max_new_tokens=1, batch_size=HELDOUT_BATCH)
    with pytest.raises(FileNotFoundError, match="missing.safetensors"):
        HeldoutSet(str(tmp_path / "missing.safetensors"), batch_size=HELDOUT_BATCH)
    with pytest.raises(ValueError, match="train.eval_every=-1: expected an int >= 0"):
        dataclasses.replace(trainer_harness.settings(2, 1), eval_every=-1)


def test_training_refuses_a_heldout_set_of_other_taps(tmp_path):
    samples = learnable_store(2, seed=1)
    save_heldout_set(str(tmp_path / "h.safetensors"), [s["input_ids"].tolist() for s in samples],
                     [s["input_ids"] for s in samples], [s["hidden"] for s in samples], [4, 4], [0, 1])
    with pytest.raises(ValueError, match=r"target layers \[0, 1\], the drafter reads \[0, 2\]"):
        run(tmp_path, heldout=HeldoutSet(str(tmp_path / "h.safetensors"), batch_size=HELDOUT_BATCH), eval_every=1)
    assert not (tmp_path / "checkpoints").exists()


# The training loop -------------------------------------------------------------------------------------------------


def learnable_store(num_samples: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Samples of the trainer harness's shape whose tokens alternate between t and t + 8: a few steps at a high
    learning rate teach the drafter some of it, so the held-out tau moves during a short run."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(num_samples):
        length, token = 12 + 3 * i, int(torch.randint(0, 8, (1,), generator=generator))
        loss_mask = torch.zeros(length, dtype=torch.long)
        loss_mask[4:] = 1
        samples.append({"input_ids": torch.tensor([token + 8 * (j % 2) for j in range(length)]),
                        "loss_mask": loss_mask,
                        "hidden": torch.randn(length, trainer_harness.TAPS * trainer_harness.HIDDEN,
                                              generator=generator)})
    return samples


def synthetic_heldout(path: str, num_samples: int = 3, finals: bool = False) -> HeldoutSet:
    """A held-out file for the trainer harness's drafter: the stored tokens are their own greedy path. `finals`:
    with final hidden states whose logits (through the harness's lm_head) favour each next stored token."""
    samples = learnable_store(num_samples, seed=9)
    sequences = [s["input_ids"].tolist() for s in samples]
    greedy = [torch.cat([s["input_ids"][1:], s["input_ids"][:1]]) for s in samples]
    states = [trainer_harness.frozen_head()[1][g] * 2.0 for g in greedy] if finals else None
    save_heldout_set(path, sequences, greedy, [s["hidden"] for s in samples], [4] * num_samples,
                     trainer_harness.drafter_config().target_layer_ids, states)
    return HeldoutSet(path, batch_size=HELDOUT_BATCH)


class ScriptedHeldout:
    """Stands in for a HeldoutSet: returns the scripted taus in order and records the steps' drafters."""

    def __init__(self, taus):
        self.taus = list(taus)
        self.calls = 0

    def check(self, config, temperature=0.0):
        pass

    def evaluate(self, drafter, frozen_head, temperature=0.0):
        assert isinstance(drafter, DFlashDraftModel)
        assert frozen_head[0].shape == (trainer_harness.VOCAB, trainer_harness.HIDDEN)
        tau = self.taus[self.calls]
        self.calls += 1
        figures = {"tau": tau, "acceptance_rate": tau / 4, "acc_pos1": 0.5, "samples": 3, "greedy_mismatches": 0}
        if temperature > 0:  # a figure that orders the steps the other way round
            figures[f"tau_T{temperature:g}"] = 5.0 - tau
        return figures


class FailingStore(list):
    """Raises once `limit` samples were read, like a run killed in the middle (after its last checkpoint)."""

    def __init__(self, samples, limit):
        super().__init__(samples)
        self.left = limit

    def __getitem__(self, index):
        self.left -= 1
        if self.left < 0:
            raise RuntimeError("killed")
        return super().__getitem__(index)


def run(out, *, heldout, eval_every, save_every=0, store=None, epochs=2, lr=3e-3, zero_stage=2, best_by="tau"):
    """Train the harness drafter (a global batch of 2 on 1 or 2 ranks); (final state, rank 0's metric records)."""
    from dflash.train.engine import init_distributed

    rank, world_size, _ = init_distributed()
    settings = trainer_harness.settings(2 // world_size, 1, epochs=epochs, save_every=save_every)
    settings.eval_every, settings.lr, settings.best_by = eval_every, lr, best_by
    log = MetricsLog(str(out), enabled=rank == 0, tensorboard=False, wandb_mode="disabled", wandb_project="t",
                     config={})
    try:
        state = loop.train(settings, trainer_harness.drafter_config(), store or trainer_harness.synthetic_store(),
                           trainer_harness.frozen_head(), str(out / "checkpoints"), log,
                           deepspeed=DeepSpeedSettings(zero_stage=zero_stage, bf16=False), rank=rank,
                           world_size=world_size, device=torch.device("cpu"), show_progress=False, heldout=heldout)
    finally:
        log.close()
    if rank != 0:
        return state, []
    with open(out / "metrics.jsonl", encoding="utf-8") as f:
        return state, [json.loads(line) for line in f]


def test_loop_logs_heldout_metrics_and_writes_best_only_on_improvement(tmp_path, monkeypatch):
    writes = []
    monkeypatch.setattr(heldout_tracker, "write_best", lambda directory, state, info: writes.append(dict(info)))
    heldout = ScriptedHeldout([1.5, 1.5, 1.8])  # steps 5, 10 (eval_every) and 12 (the last)
    _, records = run(tmp_path, heldout=heldout, eval_every=5, epochs=4)
    assert [r["step"] for r in records] == list(range(1, 13))
    evaluated = {r["step"]: r["heldout/tau"] for r in records if "heldout/tau" in r}
    assert evaluated == {5: 1.5, 10: 1.5, 12: 1.8}
    assert all(r["heldout/acc_pos1"] == 0.5 and r["heldout/acceptance_rate"] == r["heldout/tau"] / 4
               for r in records if r["step"] in evaluated)
    assert [(w["step"], w["tau"]) for w in writes] == [(5, 1.5), (12, 1.8)]  # a tie is no improvement
    with pytest.raises(ValueError, match="eval_every=2 needs a held-out set"):
        run(tmp_path / "none", heldout=None, eval_every=2)


def test_best_survives_a_resume_and_training_stays_exact(tmp_path):
    """Real held-out replays every step: the run's weights equal a run without evaluation, a run interrupted after
    its step-3 checkpoint resumes to the same weights and the same best, and best/ holds the weights it names."""
    held = synthetic_heldout(str(tmp_path / "heldout.safetensors"))
    common = dict(epochs=4, lr=3e-2)
    plain, _ = run(tmp_path / "plain", heldout=None, eval_every=0, store=learnable_store(6, 0), **common)
    full, records = run(tmp_path / "full", heldout=held, eval_every=1, store=learnable_store(6, 0), **common)
    assert all(torch.equal(plain[k], full[k]) for k in plain), "the evaluation changed training"
    taus = [r["heldout/tau"] for r in records]
    best = read_best(str(tmp_path / "full" / "checkpoints"))
    assert len(taus) == 12 and best["tau"] == max(taus) and best["step"] == 1 + taus.index(max(taus))
    assert 1 < best["step"] < 8 and best["tau"] > taus[0], f"the held-out tau did not move as expected: {taus}"
    weights, info = best_state_dict(str(tmp_path / "full" / "checkpoints"))
    assert info == best
    drafter = DFlashDraftModel(trainer_harness.drafter_config())
    drafter.load_state_dict(weights)
    assert held.evaluate(drafter, trainer_harness.frozen_head())["tau"] == best["tau"]

    # Interrupted while reading step 8's samples (2 per step, made ahead during step 7), after checkpoints 1..6;
    # resumed to the end.
    out = tmp_path / "resumed"
    with pytest.raises(RuntimeError, match="killed"):
        run(out, heldout=held, eval_every=1, save_every=1, store=FailingStore(learnable_store(6, 0), 15), **common)
    assert read_best(str(out / "checkpoints")) == best
    resumed, _ = run(out, heldout=held, eval_every=1, save_every=1, store=learnable_store(6, 0), **common)
    assert all(torch.equal(full[k], resumed[k]) for k in full)
    assert read_best(str(out / "checkpoints")) == best


def test_a_resumed_run_keeps_a_better_best_and_a_fresh_run_starts_over(tmp_path):
    directory = str(tmp_path / "checkpoints")
    state = {"w": torch.zeros(2)}
    # Checkpoints 1 and 2, then killed in step 3, as it reads step 4's samples (made ahead: train.prepare_ahead).
    store = FailingStore(trainer_harness.synthetic_store(), 6)
    with pytest.raises(RuntimeError, match="killed"):
        run(tmp_path, heldout=ScriptedHeldout([2.5, 1.0, 9.0]), eval_every=1, save_every=1, store=store)
    assert read_best(directory) == {"step": 1, "tau": 2.5, "acceptance_rate": 2.5 / 4}
    # Resumed at step 3 with worse taus: the best of step 1 stays.
    run(tmp_path, heldout=ScriptedHeldout([2.0, 2.1, 2.2, 2.3]), eval_every=1, save_every=1)
    assert read_best(directory)["step"] == 1
    # No checkpoint to resume from: an earlier run's best is not this run's.
    other = str(tmp_path / "fresh" / "checkpoints")
    write_best(other, state, {"step": 9, "tau": 7.0, "acceptance_rate": 1.0})
    run(tmp_path / "fresh", heldout=ScriptedHeldout([1.1] * 6), eval_every=1)
    assert read_best(other) == {"step": 1, "tau": 1.1, "acceptance_rate": 1.1 / 4}


def test_a_best_measured_after_the_resume_step_is_replaced_by_the_next_evaluation(tmp_path):
    """The best of steps a kill threw away (after the last checkpoint) is of weights the resumed run trains again:
    the next evaluation replaces it, whatever its figure, so the best is on the run's own line."""
    directory = str(tmp_path / "checkpoints")
    # Checkpoints every 2 steps; killed in step 4 (reading step 5's samples, made ahead), before its evaluation.
    with pytest.raises(RuntimeError, match="killed"):
        run(tmp_path, heldout=ScriptedHeldout([1.0, 1.2, 9.0]), eval_every=1, save_every=2,
            store=FailingStore(trainer_harness.synthetic_store(), 8))
    assert read_best(directory)["step"] == 3  # measured after checkpoint 2, the one the run resumes from
    run(tmp_path, heldout=ScriptedHeldout([2.0, 2.1, 2.2, 2.3]), eval_every=1, save_every=2)
    assert read_best(directory) == {"step": 6, "tau": 2.3, "acceptance_rate": 2.3 / 4}


def test_best_by_names_the_figure_that_picks_the_best(tmp_path, monkeypatch):
    """train.best_by=tau_T1 keeps the weights of the best expected tau at T=1, not of the best greedy tau; the
    record gets the figure and best.json names it."""
    writes = []
    monkeypatch.setattr(heldout_tracker, "write_best", lambda directory, state, info: writes.append(dict(info)))
    _, records = run(tmp_path / "tau", heldout=ScriptedHeldout([1.5, 1.9, 1.2]), eval_every=1, epochs=1)
    assert [w["step"] for w in writes] == [1, 2] and "heldout/tau_T1" not in records[0]
    writes.clear()
    _, records = run(tmp_path / "t1", heldout=ScriptedHeldout([1.5, 1.9, 1.2]), eval_every=1, epochs=1,
                     best_by="tau_T1")
    assert [r["heldout/tau_T1"] for r in records] == [3.5, 3.1, 3.8]
    assert [(w["step"], w["best_by"], w["tau_T1"], w["tau"]) for w in writes] == [(1, "tau_T1", 3.5, 1.5),
                                                                                 (3, "tau_T1", 3.8, 1.2)]


def test_best_by_a_temperature_on_real_heldout_replays(tmp_path):
    """With the estimate read from stored final states: the best step is the one of the highest heldout/tau_T0.5,
    its weights give that figure again, and a file without final states is refused before training."""
    held = synthetic_heldout(str(tmp_path / "heldout.safetensors"), finals=True)
    _, records = run(tmp_path / "run", heldout=held, eval_every=1, store=learnable_store(6, 0), epochs=4, lr=3e-2,
                     best_by="tau_T0.5")
    estimates = [r["heldout/tau_T0.5"] for r in records]
    best = read_best(str(tmp_path / "run" / "checkpoints"))
    assert best["best_by"] == "tau_T0.5" and best["tau_T0.5"] == max(estimates)
    assert best["step"] == 1 + estimates.index(max(estimates)) and len(set(estimates)) > 1, estimates
    weights, _ = best_state_dict(str(tmp_path / "run" / "checkpoints"))
    drafter = DFlashDraftModel(trainer_harness.drafter_config())
    drafter.load_state_dict(weights)
    assert held.evaluate(drafter, trainer_harness.frozen_head(), 0.5)["tau_T0.5"] == best["tau_T0.5"]
    without = synthetic_heldout(str(tmp_path / "old.safetensors"))
    with pytest.raises(ValueError, match="without the target's final hidden states, which the expected tau at T=0.5"):
        run(tmp_path / "old", heldout=without, eval_every=1, best_by="tau_T0.5")
    assert not (tmp_path / "old" / "checkpoints").exists()


def test_best_checkpoint_replacement_is_atomic(tmp_path):
    directory = str(tmp_path)
    assert read_best(directory) is None and best_state_dict(directory) is None
    write_best(directory, {"w": torch.ones(2)}, {"step": 1, "tau": 1.5, "acceptance_rate": 0.2})
    write_best(directory, {"w": torch.full((2,), 2.0)}, {"step": 2, "tau": 1.7, "acceptance_rate": 0.3})
    assert sorted(os.listdir(directory)) == ["best"]
    # A kill between the two renames of a replacement leaves only best.old/: it is still the best.
    os.replace(tmp_path / "best", tmp_path / "best.old")
    weights, info = best_state_dict(directory)
    assert info["step"] == 2 and torch.equal(weights["w"], torch.full((2,), 2.0))
    write_best(directory, {"w": torch.full((2,), 3.0)}, {"step": 3, "tau": 1.9, "acceptance_rate": 0.4})
    assert sorted(os.listdir(directory)) == ["best"] and read_best(directory)["step"] == 3


@pytest.fixture(scope="module")
def one_process_heldout_run(tmp_path_factory) -> tuple[pathlib.Path, list[dict]]:
    """The 1-process reference of both ZeRO stages below (it trains ZeRO-2): its folder, which holds the held-out
    file the two ranks read too, and its records."""
    directory = tmp_path_factory.mktemp("heldout-one")
    held = synthetic_heldout(str(directory / "heldout.safetensors"))
    _, records = run(directory / "one", heldout=held, eval_every=1, store=learnable_store(6, 0), epochs=4, lr=3e-2)
    return directory, records


def two_rank_run(directory: str, zero_stage: int, out: str) -> None:
    """One rank of test_two_ranks_evaluate_like_one's job (tests/forked.py's run_ranks)."""
    heldout = HeldoutSet(os.path.join(directory, "heldout.safetensors"), batch_size=HELDOUT_BATCH)
    run(pathlib.Path(out), heldout=heldout, eval_every=1,
        store=learnable_store(6, 0), epochs=4, lr=3e-2, zero_stage=zero_stage)


@pytest.mark.multiproc
@pytest.mark.parametrize("zero_stage", [2, 3])
@pytest.mark.slow
def test_two_ranks_evaluate_like_one(tmp_path, zero_stage, one_process_heldout_run):
    """Rank 0 evaluates while the other rank waits (ZeRO-2), or every rank joins the consolidation (ZeRO-3): the
    held-out taus and the best equal those of one process on the same global batches."""
    directory, one = one_process_heldout_run
    # The 2 ranks fork from a server that imported the trainer once (tests/forked.py): torchrun's processes would each
    # import it again, most of this test's time.
    assert run_ranks(two_rank_run, 2, str(directory), zero_stage, str(tmp_path / "two")) == [0, 0]
    with open(tmp_path / "two" / "metrics.jsonl", encoding="utf-8") as f:
        two = [json.loads(line) for line in f]
    assert [r["heldout/tau"] for r in two] == [r["heldout/tau"] for r in one]
    assert read_best(str(tmp_path / "two" / "checkpoints")) == read_best(str(directory / "one" / "checkpoints"))
    weights, _ = best_state_dict(str(tmp_path / "two" / "checkpoints"))
    assert set(weights) == set(DFlashDraftModel(trainer_harness.drafter_config()).state_dict())


@pytest.mark.gpu
@pytest.mark.slow
def test_heldout_replay_on_gpu_matches_the_evaluator(tmp_path, monkeypatch):
    """SmolLM2 in bf16 on CUDA, 32 prompts x 256 new tokens: the held-out replay drafts what the evaluator drafts;
    prints both times (the held-out one is what a training run pays per evaluation)."""
    import time

    from dflash.models.drafter_config import DrafterConfig, default_target_layer_ids
    from dflash.models.targets import load_target

    adapter = load_target("smollm2", device="cuda")
    layer_ids = default_target_layer_ids(adapter.num_layers, 3)
    config = DrafterConfig(hidden_size=adapter.hidden_size, intermediate_size=1536, num_hidden_layers=2,
                           num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=adapter.vocab_size,
                           num_target_layers=adapter.num_layers, target_layer_ids=layer_ids,
                           mask_token_id=adapter.vocab_size - 1, block_size=16,
                           layer_types=["sliding_attention", "full_attention"], sliding_window=2048)
    drafter = DFlashDraftModel(config)
    drafter.init_weights(0, std=0.05)
    drafter = drafter.to("cuda", adapter.dtype).eval()
    prompts = [adapter.chat_ids([{"role": "user", "content": f"Tell me fact number {i} about the sea."}])
               for i in range(32)]
    started = time.perf_counter()
    continuations = greedy_continuations(adapter, prompts, max_new_tokens=256,
                                         stop_token_ids=adapter.stop_token_ids(), batch_size=HELDOUT_BATCH)
    path = str(tmp_path / "heldout.safetensors")
    write_heldout_features(adapter, heldout_rows(adapter, prompts, continuations), layer_ids, path,
                           batch_size=HELDOUT_BATCH)
    prepared = time.perf_counter() - started
    evaluator_calls, heldout_calls = [], []
    monkeypatch.setattr(DrafterProposer, "__call__", recording(heldout_calls))
    started = time.perf_counter()
    metrics = HeldoutSet(path, max_new_tokens=256, batch_size=HELDOUT_BATCH).evaluate(
        drafter, (adapter.embed_tokens().weight, adapter.lm_head_weight()))
    heldout_s = time.perf_counter() - started
    monkeypatch.setattr(DrafterProposer, "__call__", recording(evaluator_calls))
    started = time.perf_counter()
    expected = acceptance_metrics([r.trace for r in replay(drafter, adapter, prompts, max_new_tokens=256,
                                                           batch_size=HELDOUT_BATCH)], 16)
    replay_s = time.perf_counter() - started
    print(f"held-out: generation + features {prepared:.1f} s, replay {heldout_s:.1f} s, tau {metrics['tau']:.4f}, "
          f"mismatches {metrics['greedy_mismatches']}; evaluator replay (with generation) {replay_s:.1f} s, "
          f"tau {expected['tau']:.4f}")
    same = sum(a == b for a, b in zip(heldout_calls, evaluator_calls)) / max(len(evaluator_calls), 1)
    assert same > 0.99 and metrics["tau"] == pytest.approx(expected["tau"], abs=0.02)
