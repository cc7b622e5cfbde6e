"""KL to the target's distribution (train.kl_weight, capture=colocated): the chunked loss against a dense float64
reference, the CE path untouched at kl_weight=0, the target's final hidden state, and a tiny colocated run."""

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dflash.config import compose
from dflash.data.dataset import load_dataset_dir
from dflash.data.feature_source import collate
from dflash.extract.colocated import ColocatedFeatureSource
from dflash.pipeline import Pipeline
from dflash.train.engine import init_distributed
from dflash.train.loop import train
from dflash.train.metrics_log import MetricsLog
from dflash.train.objective import block_target_hidden, dpace_weights, weighted_block_loss
from tests import trainer_harness

BATCH, ANCHORS, BLOCK, HIDDEN, VOCAB = 2, 3, 5, 16, 11
TINY = ["+experiment=tiny", "show_progress=false", "stages=[data,capture,train]"]
STORED_CURVE = Path(__file__).parent / "data" / "tiny_loss_curve.json"


def random_case(seed: int = 0):
    """Drafter hidden, head, labels, exp-decay-like weights (anchor, a short block, a hole, a padding block) and
    the target's final hidden states per block position."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(BATCH, ANCHORS * BLOCK, HIDDEN, generator=generator)
    head = torch.randn(VOCAB, HIDDEN, generator=generator) * 0.5
    labels = torch.randint(0, VOCAB, (BATCH, ANCHORS, BLOCK), generator=generator)
    mask = torch.ones(BATCH, ANCHORS, BLOCK)
    mask[:, :, 0] = 0
    mask[0, 1, 3:] = 0
    mask[1, 0, 2] = 0
    mask[1, 2] = 0
    weights = torch.rand(BATCH, ANCHORS, BLOCK, generator=generator) * mask
    target_hidden = torch.randn(BATCH, ANCHORS * BLOCK, HIDDEN, generator=generator)
    return hidden, head, labels, weights, target_hidden


def dense_reference(hidden, head, labels, weights, target_hidden, kl_weight, weighting):
    """Whole logits in float64: sum over positions of weight x ((1 - w) CE + w KL(p_target || q_drafter))."""
    log_q = (hidden.double() @ head.double().t()).log_softmax(-1).view(BATCH, ANCHORS, BLOCK, VOCAB)
    log_p = (target_hidden.double() @ head.double().t()).log_softmax(-1).view(BATCH, ANCHORS, BLOCK, VOCAB)
    ce = -log_q.gather(-1, labels[..., None]).squeeze(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    if weighting == "dpace":
        weights = dpace_weights(torch.exp(-ce.detach()), weights != 0, 0.5)
    return (weights * ((1 - kl_weight) * ce + kl_weight * kl)).sum()


@pytest.mark.parametrize("weighting", ["exp_decay", "dpace"])
@pytest.mark.parametrize("chunk_size", [1, 4, 7, 4096])  # chunks that end mid-block and one chunk for everything
def test_chunked_kl_loss_equals_a_dense_float64_reference(chunk_size, weighting):
    hidden, head, labels, weights, target_hidden = random_case(seed=1)
    hidden.requires_grad_()
    loss, _, correct, counts = weighted_block_loss(hidden, head, labels, weights, chunk_size, weighting, 0.5,
                                                   kl_weight=0.3, target_hidden=target_hidden)
    (grad,) = torch.autograd.grad(loss, hidden)
    dense_hidden = hidden.detach().double().requires_grad_()
    dense = dense_reference(dense_hidden, head, labels, weights, target_hidden, 0.3, weighting)
    (dense_grad,) = torch.autograd.grad(dense, dense_hidden)
    torch.testing.assert_close(loss.double(), dense, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.double(), dense_grad, rtol=1e-4, atol=1e-6)
    assert counts.tolist() == (weights != 0).sum(dim=(0, 1)).tolist()
    assert correct.sum() <= counts.sum()


@pytest.mark.parametrize("weighting", ["exp_decay", "dpace"])
def test_kl_weight_zero_is_the_ce_path_bit_for_bit(weighting):
    hidden, head, labels, weights, target_hidden = random_case(seed=2)
    results = []
    for extra in ({}, {"kl_weight": 0.0, "target_hidden": target_hidden}):
        leaf = hidden.clone().requires_grad_()
        out = weighted_block_loss(leaf, head, labels, weights, 4, weighting, 0.5, **extra)
        results.append((out, torch.autograd.grad(out[0], leaf)[0]))
    (plain, plain_grad), (zero, zero_grad) = results
    assert all(torch.equal(a, b) for a, b in zip(plain, zero))
    assert torch.equal(plain_grad, zero_grad)
    # A pure KL loss is a different number: the KL path really is switched off at 0.
    kl = weighted_block_loss(hidden, head, labels, weights, 4, weighting, 0.5, 1.0, target_hidden)[0]
    assert not torch.allclose(kl, plain[0])


def test_pure_kl_to_a_one_hot_target_is_the_cross_entropy():
    """head = identity on the first VOCAB dims and target rows 1e4 x one-hot(label): p is one-hot, KL = CE."""
    hidden, _, labels, weights, _ = random_case(seed=3)
    head = torch.eye(VOCAB, HIDDEN)
    target_hidden = 1e4 * F.one_hot(labels.reshape(BATCH, -1), HIDDEN).float()
    ce_leaf, kl_leaf = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    ce = weighted_block_loss(ce_leaf, head, labels, weights, chunk_size=4)
    kl = weighted_block_loss(kl_leaf, head, labels, weights, 4, kl_weight=1.0, target_hidden=target_hidden)
    torch.testing.assert_close(kl[0], ce[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.autograd.grad(kl[0], kl_leaf)[0], torch.autograd.grad(ce[0], ce_leaf)[0],
                               rtol=1e-5, atol=1e-7)
    assert torch.equal(kl[2], ce[2]) and torch.equal(kl[3], ce[3])


def test_block_target_hidden_takes_the_row_before_each_predicted_token():
    target_final = torch.randn(2, 9, 3)
    anchors = torch.tensor([[0, 4], [2, 7]])
    got = block_target_hidden(target_final, anchors, block_size=4).view(2, 2, 4, 3)
    for b in range(2):
        for n in range(2):
            for k in range(4):
                position = min(max(int(anchors[b, n]) + k - 1, 0), 8)  # k = 0 and past the end carry no loss
                assert torch.equal(got[b, n, k], target_final[b, position])


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_capture_with_final_is_the_hf_last_hidden_state(tiny_target, family):
    adapter = tiny_target(family)
    ids = torch.randint(5, adapter.vocab_size - 2, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    features, final = adapter.capture_with_final(ids, mask, [0, 2])
    with torch.no_grad():
        out = adapter.model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
    assert torch.equal(features, adapter.capture(ids, mask, [0, 2]))
    torch.testing.assert_close(final, out.hidden_states[-1], rtol=1e-6, atol=1e-6)
    # The LM head of it is the target's logits: what the KL loss rebuilds chunk by chunk.
    torch.testing.assert_close(final @ adapter.lm_head_weight().t(), out.logits, rtol=1e-5, atol=1e-5)


def test_kl_weight_is_checked_and_needs_the_target_states():
    with pytest.raises(ValueError, match="kl_weight"):
        dataclasses.replace(trainer_harness.settings(1, 1), kl_weight=1.5)
    hidden, head, labels, weights, _ = random_case()
    with pytest.raises(ValueError, match="target_hidden"):
        weighted_block_loss(hidden, head, labels, weights, kl_weight=0.5)


def train_with_kl(out_dir: Path, micro_batch_size: int, grad_accum: int, store: list[dict]) -> list[float]:
    """Losses of a synthetic 1-process run with kl_weight 0.5 (the trainer harness's store, model and head)."""
    init_distributed()
    settings = dataclasses.replace(trainer_harness.settings(micro_batch_size, grad_accum), kl_weight=0.5)
    log = MetricsLog(str(out_dir), enabled=True, tensorboard=False, wandb_mode="disabled", wandb_project="t",
                     config={})
    try:
        train(settings, trainer_harness.drafter_config(), store, trainer_harness.frozen_head(),
              os.path.join(out_dir, "checkpoints"), log, rank=0, world_size=1, device=torch.device("cpu"),
              show_progress=False)
    finally:
        log.close()
    with open(out_dir / "metrics.jsonl", encoding="utf-8") as f:
        return [json.loads(line)["loss"] for line in f]


def test_kl_accumulation_equals_one_double_batch(tmp_path):
    """Padded target states, gathered per micro-batch: 2 accumulated micro-batches of 1 == one batch of 2."""
    store = trainer_harness.synthetic_store()
    generator = torch.Generator().manual_seed(5)
    for sample in store:
        sample["target_final"] = torch.randn(sample["input_ids"].shape[0], trainer_harness.HIDDEN, generator=generator)
    accumulated = train_with_kl(tmp_path / "acc", 1, 2, store)
    big = train_with_kl(tmp_path / "big", 2, 1, store)
    torch.testing.assert_close(torch.tensor(accumulated), torch.tensor(big), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="capture.mode=colocated"):
        train_with_kl(tmp_path / "plain", 2, 1, trainer_harness.synthetic_store())


@pytest.fixture(scope="module")
def kl_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("kl")
    Pipeline(compose(TINY + [f"run_dir={run_dir}", "capture=colocated", "train.kl_weight=0.5"])).run()
    return run_dir


def test_colocated_kl_run_trains(kl_run):
    with open(kl_run / "metrics.jsonl", encoding="utf-8") as f:
        losses = [json.loads(line)["loss"] for line in f]
    stored = json.loads(STORED_CURVE.read_text())["loss"]
    assert len(losses) == len(stored)
    assert sum(losses[-3:]) < sum(losses[:3])
    assert abs(losses[0] - stored[0]) > 1e-3  # half of it is KL, not the stored CE curve
    assert (kl_run / "export" / "done.json").exists()


def test_colocated_source_hands_out_padded_final_states(kl_run):
    pipeline = Pipeline(compose(TINY + [f"run_dir={kl_run}", "capture=colocated", "train.kl_weight=0.5"]))
    source = pipeline.train.colocated_source()
    assert source.final_hidden
    samples = source.get_many([2, 5])
    batch = collate(samples)
    for row, sample in enumerate(samples):
        length = sample["input_ids"].shape[0]
        ids = sample["input_ids"][None]
        with torch.no_grad():
            out = pipeline.adapter.model(input_ids=ids, output_hidden_states=True, use_cache=False)
        torch.testing.assert_close(sample["target_final"], out.hidden_states[-1][0], rtol=1e-5, atol=1e-5)
        assert torch.equal(batch["target_final"][row, :length], sample["target_final"])
        assert not batch["target_final"][row, length:].any()
    plain = ColocatedFeatureSource(pipeline.adapter, load_dataset_dir(kl_run / "data"), source.layer_ids, "float32")
    assert "target_final" not in plain[2] and "target_final" not in collate([plain[2]])


def test_a_non_finite_final_state_is_named(kl_run, monkeypatch):
    pipeline = Pipeline(compose(TINY + [f"run_dir={kl_run}", "capture=colocated", "train.kl_weight=0.5"]))
    source = pipeline.train.colocated_source()
    real = pipeline.adapter.capture_with_final

    def broken(*args):
        features, final = real(*args)
        return features, final.index_fill(2, torch.tensor([0]), float("nan"))

    monkeypatch.setattr(pipeline.adapter, "capture_with_final", broken)
    with pytest.raises(ValueError, match="tap final norm has non-finite"):
        source.get_many([1])


def test_offline_capture_refuses_kl_before_any_work(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(ValueError, match="this run has capture=offline"):
        Pipeline(compose(TINY + [f"run_dir={run_dir}", "capture=offline", "train.kl_weight=0.5"]))
    assert not run_dir.exists()


def test_kl_weight_is_passed_and_fingerprinted(tmp_path):
    tiny = ["+experiment=tiny", f"run_dir={tmp_path}", "capture=colocated"]
    default, kl = Pipeline(compose(tiny)), Pipeline(compose(tiny + ["train.kl_weight=0.5"]))
    assert (default.settings.train.kl_weight, kl.settings.train.kl_weight) == (0.0, 0.5)
    assert kl.train.fingerprint() != default.train.fingerprint()
    assert kl.capture.fingerprint() == default.capture.fingerprint()
