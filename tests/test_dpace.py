"""D-PACE loss weighting (arXiv 2605.18810): the weights against a loop over the paper's formula, the gradient
identity it rests on, the chunked loss against a dense one, exact accumulation, and the exp-decay default."""

import dataclasses
import json
import os

import pytest
import torch
import torch.nn.functional as F

from dflash.config import compose
from dflash.pipeline import Pipeline
from dflash.config.schema import TrainSettings
from dflash.train.loop import train
from dflash.train.metrics_log import MetricsLog
from dflash.train.objective import dpace_weights, loss_normaliser, weighted_block_loss
from tests import trainer_harness

BATCH, ANCHORS, BLOCK, HIDDEN, VOCAB = 2, 3, 5, 8, 11


def loop_weights(prob: torch.Tensor, mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """w_k = sum over loss positions m >= k of prod over loss positions i <= m of (alpha + (1 - alpha) q_i)."""
    weights = torch.zeros_like(prob, dtype=torch.float64)
    for b in range(prob.shape[0]):
        for n in range(prob.shape[1]):
            for k in range(BLOCK):
                if not mask[b, n, k]:
                    continue
                for m in range(k, BLOCK):
                    if not mask[b, n, m]:
                        continue
                    reach = 1.0
                    for i in range(m + 1):
                        if mask[b, n, i]:
                            reach *= alpha + (1 - alpha) * float(prob[b, n, i])
                    weights[b, n, k] += reach
    return weights


def loop_surrogate(prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Expected accepted length (minus the bonus token) of every block, summed: sum_m prod_{i <= m} q_i."""
    total = prob.new_zeros(())
    for b in range(prob.shape[0]):
        for n in range(prob.shape[1]):
            reach = prob.new_ones(())
            for k in range(BLOCK):
                if mask[b, n, k]:
                    reach = reach * prob[b, n, k]
                    total = total + reach
    return total


def block_mask() -> torch.Tensor:
    """Position 0 (the anchor) never carries loss; one block ends early, one has a hole, one is padding."""
    mask = torch.ones(BATCH, ANCHORS, BLOCK, dtype=torch.bool)
    mask[:, :, 0] = False
    mask[0, 1, 3:] = False
    mask[1, 0, 2] = False
    mask[1, 2] = False
    return mask


def random_case(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(BATCH, ANCHORS * BLOCK, HIDDEN, generator=generator)
    head = torch.randn(VOCAB, HIDDEN, generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, ANCHORS, BLOCK), generator=generator)
    # Exp-decay-like weights: D-PACE reads only which of them are non-zero.
    weights = torch.rand(BATCH, ANCHORS, BLOCK, generator=generator) * block_mask()
    return hidden, head, labels, weights


def label_probabilities(hidden, head, labels):
    logits = hidden @ head.t()
    return logits.softmax(-1).gather(-1, labels.reshape(BATCH, -1, 1)).view(labels.shape)


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.5, 1.0])
def test_weights_equal_a_loop_over_the_paper_formula(alpha):
    prob = torch.rand(BATCH, ANCHORS, BLOCK, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    mask = block_mask()
    got = dpace_weights(prob, mask, alpha)
    torch.testing.assert_close(got, loop_weights(prob, mask, alpha), rtol=1e-12, atol=1e-12)
    assert (got[~mask] == 0).all()
    if alpha == 1.0:  # no confidence at all: w_k counts the loss positions from k on
        assert got[0, 0].tolist() == [0.0, 4.0, 3.0, 2.0, 1.0]


def test_weight_is_the_derivative_of_the_smoothed_surrogate():
    """Eq. 8: w_k = d/d(log q~_k) of sum_m prod_{i <= m} q~_i."""
    alpha = 0.5
    prob = torch.rand(BATCH, ANCHORS, BLOCK, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    mask = block_mask()
    log_smoothed = torch.log(alpha + (1 - alpha) * prob).requires_grad_()
    loop_surrogate(log_smoothed.exp(), mask).backward()
    torch.testing.assert_close(log_smoothed.grad, dpace_weights(prob, mask, alpha), rtol=1e-12, atol=1e-12)


def test_unsmoothed_dpace_gradient_is_the_acceptance_surrogate_gradient():
    """With alpha = 0 the loss gradient is exactly minus the gradient of the expected accepted length."""
    hidden, head, labels, weights = random_case()
    hidden.requires_grad_()
    loss, *_ = weighted_block_loss(hidden, head, labels, weights, chunk_size=4, weighting="dpace", dpace_alpha=0.0)
    (loss_grad,) = torch.autograd.grad(loss, hidden)
    surrogate = loop_surrogate(label_probabilities(hidden, head, labels), weights != 0)
    (surrogate_grad,) = torch.autograd.grad(surrogate, hidden)
    torch.testing.assert_close(loss_grad, -surrogate_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk_size", [3, 7, 4096])  # chunks that end mid-block and one chunk for everything
def test_chunked_dpace_loss_equals_the_dense_loss(chunk_size):
    hidden, head, labels, weights = random_case(seed=3)
    hidden.requires_grad_()
    loss, weight_sum, correct, counts = weighted_block_loss(
        hidden, head, labels, weights, chunk_size=chunk_size, weighting="dpace", dpace_alpha=0.5
    )
    (grad,) = torch.autograd.grad(loss, hidden)

    dense_hidden = hidden.detach().clone().requires_grad_()
    logits = (dense_hidden @ head.t()).view(BATCH, ANCHORS, BLOCK, VOCAB)
    ce = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none").view_as(weights)
    position_weights = loop_weights(torch.exp(-ce.detach()), weights != 0, 0.5).float()  # detached: Eq. 9
    dense = (ce * position_weights).sum()
    (dense_grad,) = torch.autograd.grad(dense, dense_hidden)
    torch.testing.assert_close(loss, dense, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, dense_grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight_sum, position_weights.sum(), rtol=1e-6, atol=1e-6)
    assert counts.tolist() == (weights != 0).sum(dim=(0, 1)).tolist()
    assert correct.sum() <= counts.sum()


def test_dpace_normaliser_counts_valid_anchors_and_exp_decay_sums_weights():
    _, _, _, weights = random_case()
    assert loss_normaliser(weights, "dpace").item() == 5  # 6 blocks, one of them padding
    assert torch.equal(loss_normaliser(weights, "exp_decay"), weights.sum())


def test_exp_decay_is_the_default_and_is_the_weighted_cross_entropy():
    hidden, head, labels, weights = random_case(seed=4)
    hidden.requires_grad_()
    got = weighted_block_loss(hidden, head, labels, weights, chunk_size=4)
    dense = hidden.detach().double().requires_grad_()
    logits = dense.reshape(-1, HIDDEN) @ head.double().t()
    ce = F.cross_entropy(logits, labels.reshape(-1), reduction="none")
    expected = (ce * weights.reshape(-1).double()).sum()
    torch.testing.assert_close(got[0].double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], weights.sum())
    got[0].backward()
    expected.backward()
    torch.testing.assert_close(hidden.grad.double(), dense.grad, rtol=1e-4, atol=1e-6)
    assert compose(["+experiment=tiny"]).train.loss_weighting == "exp_decay"
    assert trainer_harness.settings(1, 1).loss_weighting == "exp_decay"


def test_bad_settings_are_refused():
    base = trainer_harness.settings(1, 1)
    with pytest.raises(ValueError, match="'exp_decay', 'dpace'"):
        dataclasses.replace(base, loss_weighting="d-pace")
    with pytest.raises(ValueError, match="dpace_alpha"):
        dataclasses.replace(base, loss_weighting="dpace", dpace_alpha=1.5)
    hidden, head, labels, weights = random_case()
    with pytest.raises(ValueError, match="kl"):
        weighted_block_loss(hidden, head, labels, weights, weighting="kl")


def test_the_pipeline_passes_the_weighting_and_fingerprints_it(tmp_path):
    tiny = ["+experiment=tiny", f"run_dir={tmp_path}"]
    default = Pipeline(compose(tiny))
    dpace = Pipeline(compose(tiny + ["train.loss_weighting=dpace", "train.dpace_alpha=0.3"]))
    assert (dpace.settings.train.loss_weighting, dpace.settings.train.dpace_alpha) == ("dpace", 0.3)
    assert dpace.train.fingerprint() != default.train.fingerprint()
    with pytest.raises(ValueError, match="expected one of"):
        Pipeline(compose(tiny + ["train.loss_weighting=focal"])).settings.train


def run_dpace(out_dir: str, micro_batch_size: int, grad_accum: int) -> tuple[list[dict], dict[str, torch.Tensor]]:
    settings: TrainSettings = dataclasses.replace(
        trainer_harness.settings(micro_batch_size, grad_accum), loss_weighting="dpace"
    )
    from dflash.train.engine import init_distributed

    init_distributed()  # a 1-process group, as the trainer harness sets up
    log = MetricsLog(out_dir, enabled=True, tensorboard=False, wandb_mode="disabled", wandb_project="t", config={})
    state = train(settings, trainer_harness.drafter_config(), trainer_harness.synthetic_store(),
                  trainer_harness.frozen_head(), os.path.join(out_dir, "checkpoints"), log, rank=0, world_size=1,
                  device=torch.device("cpu"), show_progress=False)
    log.close()
    with open(os.path.join(out_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f], state


def test_dpace_accumulation_equals_one_double_batch_and_learns(tmp_path):
    metrics_acc, state_acc = run_dpace(str(tmp_path / "acc"), micro_batch_size=1, grad_accum=2)
    metrics_big, state_big = run_dpace(str(tmp_path / "big"), micro_batch_size=2, grad_accum=1)
    assert len(metrics_acc) == len(metrics_big) == 6
    losses_acc, losses_big = [m["loss"] for m in metrics_acc], [m["loss"] for m in metrics_big]
    torch.testing.assert_close(torch.tensor(losses_acc), torch.tensor(losses_big), rtol=1e-5, atol=1e-6)
    for name in state_big:
        torch.testing.assert_close(state_acc[name], state_big[name], rtol=1e-4, atol=1e-5)
    first, last = losses_big[:3], losses_big[3:]  # one epoch each: the same samples
    assert sum(last) < sum(first)  # it learns
