"""The host's work in a ZeRO step (dflash/train/engine.py), in bf16 on the CPU accelerator as on a GPU: the ZeRO-1/2
step's lighter gradient checks (lighten_gradient_checks) give DeepSpeed's own norm and update and still skip a step
with a non-finite gradient; gradients left where backward makes them (deepspeed.contiguous_gradients=false) train
the same weights; both leave the host far fewer operators to issue."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from dflash.config.schema import DeepSpeedSettings
from dflash.models.drafter import DFlashDraftModel
from dflash.train.engine import TrainEngine, init_distributed
from dflash.train.step_profile import PHASE_PREFIX, phase_counts
from tests import trainer_harness


def make_engine(light: bool, grad_clip: float = 1.0, zero_stage: int = 2, grad_accum: int = 1,
                contiguous: bool = False) -> TrainEngine:
    _, world_size, _ = init_distributed()
    drafter = DFlashDraftModel(trainer_harness.drafter_config())
    drafter.init_weights(0)
    settings = dataclasses.replace(trainer_harness.settings(micro_batch_size=2, grad_accum=grad_accum),
                                   grad_clip=grad_clip)
    deepspeed = DeepSpeedSettings(zero_stage=zero_stage, contiguous_gradients=contiguous)
    return TrainEngine(drafter, settings, deepspeed, total_steps=4, world_size=world_size, bf16=True,
                       light_checks=light)


def step(engine: TrainEngine, scale: float = 1.0, poison: bool = False) -> None:
    """A backward of a loss that reaches every parameter (NaN with `poison`), then the optimizer step."""
    engine.backward(loss_of(engine, scale) * float("nan") if poison else loss_of(engine, scale))
    engine.step()


def loss_of(engine: TrainEngine, scale: float) -> torch.Tensor:
    return sum((p.float() * (i + 1)).square().sum() for i, p in enumerate(engine.module.parameters())) * scale


def weights(engine: TrainEngine) -> list[torch.Tensor]:
    return [p.detach().float().clone() for p in engine.module.parameters()]


@pytest.mark.parametrize("grad_clip", [1e9, 1.0])  # the clip inactive (its factor exactly 1), then active
def test_the_same_norm_and_update_as_deepspeed_s_own_checks(grad_clip):
    light, plain = make_engine(True, grad_clip), make_engine(False, grad_clip)
    assert light.light_gradient_checks and not plain.light_gradient_checks
    for scale in (1e-4, 1.0):
        step(light, scale)
        step(plain, scale)
        assert light.grad_norm() == plain.grad_norm() > 0  # to the last bit
        for ours, theirs in zip(weights(light), weights(plain)):
            if grad_clip > 1e6:
                assert torch.equal(ours, theirs)
            else:  # the clip factor from a norm rounded otherwise: the last bit of a bf16 weight at most
                torch.testing.assert_close(ours, theirs, rtol=2 ** -7, atol=0)


@pytest.mark.parametrize("grad_clip", [1.0, 0.0])  # DeepSpeed takes the global norm without clipping too
def test_a_step_with_a_non_finite_gradient_is_still_skipped(grad_clip):
    light = make_engine(True, grad_clip)
    assert light.light_gradient_checks
    step(light, 1e-4)
    before = weights(light)
    step(light, poison=True)
    assert light.grad_norm() == float("inf")  # what DivergenceGuard reads: a non-finite, skipped step
    assert all(torch.equal(a, b) for a, b in zip(before, weights(light)))
    step(light, 1e-4)  # training goes on from the kept weights
    assert all(torch.isfinite(w).all() for w in weights(light)) and light.grad_norm() > 0


def two_ranks_with_one_inf(out: str, light: bool, zero_stage: int) -> None:
    """A rank of tests.forked.run_ranks: 3 steps of 2 accumulated micro-steps; at step 2 rank 0 alone gets an inf
    in one tensor's gradient. Saves each step's norm and the final weights."""
    engine = make_engine(light, zero_stage=zero_stage, grad_accum=2)
    rank, last = torch.distributed.get_rank(), list(engine.module.parameters())[-1]
    norms = []
    for index in range(3):
        for micro in range(2):
            loss = loss_of(engine, 1e-3 * (rank + 1))
            if index == 1 and rank == 0 and micro == 0:
                loss = loss + last.float().sum() * float("inf")
            engine.backward(loss)
            engine.step()
        norms.append(engine.grad_norm())
    torch.save({"light": engine.light_gradient_checks, "norms": norms, "weights": weights(engine),
                "skipped": engine.engine.skipped_steps}, f"{out}/rank{rank}.pt")


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [1, 2])
def test_two_ranks_skip_together_when_one_rank_s_gradient_is_not_finite(tmp_path, zero_stage):
    from tests.forked import run_ranks

    results = {}
    for light in (True, False):
        out = tmp_path / str(light)
        out.mkdir()
        assert run_ranks(two_ranks_with_one_inf, 2, str(out), light, zero_stage) == [0, 0]
        results[light] = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for ranks in results.values():
        assert ranks[0]["norms"] == ranks[1]["norms"] and ranks[0]["norms"][1] == float("inf")
        assert all(r["skipped"] == 1 for r in ranks)
    assert [r["light"] for r in results[True]] == [True, True]
    assert results[True][0]["norms"] == results[False][0]["norms"]
    for ours, theirs in zip(results[True][0]["weights"], results[False][0]["weights"]):
        assert torch.equal(ours, theirs)


def test_zero_3_keeps_deepspeed_s_checks():
    assert not make_engine(True, zero_stage=3).light_gradient_checks  # its optimizer is another class


def dispatched(engine: TrainEngine, phase: str) -> int:
    """Operators dispatched in the second step's `phase` ("backward" or "optimizer step")."""
    step(engine)  # the first step builds the optimizer's state
    loss = loss_of(engine, 1.0)
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        with record_function(PHASE_PREFIX + "backward"):
            engine.backward(loss)
        with record_function(PHASE_PREFIX + "optimizer step"):
            engine.step()
    return phase_counts(trace.events())[PHASE_PREFIX + phase].operators


