"""The training step's speed choices keep the math: fused AdamW under DeepSpeed, batches moved without waiting."""

from __future__ import annotations

import dataclasses

import torch

from dflash.config.schema import DeepSpeedSettings
from dflash.models.drafter import DFlashDraftModel
from dflash.train.batches import batch_to_device, prepare_micro_batch
from dflash.train.engine import TrainEngine, init_distributed, steps_beside_params
from dflash.train.loop import train_step
from dflash.train.step_metrics import step_flops
from tests import trainer_harness


def make_engine(fused: bool | None) -> TrainEngine:
    init_distributed()
    drafter = DFlashDraftModel(trainer_harness.drafter_config())
    drafter.init_weights(0)
    settings = dataclasses.replace(trainer_harness.settings(micro_batch_size=2, grad_accum=1), weight_decay=0.01)
    return TrainEngine(drafter, settings, DeepSpeedSettings(zero_stage=2), total_steps=4, world_size=1, bf16=False,
                       fused_adamw=fused)


def micro_batches(step: int) -> list[dict[str, torch.Tensor]]:
    store = trainer_harness.synthetic_store()
    slots = [(2 * step % 6, True), ((2 * step + 1) % 6, True)]
    return [prepare_micro_batch(store, slots, epoch=0, seed=0, num_anchors=4, block_size=4, gamma=4.0)]


def run_steps(engine: TrainEngine, steps: range) -> list[float]:
    embed, lm_head = trainer_harness.frozen_head()
    settings = trainer_harness.settings(micro_batch_size=2, grad_accum=1)
    return [train_step(engine, embed, lm_head, micro_batches(step), settings, 1)["loss"] for step in steps]


def test_fused_adamw_is_chosen_on_cuda_only_and_trains_like_the_default(tmp_path):
    default, fused = make_engine(None), make_engine(True)
    assert not default.base_optimizer.defaults["fused"]  # CPU: the unfused default, math unchanged
    assert fused.base_optimizer.defaults["fused"]
    losses_default, losses_fused = run_steps(default, range(3)), run_steps(fused, range(3))
    torch.testing.assert_close(torch.tensor(losses_fused), torch.tensor(losses_default), rtol=1e-5, atol=1e-6)
    for name, value in default.consolidated_state_dict().items():
        torch.testing.assert_close(fused.consolidated_state_dict()[name], value, rtol=1e-4, atol=1e-6)

    # Its state survives a DeepSpeed checkpoint: a resumed fused engine continues exactly.
    fused.save(str(tmp_path), "step3", {})
    resumed = make_engine(True)
    resumed.load(str(tmp_path), "step3")
    assert run_steps(resumed, range(3, 4)) == run_steps(fused, range(3, 4))
    for name, value in fused.consolidated_state_dict().items():
        assert torch.equal(resumed.consolidated_state_dict()[name], value), name


def test_batch_to_device_moves_every_tensor_and_casts_only_the_features():
    batch = micro_batches(0)[0]
    moved = batch_to_device(batch, torch.device("cpu"), torch.bfloat16)
    assert set(moved) == set(batch)
    assert moved["hidden"].dtype == torch.bfloat16
    assert torch.equal(moved["hidden"], batch["hidden"].to(torch.bfloat16))
    for key in set(batch) - {"hidden"}:
        assert moved[key] is batch[key]  # already there: no copy


def test_the_step_reports_the_counts_it_trained_on():
    engine = make_engine(None)
    embed, lm_head = trainer_harness.frozen_head()
    batch = micro_batches(0)
    metrics = train_step(engine, embed, lm_head, batch, trainer_harness.settings(2, 1), 1)
    tokens = batch[0]["input_ids"].numel()
    assert metrics["tokens"] == tokens
    queries = batch[0]["labels"].numel()
    config = engine.config
    assert metrics["flops"] == step_flops(config, queries, tokens)
    positions = [metrics[f"acc_pos{k}"] for k in range(1, config.block_size)]
    assert all(0.0 <= p <= 1.0 for p in positions) and 0.0 <= metrics["acc"] <= 1.0


def test_a_step_set_directly_is_placed_for_the_fused_kernel():
    # What a universal-checkpoint load leaves behind: a step that is not the fused kernel's float32 tensor.
    param = torch.nn.Parameter(torch.ones(3))
    for fused, want in ((True, torch.float32), (None, torch.float64)):
        optimizer = torch.optim.AdamW([param], fused=fused)
        optimizer.state[param] = {"step": torch.tensor(5.0, dtype=torch.float64), "exp_avg": torch.zeros(3),
                                  "exp_avg_sq": torch.zeros(3)}
        steps_beside_params(optimizer)
        assert optimizer.state[param]["step"].dtype == want and optimizer.state[param]["step"].item() == 5.0


def test_anchor_slots_no_sequence_uses_are_trimmed_without_changing_the_loss(monkeypatch):
    import dflash.train.batches as batches

    store = trainer_harness.synthetic_store()  # 7 to 22 valid anchors per sequence
    slots = [(4, True), (5, True)]

    def prepared():
        return [prepare_micro_batch(store, slots, epoch=0, seed=0, num_anchors=64, block_size=4, gamma=4.0)]

    trimmed = prepared()
    assert trimmed[0]["anchors"].shape[1] == 32  # 22 used slots, rounded up to the quantum
    monkeypatch.setattr(batches, "trim_anchor_padding", lambda anchors, valid: (anchors, valid))
    padded = prepared()
    assert padded[0]["anchors"].shape[1] == 64
    assert torch.equal(padded[0]["anchors"][:, :32], trimmed[0]["anchors"])
    assert not padded[0]["weights"][:, 32:].any()  # what was dropped weighed nothing

    embed, lm_head = trainer_harness.frozen_head()
    settings = trainer_harness.settings(micro_batch_size=2, grad_accum=1)
    loss = {}
    for name, batch in (("trimmed", trimmed), ("padded", padded)):
        engine = make_engine(None)
        loss[name] = train_step(engine, embed, lm_head, batch, settings, 1)["loss"]
    assert abs(loss["trimmed"] - loss["padded"]) < 1e-5 * abs(loss["padded"])


def test_a_schedule_left_behind_its_global_step_is_aligned_to_it():
    """A checkpoint saved before a non-finite step stepped the LR schedule too holds a schedule behind its global
    step: aligned on resume, the LR is the step's (as the scheduler's own steps would have set it)."""
    behind, ahead = make_engine(None), make_engine(None)
    for _ in range(3):
        ahead.scheduler.step()
    ahead_lr = ahead.lr()
    behind.scheduler.step()  # one of the three steps counted
    assert behind.lr() != ahead_lr
    behind.align_schedule(3)
    assert behind.scheduler.last_epoch == 3 and behind.lr() == ahead_lr
    behind.align_schedule(3)  # where it is already: nothing changes
    assert behind.lr() == ahead_lr
