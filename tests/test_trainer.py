"""The trainer: accumulation and data parallelism give the gradient of one big batch; resume continues exactly."""

import os
import subprocess
import sys

import pytest
import torch

from tests import trainer_harness
from dflash.train.batches import BatchPlan


def test_batch_plan_deals_the_same_global_batches_whatever_the_split():
    one = BatchPlan(num_samples=7, micro_batch_size=1, world_size=1, grad_accum=4, seed=3)
    two = BatchPlan(num_samples=7, micro_batch_size=2, world_size=2, grad_accum=1, seed=3)
    assert one.steps_per_epoch == two.steps_per_epoch == 2
    for step in range(2):
        flat_one = [slot for micro in one.micro_batches(0, step, 0) for slot in micro]
        flat_two = [slot for rank in (0, 1) for micro in two.micro_batches(0, step, rank) for slot in micro]
        assert sorted(flat_one) == sorted(flat_two)
    real = [i for step in range(2) for micro in one.micro_batches(0, step, 0) for i, is_real in micro if is_real]
    assert sorted(real) == list(range(7))  # every sample exactly once per epoch, placeholders not counted


def test_two_accumulated_micro_batches_equal_one_double_batch(tmp_path):
    losses_acc, state_acc = trainer_harness.run(str(tmp_path / "acc"), micro_batch_size=1, grad_accum=2)
    losses_big, state_big = trainer_harness.run(str(tmp_path / "big"), micro_batch_size=2, grad_accum=1)
    assert len(losses_acc) == len(losses_big) == 6
    torch.testing.assert_close(torch.tensor(losses_acc), torch.tensor(losses_big), rtol=1e-5, atol=1e-6)
    for name in state_big:
        torch.testing.assert_close(state_acc[name], state_big[name], rtol=1e-4, atol=1e-5)
    assert losses_big[-1] < losses_big[0]  # it learns


def test_resume_from_a_mid_run_checkpoint_gives_the_same_drafter(tmp_path):
    out = str(tmp_path / "run")
    full_losses, full_state = trainer_harness.run(out, 2, 1, save_every=2)  # 6 steps, checkpoints at 2, 4, 6
    with open(os.path.join(out, "checkpoints", "latest"), "w") as f:
        f.write("step2")  # as if the run had been killed during step 3
    os.remove(os.path.join(out, "metrics.jsonl"))
    resumed_losses, resumed_state = trainer_harness.run(out, 2, 1, save_every=2)
    # Data order, anchors, optimizer and LR schedule all resume: steps 3..6 repeat exactly.
    torch.testing.assert_close(torch.tensor(resumed_losses), torch.tensor(full_losses[2:]), rtol=1e-6, atol=1e-7)
    for name in full_state:
        torch.testing.assert_close(resumed_state[name], full_state[name], rtol=1e-6, atol=1e-7)


@pytest.mark.multiproc
@pytest.mark.parametrize("zero_stage", [2])
def test_two_process_zero_matches_one_process(tmp_path, zero_stage):
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    out = tmp_path / "two"
    out.mkdir()
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29633",
         "tests/trainer_harness.py", str(out), "1", "1", str(zero_stage)],
        check=True, env=env, timeout=600,
    )
    result = torch.load(out / "result.pt", weights_only=True)
    one_losses, one_state = trainer_harness.run(str(tmp_path / "one"), micro_batch_size=1, grad_accum=2)
    # Same global batches and the same global normalisation: only the float summation order differs.
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(one_losses), rtol=1e-4, atol=1e-5)
    for name in one_state:
        torch.testing.assert_close(result["state"][name], one_state[name], rtol=1e-3, atol=1e-4)