def test_the_step_drops_its_two_passes_of_operators_per_gradient():
    counts = {light: dispatched(make_engine(light), "optimizer step") for light in (True, False)}
    tensors = len(list(make_engine(True).module.parameters()))
    # DeepSpeed's own: a check (seven operators) and a norm (three) per gradient, and four to point each bf16 weight
    # at its slice again (keep_weight_views leaves them), beside a few dozen for the whole step.
    assert counts[False] - counts[True] >= 14 * tensors, counts
    assert counts[True] <= 60, counts


def test_gradients_left_in_place_train_the_same_weights_with_less_host_work_in_backward():
    kept, copied = make_engine(True), make_engine(True, contiguous=True)
    for scale in (1e-4, 1.0, 1e-2):
        step(kept, scale)
        step(copied, scale)
        assert kept.grad_norm() == copied.grad_norm() > 0
    assert all(torch.equal(a, b) for a, b in zip(weights(kept), weights(copied)))
    tensors = len(list(kept.module.parameters()))
    # DeepSpeed's copy into its gradient buffer: a copy, views and a pointer swap per gradient.
    assert dispatched(copied, "backward") - dispatched(kept, "backward") >= 8 * tensors


def test_a_checkpoint_of_contiguous_gradients_resumes_without_them(tmp_path):
    copied = make_engine(True, contiguous=True)
    step(copied, 1e-3)
    copied.save(str(tmp_path), "step1", {})
    kept = make_engine(True)
    kept.load(str(tmp_path), "step1")
    assert all(torch.equal(a, b) for a, b in zip(weights(kept), weights(copied)))
    step(copied, 1e-3)
    step(kept, 1e-3)
    assert all(torch.equal(a, b) for a, b in zip(weights(kept), weights(copied)))


@pytest.mark.slow
def test_the_zero_step_bench_runs():
    import json
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, os.path.join(repo, "bench", "zero_step_host_work.py"), "--steps", "1"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout[done.stdout.index("{"):])
    ours, theirs = report["dflash_defaults"], report["deepspeed_defaults"]
    assert ours["light_checks"] and not theirs["light_checks"]
    for phase in ("backward", "step"):
        assert ours[phase]["dispatched_operators"] < theirs[phase]["dispatched_operators"] / 2, phase
    assert ours["grad_norm"] == theirs["grad_norm"]


def deepspeed_s_repointing(engine: TrainEngine) -> TrainEngine:
    """The engine with DeepSpeed's own re-pointing of the bf16 weights after each step (keep_weight_views undone)."""
    del engine.engine.optimizer._update_model_bit16_weights  # the instance's patch; the class's method is back
    return engine


