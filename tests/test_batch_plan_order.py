"""BatchPlan computes each epoch's order once (dflash/data/batch_plan.py, BatchPlan._order): a trainer asks for its
micro-batches every step and an online capture rank for every unit of every trainer rank, and each ask used to
shuffle (and length-sort) the whole epoch again. The micro-batches are those the plan dealt before."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from dflash.data.batch_plan import BatchPlan
from dflash.extract.rank_stream import UnitStream

LENGTHS = tuple((i * 37) % 101 + 1 for i in range(103))
# Plans of 103 samples (a partial last batch of placeholders) and the digest of every micro-batch of their first 3
# epochs as the plan dealt them before the order was cached (computed at d2e9f34).
# The last two keep 41 samples apart (BatchPlan.kept; computed when it came, session 38): checkpoints record the
# count, so a resume deals the later epochs as the run's start did only while these orders stay.
PLANS = [(dict(micro_batch_size=2, world_size=3, grad_accum=2, seed=7), "d628a8ebf65f429e"),
         (dict(micro_batch_size=1, world_size=2, grad_accum=4, seed=1, group_by_length=3, lengths=LENGTHS),
          "e038cde6981cd335"),
         (dict(micro_batch_size=2, world_size=3, grad_accum=2, seed=7, kept=41), "788f59e407fd9845"),
         (dict(micro_batch_size=1, world_size=2, grad_accum=4, seed=1, group_by_length=3, lengths=LENGTHS, kept=41),
          "1ee0c7fb57b0d096")]


def every_micro_batch(plan: BatchPlan, epochs: int) -> list:
    return [plan.micro_batches(epoch, step, rank) for epoch in range(epochs) for step in range(plan.steps_per_epoch)
            for rank in range(plan.world_size)]


@pytest.fixture
def shuffles(monkeypatch) -> list[int]:
    """The sizes of the permutations drawn (torch.randperm): one of every sample per epoch order computed."""
    calls, real = [], torch.randperm

    def randperm(n, *args, **kwargs):
        calls.append(n)
        return real(n, *args, **kwargs)
    monkeypatch.setattr(torch, "randperm", randperm)
    return calls


@pytest.mark.parametrize("fields,digest", PLANS)
def test_the_plan_deals_the_micro_batches_it_dealt_before(fields, digest):
    plan = BatchPlan(103, **fields)
    walk = every_micro_batch(plan, 3)
    assert hashlib.sha256(json.dumps(walk).encode()).hexdigest()[:16] == digest
    assert sorted(plan.epoch_order(1)) == list(range(103))


@pytest.mark.parametrize("group_by_length", [0, 2])
def test_each_epochs_order_is_computed_once(shuffles, group_by_length):
    """A trainer's micro-batches of every step and rank; the seed is this test's own, so no other test's plan
    computed these orders in this process already."""
    plan = BatchPlan(103, 2, 3, 2, seed=424_242 + group_by_length, group_by_length=group_by_length,
                     lengths=LENGTHS)
    every_micro_batch(plan, 3)
    assert shuffles.count(103) == 3


def test_a_capture_rank_walking_every_unit_computes_each_epochs_order_once(shuffles):
    """A capture rank serving 12 trainer ranks of 4 micro-steps asks for the micro-batches of 48 units a step: each
    asked for the whole epoch's order before."""
    plan = BatchPlan(300, 1, 12, 4, seed=434_343)
    stream = UnitStream(plan, 2)
    indices = [stream.indices(u) for u in range(stream.num_units)]
    assert shuffles.count(300) == 2
    expected = []  # unit u = (step x grad_accum + micro-step) x trainers + rank
    for step in range(2 * plan.steps_per_epoch):
        for micro_step in range(4):
            for rank in range(12):
                micro = plan.micro_batches(*divmod(step, plan.steps_per_epoch), rank)[micro_step]
                expected.append([i for i, _ in micro])
    assert indices == expected


def spread(batches: list) -> int:
    """The batches' length ranges, summed."""
    return sum(max(LENGTHS[i] for i in batch) - min(LENGTHS[i] for i in batch) for batch in batches)


@pytest.mark.parametrize("group_by_length", [0, 8])
def test_the_kept_samples_are_batched_apart_after_the_first_epoch(group_by_length):
    """The first `kept` samples of epoch 0's order (what a memory in part holds) fill global batches of their own in
    every later epoch, but for one a run of group_by_length batches (or the epoch) that holds both; epoch 0 is dealt
    as without them, every epoch is still a permutation, and length groups stay: the kept class is sorted by length
    within each run like the rest."""
    fields = dict(micro_batch_size=2, world_size=1, grad_accum=2, seed=11, group_by_length=group_by_length,
                  lengths=LENGTHS)
    mixing, apart = BatchPlan(103, **fields), BatchPlan(103, kept=41, **fields)
    assert apart.epoch_order(0) == mixing.epoch_order(0) and apart != mixing
    kept = set(mixing.epoch_order(0)[:41])
    runs = -(-apart.steps_per_epoch // group_by_length) if group_by_length else 1
    for epoch in (1, 2):
        order = apart.epoch_order(epoch)
        assert sorted(order) == list(range(103)) and order != mixing.epoch_order(epoch)
        batches = [order[b * 4:(b + 1) * 4] for b in range(len(order) // 4)]
        mixed = [batch for batch in batches if 0 < len(kept.intersection(batch)) < len(batch)]
        assert len(mixed) <= runs and sum(len(kept.intersection(b)) == 4 for b in batches) >= 41 // 4 - runs
        if group_by_length:  # a batch's lengths are neighbours in its class's sorted run, not a random draw
            ungrouped = BatchPlan(103, kept=41, **{**fields, "group_by_length": 0}).epoch_order(epoch)
            assert spread(batches) < spread([ungrouped[b * 4:(b + 1) * 4] for b in range(25)]) / 2
    with pytest.raises(ValueError, match="kept must be 0..103 samples, got 104"):
        BatchPlan(103, 2, 1, 1, seed=0, kept=104)
    whole = BatchPlan(103, 2, 1, 1, seed=0, kept=103)
    assert whole.epoch_order(1) == BatchPlan(103, 2, 1, 1, seed=0).epoch_order(1)  # nothing to batch apart


def test_the_batch_plan_bench_runs():
    """bench/batch_plan.py reaches into the cache it times (BatchPlan._order): a rename breaks it, not only a test."""
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, os.path.join(repo, "bench", "batch_plan.py"), "--samples", "600",
                           "--steps", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout)["results"]
    assert [r["group_by_length"] for r in results] == [0, 8]
    assert all(r["capture_step_ms"]["cached"] >= 0 and r["order_ms"] >= 0 for r in results)