def in_flat_buffer(engine: TrainEngine) -> bool:
    flat = engine.engine.optimizer.bit16_groups_flat[0]
    end = flat.data_ptr() + flat.numel() * flat.element_size()
    return all(flat.data_ptr() <= p.data_ptr() < end for p in engine.module.parameters())


def test_weights_left_where_they_point_train_the_same_weights_with_less_host_work():
    kept, repointed = make_engine(True), deepspeed_s_repointing(make_engine(True))
    assert kept.weight_views_kept
    for scale in (1e-4, 1.0, 1e-2):
        step(kept, scale)
        step(repointed, scale)
        assert all(torch.equal(a, b) for a, b in zip(weights(kept), weights(repointed)))
    assert in_flat_buffer(kept)
    tensors = len(list(kept.module.parameters()))
    # DeepSpeed's: a narrow, a view and two pointer swaps per weight, every step.
    assert dispatched(repointed, "optimizer step") - dispatched(kept, "optimizer step") >= 4 * tensors


def test_a_weight_that_moved_is_pointed_back_at_its_slice():
    kept, repointed = make_engine(True), deepspeed_s_repointing(make_engine(True))
    for engine in (kept, repointed):
        step(engine, 1e-3)
        moved = list(engine.module.parameters())[3]
        moved.data = moved.data.clone()  # the same values elsewhere: the flat buffer's update would miss it
        step(engine, 1e-3)
    assert in_flat_buffer(kept)
    assert all(torch.equal(a, b) for a, b in zip(weights(kept), weights(repointed)))
    step(kept, 1e-3)
    step(repointed, 1e-3)
    assert all(torch.equal(a, b) for a, b in zip(weights(kept), weights(repointed)))


@pytest.mark.parametrize("grad_accum,zero_stage", [(1, 2), (2, 2), (2, 1)])
def test_one_rank_s_gradients_left_unreduced_train_the_same_weights_with_less_host_work(grad_accum, zero_stage):
    unreduced, reduced = (make_engine(True, grad_accum=grad_accum, zero_stage=zero_stage) for _ in range(2))
    assert unreduced.one_rank_reduction_skipped
    del reduced.engine.optimizer.buffered_reduce_fallback  # DeepSpeed's flatten, divide, all-reduce and copy back
    for scale in (1e-4, 1.0, 1e-2):
        for engine in (unreduced, reduced):
            for _ in range(grad_accum):
                engine.backward(loss_of(engine, scale))
                engine.step()
        assert unreduced.grad_norm() == reduced.grad_norm() > 0
        assert all(torch.equal(a, b) for a, b in zip(weights(unreduced), weights(reduced)))
    tensors = len(list(unreduced.module.parameters()))
    # DeepSpeed's: a copy back per gradient, and the flatten, division and all-reduce of the bucket.
    assert dispatched(reduced, "backward") - dispatched(unreduced, "backward") >= tensors


def test_contiguous_gradients_keep_deepspeed_s_reduction():
    assert not make_engine(True, contiguous=True).one_rank_reduction_skipped  # its buffer is reduced otherwise


def test_weights_in_place_follows_round_robin_order():
    """Under DeepSpeed's round_robin_gradients the flat buffer holds the weights in another order, and the map from a
    weight's model position to its place there is a dict: the check follows it."""
    from types import SimpleNamespace

    from dflash.train.engine import weights_in_place

    optimizer = make_engine(True).engine.optimizer
    assert weights_in_place(optimizer, 0)
    count = len(optimizer.bit16_groups[0])
    reordered = SimpleNamespace(
        bit16_groups=optimizer.bit16_groups, bit16_groups_flat=optimizer.bit16_groups_flat,
        round_robin_bit16_groups=[optimizer.round_robin_bit16_groups[0][::-1]],
        round_robin_bit16_meta=[optimizer.round_robin_bit16_meta[0][::-1]],
        round_robin_bit16_offsets=[optimizer.round_robin_bit16_offsets[0][::-1]],
        round_robin_bit16_indices=[{k: count - 1 - k for k in range(count)}])
    assert weights_in_place(reordered, 0)
    reordered.round_robin_bit16_indices = [{k: k for k in range(count)}]  # a map that does not match the order
    assert not weights_in_place(reordered, 0)
